#!/usr/bin/env bash
# EAGLE-1, EAGLE-1 + HASS, EAGLE-3 (k = 1) and EAGLE-3 (k = 7) on the bundled SmolLM2: one data
# set (the target's regenerated replies, recipes/smollm2-eagle3.yaml's data section), one shared
# offline feature cache, the same wall-clock training budget each, then one acceptance table per
# temperature with every head against plain decoding (interleaved, same run).
#
#   bash bench/eagle3_compare.sh            # MINUTES=10 PER_CATEGORY=2 MAX_NEW=128 CORES=0 OUT=runs/compare
#
# Every step is pinned to the cores in CORES (default: one core, so that a budget buys the same
# compute whatever else runs on the machine); regeneration and the shared feature extraction run
# first, outside the budgets.
set -euo pipefail
cd "$(dirname "$0")/.."
MINUTES="${MINUTES:-10}"
PER_CATEGORY="${PER_CATEGORY:-2}"
MAX_NEW="${MAX_NEW:-128}"
CORES="${CORES:-0}"
OUT="${OUT:-runs/compare}"
PYTHON="${PYTHON:-python3}"
THREADS=$(( $(echo "$CORES" | tr ',' '\n' | wc -l) ))
FEATURES="$OUT/features"
PIN=(taskset -c "$CORES" env OMP_NUM_THREADS="$THREADS")

# The EAGLE-3 recipe's data section, given to every head; offline features shared by all four.
DATA=(--data.max_length 768 --data.held_out_fraction 0.01 --data.limit 1000 --data.regenerate.enabled true
      --data.regenerate.max_new_tokens 256 --data.regenerate.max_turns 1 --data.regenerate.temperature 0.0
      --data.regenerate.batch_size 16)
COMMON=(--drafter.features offline --drafter.features_dir "$FEATURES" --drafter.draft_vocab_size 8192
        --training.max_minutes "$MINUTES" --training.num_epochs 50 --training.batch_size 4
        --training.gradient_accumulation_steps 1 --training.learning_rate 1e-3 --training.warmup_steps 10
        --training.lr_schedule linear --training.eval_every 0 --training.save_every 0 --tracking.report_to none)

# Regeneration and features (cached; a second run of this script skips them): a one-step run.
"${PIN[@]}" "$PYTHON" train/eagle3.py recipes/smollm2-eagle3.yaml "${DATA[@]}" "${COMMON[@]}" --training.max_steps 1 \
    --output_dir "$OUT/prepare"

"${PIN[@]}" "$PYTHON" train/eagle.py recipes/smollm2-eagle.yaml "${DATA[@]}" "${COMMON[@]}" \
    --output_dir "$OUT/eagle1"
"${PIN[@]}" "$PYTHON" train/eagle.py recipes/smollm2-eagle.yaml "${DATA[@]}" "${COMMON[@]}" \
    --drafter.ttt_steps 3 --drafter.top_k_loss 10 --output_dir "$OUT/eagle1-hass"
"${PIN[@]}" "$PYTHON" train/eagle3.py recipes/smollm2-eagle3.yaml "${DATA[@]}" "${COMMON[@]}" \
    --drafter.ttt_steps 1 --output_dir "$OUT/eagle3-k1"
"${PIN[@]}" "$PYTHON" train/eagle3.py recipes/smollm2-eagle3.yaml "${DATA[@]}" "${COMMON[@]}" \
    --drafter.ttt_steps 7 --output_dir "$OUT/eagle3-k7"

TREE="depth=6&top_k=3&budget=12"
for temperature in 0 1; do
    "${PIN[@]}" "$PYTHON" eval/run.py --per-category "$PER_CATEGORY" --max-new-tokens "$MAX_NEW" \
        --temperature "$temperature" \
        --drafter "eagle:$OUT/eagle1/checkpoint-final?$TREE&name=eagle1" \
        --drafter "eagle:$OUT/eagle1-hass/checkpoint-final?$TREE&name=eagle1+hass" \
        --drafter "eagle3:$OUT/eagle3-k1/checkpoint-final?$TREE&name=eagle3-k1" \
        --drafter "eagle3:$OUT/eagle3-k7/checkpoint-final?$TREE&name=eagle3-k7" \
        --out "$OUT/results-t$temperature"
done
