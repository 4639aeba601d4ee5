#!/bin/bash
# EAGLE-3 vs DFlash vs DSpark at one training budget (issue 44): the same data and stored features
# (the target's fused layers, extracted once and read by all three), the same minutes of training
# each, then MT-bench (first questions of each category) and its coding questions (both turns) in draftsmith's engine: acceptance length per
# position and speedup against plain decoding and prompt lookup in the same run, DSpark's
# confidence cut (priced and threshold) against its fixed block, and DSpark's acceptance length
# against DFlash's and EAGLE-3's with a paired bootstrap interval over the prompt turns.
#
#   MINUTES=8 OUT=runs/dspark bash bench/dspark_compare.sh
#
# Knobs: MINUTES (training minutes per kind), LIMIT (ShareGPT conversations), REGENERATE (true:
# the target rewrites the replies first, as the recipes do; false: ShareGPT's own replies),
# PER_CATEGORY and TOKENS (MT-bench prompts per category and new tokens), DTYPE (the runs' dtype:
# auto measures this CPU). One job at a time: on a 2-core machine parallel jobs skew each other.
set -euo pipefail
MINUTES=${MINUTES:-8}
OUT=${OUT:-runs/dspark}
LIMIT=${LIMIT:-400}
REGENERATE=${REGENERATE:-false}
PER_CATEGORY=${PER_CATEGORY:-1}
TOKENS=${TOKENS:-96}
DTYPE=${DTYPE:-auto}
COMMON="--target.dtype $DTYPE --data.limit $LIMIT --data.max_length 512 --data.held_out_fraction 0.05
        --data.regenerate.enabled $REGENERATE --drafter.features offline --tracking.report_to none"
mkdir -p "$OUT"
for kind in eagle3 dflash dspark; do
  if [ ! -f "$OUT/$kind/checkpoint-final/config.json" ]; then
    python "train/$kind.py" "recipes/smollm2-$kind.yaml" $COMMON --training.max_minutes "$MINUTES" \
      --training.num_epochs 50 --training.eval_every 100 --training.output_dir "$OUT/$kind" > "$OUT/train_$kind.log" 2>&1
  fi
done
python bench/learning_curve.py --run "eagle3=$OUT/eagle3" --run "dflash=$OUT/dflash" --run "dspark=$OUT/dspark" \
  --depths 1 3 --out "$OUT/curves.png" > "$OUT/curves.md"
DSPARK="dspark:$OUT/dspark/checkpoint-final"
DRAFTERS=(--drafter "eagle3:$OUT/eagle3/checkpoint-final?name=eagle3"
          --drafter "dflash:$OUT/dflash/checkpoint-final?name=dflash"
          --drafter "$DSPARK?cut=fixed&name=dspark-fixed"
          --drafter "$DSPARK?cut=priced&name=dspark-priced"
          --drafter "$DSPARK?cut=threshold&threshold=0.5&name=dspark-threshold"
          --drafter prompt_lookup)
python eval/run.py --dtype "$DTYPE" --bench mt_bench --per-category "$PER_CATEGORY" --max-new-tokens "$TOKENS" \
  "${DRAFTERS[@]}" --out "$OUT/mt_bench" > "$OUT/mt_bench.log" 2>&1
python eval/run.py --dtype "$DTYPE" --bench mt_bench --category coding --max-new-tokens "$TOKENS" \
  "${DRAFTERS[@]}" --out "$OUT/code" > "$OUT/code.log" 2>&1
for set in mt_bench code; do
  first=--header
  for pair in "dflash dspark-fixed" "eagle3 dspark-fixed" "dspark-fixed dspark-priced" "dspark-fixed dspark-threshold"; do
    read -r base other <<< "$pair"
    python bench/paired_tau.py "$OUT/$set/results.json" --base "$base" --other "$other" $first
    first=
  done > "$OUT/$set-paired.md"
done
echo "done: $OUT (curves.md, mt_bench.log, code.log, mt_bench-paired.md, code-paired.md)"
