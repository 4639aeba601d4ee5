#!/bin/bash
# DFlash vs Domino at an equal number of training steps or minutes (issue 57 items 3, 4): the same
# data and stored features (the target's fused layers, extracted once and read by both), the same
# backbone (2 Qwen3 layers, blocks of 8), STEPS optimiser steps each or, with MINUTES set, MINUTES
# of wall-clock training each (training.max_minutes: the learning rate and Domino's base-loss
# weight fall over the minutes), then MT-bench (first questions of each category) in draftsmith's
# engine: acceptance length per position and speedup against plain decoding in the same run, and
# Domino's acceptance length against DFlash's with a paired bootstrap interval over the prompt
# turns; Domino's backbone alone (correction=0) is the correction head's ablation, and each WARMUPS
# arm is paired with DFlash and with Domino under the references' schedule.
#
#   STEPS=40 OUT=runs/domino bash bench/domino_compare.sh
#   MINUTES=4.5 OUT=runs/domino-minutes bash bench/domino_compare.sh
#   MINUTES=4.5 REGENERATE=true LABELS=data OUT=runs/domino-data bash bench/domino_compare.sh
#   MINUTES=4.5 REGENERATE=true LABELS=data WARMUPS="0.5 0.75" OUT=runs/domino-warmup bash bench/domino_compare.sh
#
# Knobs: STEPS (optimiser steps per kind), MINUTES (minutes per kind instead of STEPS), LIMIT
# (ShareGPT conversations), REGENERATE (true: the target rewrites the replies first, as the recipes
# do; false: ShareGPT's own replies),
# PER_CATEGORY and TOKENS (MT-bench prompts per category and new tokens), DTYPE (the runs' dtype:
# auto measures this CPU), LABELS (drafter.labels of both: auto, the recipes', is data with
# REGENERATE=true and target without; target, the target's distribution; data, the data's tokens),
# DFLASH_ARGS and DOMINO_ARGS (further overrides of one kind's training), WARMUPS (shares of the run:
# one more Domino arm each, trained with that drafter.backbone_warmup; they need the data's labels:
# LABELS=data, or auto with REGENERATE=true); the
# `domino` arm trains on the references' schedule, backbone_warmup 0, whatever the recipe says).
# Each recipe keeps its own vocabulary: DFlash's 8192 most frequent reply tokens, Domino the full
# one (it scores with the target's LM head). One job at a time: on a 2-core machine parallel jobs
# skew each other.
set -euo pipefail
STEPS=${STEPS:-40}
OUT=${OUT:-runs/domino}
LIMIT=${LIMIT:-400}
REGENERATE=${REGENERATE:-false}
PER_CATEGORY=${PER_CATEGORY:-1}
TOKENS=${TOKENS:-64}
DTYPE=${DTYPE:-auto}
MINUTES=${MINUTES:-}
LABELS=${LABELS:-auto}
DFLASH_ARGS=${DFLASH_ARGS:-}
DOMINO_ARGS=${DOMINO_ARGS:-}
WARMUPS=${WARMUPS:-}
if [ -n "$MINUTES" ]; then
  # a step count no run reaches: the clock ends both
  BUDGET="--training.max_steps 1000000 --training.max_minutes $MINUTES"
else
  # max_minutes well past the steps' time: the step count, not the clock, ends both runs
  BUDGET="--training.max_steps $STEPS --training.max_minutes 600"
fi
COMMON="--target.dtype $DTYPE --data.limit $LIMIT --data.max_length 512 --data.held_out_fraction 0.05
        --data.regenerate.enabled $REGENERATE --drafter.features offline --drafter.labels $LABELS
        --tracking.report_to none"
mkdir -p "$OUT"
if [ -n "$WARMUPS" ] && { [ "$LABELS" = target ] || { [ "$LABELS" = auto ] && [ "$REGENERATE" != true ]; }; }; then
  echo "WARMUPS: Domino's backbone warm-up learns the data's tokens: set LABELS=data, or LABELS=auto with REGENERATE=true" >&2
  exit 2
fi
ARMS="dflash domino"
for share in $WARMUPS; do ARMS="$ARMS domino-w$share"; done
DRAFTERS=(--drafter "domino:$OUT/domino/checkpoint-final?correction=0&name=domino-backbone")
PAIRS=("dflash domino" "domino-backbone domino")
for arm in $ARMS; do
  kind=${arm%%-*}
  case $arm in
    dflash) EXTRA=$DFLASH_ARGS ;;
    domino) EXTRA="--drafter.backbone_warmup 0 $DOMINO_ARGS" ;;
    *) EXTRA="$DOMINO_ARGS --drafter.backbone_warmup ${arm#domino-w}"; PAIRS+=("dflash $arm" "domino $arm") ;;
  esac
  if [ ! -f "$OUT/$arm/checkpoint-final/config.json" ]; then
    python "train/$kind.py" "recipes/smollm2-$kind.yaml" $COMMON $BUDGET $EXTRA \
      --training.eval_every 0 --training.output_dir "$OUT/$arm" > "$OUT/train_$arm.log" 2>&1
  fi
  DRAFTERS+=(--drafter "$kind:$OUT/$arm/checkpoint-final?name=$arm")
done
python eval/run.py --dtype "$DTYPE" --bench mt_bench --per-category "$PER_CATEGORY" --max-new-tokens "$TOKENS" \
  "${DRAFTERS[@]}" --out "$OUT/mt_bench" > "$OUT/mt_bench.log" 2>&1
first=--header
for pair in "${PAIRS[@]}"; do
  read -r base other <<< "$pair"
  python bench/paired_tau.py "$OUT/mt_bench/results.json" --base "$base" --other "$other" $first
  first=
done > "$OUT/mt_bench-paired.md"
echo "done: $OUT (mt_bench.log, mt_bench-paired.md, train_*.log)"
