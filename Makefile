PYTHON ?= python3
# The main job's size; override on the command line, e.g. `make demo LIMIT=80 MAX_NEW_TOKENS=256`.
LIMIT ?= 10
MAX_NEW_TOKENS ?= 128

.PHONY: install demo test

install:
	PYTHON=$(PYTHON) bash scripts/install.sh

demo: install
	$(PYTHON) eval/run.py --target default --dtype bfloat16 --bench mt_bench --limit $(LIMIT) \
		--max-new-tokens $(MAX_NEW_TOKENS) --temperature 0 \
		--drafter prompt_lookup --drafter oracle --out results/demo

test: install
	$(PYTHON) -m pytest
