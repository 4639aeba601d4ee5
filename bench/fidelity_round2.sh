#!/bin/bash
# Issue 33's re-runs (heads that learn like the references, round 2), one job at a time on one data set:
# EAGLE-3 with every deep position vs chain-sampled deep passes (item 8), P-EAGLE with 1 and 4 decoder
# layers (loss and embedding table as upstream; items 1, 2, 4), DFlash (block-sparse attention, learned
# mask row, anchors as upstream; items 5-7), MINUTES of wall-clock training each, then the held-out curves,
# the training step costs and the vLLM gate of every P-EAGLE and DFlash export.
#
#   MINUTES=10 OUT=runs/round2 bash bench/fidelity_round2.sh
#
# Data: ShareGPT's own replies to the first 1,000 conversations (regeneration off: the same rows for every
# run, and no generation inside the session's budget), 768 tokens, 5% held out.
set -euo pipefail
MINUTES=${MINUTES:-10}
OUT=${OUT:-runs/round2}
RUNS=${RUNS:-"eagle3_full eagle3_cod peagle_1 peagle_4 dflash"}
DATA="--data.limit 1000 --data.max_length 768 --data.held_out_fraction 0.05 --data.regenerate.enabled false
      --tracking.report_to none --training.num_epochs 20 --training.eval_every 50"
mkdir -p "$OUT"
declare -A RECIPE=([eagle3_full]=eagle3 [eagle3_cod]=eagle3 [peagle_1]=peagle [peagle_4]=peagle [dflash]=dflash)
declare -A EXTRA=([eagle3_full]="--drafter.down_sample_ratio 1" [eagle3_cod]="--drafter.down_sample_ratio 0.7"
                  [peagle_1]="--drafter.num_layers 1" [peagle_4]="--drafter.num_layers 4" [dflash]="")
for run in $RUNS; do
  python -m draftsmith.train "recipes/smollm2-${RECIPE[$run]}.yaml" $DATA ${EXTRA[$run]} \
    --training.max_minutes "$MINUTES" --training.output_dir "$OUT/$run" > "$OUT/train_$run.log" 2>&1
done
CURVES=()
for run in $RUNS; do CURVES+=(--run "$run=$OUT/$run"); done
python bench/learning_curve.py "${CURVES[@]}" --depths 1 2 3 --out "$OUT/curves.png" > "$OUT/curves.md"
for run in $RUNS; do
  case $run in peagle_*|dflash)
    rm -rf "$OUT/$run-speculators"
    draftsmith-export "$OUT/$run/checkpoint-final" --format speculators --out "$OUT/$run-speculators" --check vllm \
      > "$OUT/gate_$run.log" 2>&1 || echo "gate $run: exit $?" >> "$OUT/gate_$run.log"
  esac
done
echo "done: $OUT (curves.md, train_*.log, gate_*.log)"
