PYTHON ?= python3
# The main job's size; override on the command line, e.g. `make demo TRAIN_MINUTES=10 PER_CATEGORY=2`.
TRAIN_MINUTES ?= 2.5
# Start no MT-bench question after this many minutes of decoding (0: no limit).
EVAL_MINUTES ?= 2.0
PER_CATEGORY ?= 1
MAX_NEW_TOKENS ?= 64
DEMO_DIR ?= runs/demo
# pytest-xdist workers for `make test`, a test file each (module fixtures train once); 0 runs the
# suite in this process.
TEST_WORKERS ?= 2

.PHONY: install install-core demo lint test

install:
	PYTHON=$(PYTHON) bash scripts/install.sh

# What the demo runs, without vLLM and the test tools (scripts/install.sh says why).
install-core:
	PYTHON=$(PYTHON) EXTRAS=none bash scripts/install.sh

# Main job: train an EAGLE head on the bundled SmolLM2 target and ShareGPT for TRAIN_MINUTES, then
# print its acceptance table against plain decoding and prompt lookup on MT-bench, and the wall
# time of every stage.
demo: install-core
	$(PYTHON) eval/demo.py --out-dir $(DEMO_DIR) --train-minutes $(TRAIN_MINUTES) \
		--per-category $(PER_CATEGORY) --max-new-tokens $(MAX_NEW_TOKENS) --eval-minutes $(EVAL_MINUTES) --results results/demo

# Style and layering: ruff (lint and format) and import-linter's contracts in pyproject.toml.
lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	lint-imports

test: install lint
	$(PYTHON) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
