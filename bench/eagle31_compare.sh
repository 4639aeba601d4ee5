#!/bin/bash
# EAGLE-3 against EAGLE 3.1 (drafter.fc_norm and drafter.norm_output on) at an equal number of
# optimiser steps on the same stored features (issue 58 item 3), then both heads drafting the same
# chain in draftsmith's engine on MT-bench questions asked alone and after CONTEXT tokens of other
# ShareGPT conversations (bench/long_prompts.py): acceptance length per set, and EAGLE 3.1's against
# EAGLE-3's with a paired bootstrap interval over the prompts. Acceptance lengths are counts, so other
# jobs on the machine change the wall times only.
#
#   STEPS=40 OUT=runs/eagle31 FEATURES=runs/objectives/features bash bench/eagle31_compare.sh
#
# Knobs: STEPS, LIMIT (ShareGPT conversations trained on), FEATURES (a feature store of the same data
# section to copy in place of extracting one), CONTEXT (tokens before each long prompt's question),
# PER_CATEGORY and TOKENS (MT-bench questions per category and new tokens), DEPTH (the chain both
# heads draft), DTYPE. One job at a time: parallel jobs skew each other's wall times.
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-40}
OUT=${OUT:-runs/eagle31}
LIMIT=${LIMIT:-400}
FEATURES=${FEATURES:-}
CONTEXT=${CONTEXT:-2000}
PER_CATEGORY=${PER_CATEGORY:-1}
TOKENS=${TOKENS:-64}
DEPTH=${DEPTH:-5}
DTYPE=${DTYPE:-auto}
mkdir -p "$OUT"
if [ -n "$FEATURES" ] && [ ! -d "$OUT/features" ]; then
  cp -r "$FEATURES" "$OUT/features"
fi
COMMON=(--target.dtype "$DTYPE" --data.limit "$LIMIT" --data.max_length 512 --data.held_out_fraction 0.05
        --data.regenerate.enabled false --drafter.features offline --drafter.features_dir "$OUT/features"
        --training.max_steps "$STEPS" --training.max_minutes null --training.num_epochs 50
        --training.eval_every 0 --training.save_every 0 --tracking.report_to none)
declare -A OPTIONS=([eagle3]="" [eagle31]="--drafter.fc_norm true --drafter.norm_output true")
for name in eagle3 eagle31; do
  if [ ! -f "$OUT/$name/checkpoint-final/config.json" ]; then
    # shellcheck disable=SC2086  # the options are words
    /usr/bin/time -f "%e" -o "$OUT/$name.seconds" python train/eagle3.py recipes/smollm2-eagle3.yaml "${COMMON[@]}" \
      ${OPTIONS[$name]} --training.output_dir "$OUT/$name" > "$OUT/train_$name.log" 2>&1
  fi
done
python bench/long_prompts.py --out "$OUT/prompts" --context-tokens "$CONTEXT" --per-category "$PER_CATEGORY"
CHAIN="depth=$DEPTH&top_k=1&budget=$DEPTH"
for set in short long; do
  python eval/run.py --dtype "$DTYPE" --prompts "$OUT/prompts/$set.jsonl" --max-new-tokens "$TOKENS" --temperature 0 \
    --drafter "eagle3:$OUT/eagle3/checkpoint-final?name=eagle3&$CHAIN" \
    --drafter "eagle3:$OUT/eagle31/checkpoint-final?name=eagle31&$CHAIN" \
    --out "$OUT/$set" > "$OUT/$set.log" 2>&1
done
{
  python bench/paired_tau.py "$OUT/short/results.json" --base eagle3 --other eagle31 --header
  python bench/paired_tau.py "$OUT/long/results.json" --base eagle3 --other eagle31
} > "$OUT/paired.md"
for name in eagle3 eagle31; do
  echo "$name: $(cat "$OUT/$name.seconds") s; held-out top-1 per depth $(python -c "import json,sys; print(json.load(open(sys.argv[1]))['depth_accuracy'])" "$OUT/$name/checkpoint-final/config.json")"
done > "$OUT/steps.md"
echo "done: $OUT (steps.md, short.log, long.log, paired.md)"
