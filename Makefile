PYTHON ?= python3
# The main job's size; override on the command line, e.g. `make demo LIMIT=80 MAX_NEW_TOKENS=256`.
LIMIT ?= 10
MAX_NEW_TOKENS ?= 128
DEMO_DIR ?= runs/demo
# A short budget of recipes/smollm2-eagle.yaml (the full recipe takes up to an hour on 2 CPU cores).
DEMO_TRAIN ?= --data.limit 400 --training.num_epochs 2 --training.eval_every 0 --training.save_every 50

.PHONY: install demo train-demo eval-demo test

install:
	PYTHON=$(PYTHON) bash scripts/install.sh

# Main job: train an EAGLE head on the bundled SmolLM2 target and ShareGPT, then print its
# acceptance table against prompt lookup on MT-bench.
demo: install train-demo eval-demo

train-demo:
	$(PYTHON) train/eagle.py recipes/smollm2-eagle.yaml --output_dir $(DEMO_DIR) $(DEMO_TRAIN)

eval-demo:
	$(PYTHON) eval/run.py --target default --dtype bfloat16 --bench mt_bench --limit $(LIMIT) \
		--max-new-tokens $(MAX_NEW_TOKENS) --temperature 0 \
		--drafter eagle:$(DEMO_DIR)/checkpoint-final --drafter prompt_lookup --out results/demo

test: install
	$(PYTHON) -m pytest
