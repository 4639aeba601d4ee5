#!/bin/bash
# One kind under each token objective at one training budget (issue 57 item 4): the same data and
# stored features (extracted once, read by every run), the same optimiser steps each (equal steps:
# on a shared machine other jobs would change what a minute buys; each run's wall time is in its log
# and in steps.md) or, with MINUTES, the same minutes of wall clock each (a quiet machine), then
# MT-bench in draftsmith's engine with each head's planned tree: acceptance length and speedup
# against plain decoding in one run, and each objective's acceptance length against the default's
# (kl_div) with a paired bootstrap interval over the prompt turns.
#
#   STEPS=150 OUT=runs/objectives bash bench/objectives_compare.sh
#   KIND=dspark OBJECTIVES="kl_div lk_hybrid" STEPS=40 OUT=runs/objectives-dspark bash bench/objectives_compare.sh
#   MINUTES=6 OBJECTIVES="kl_div ce" OUT=runs/objectives-minutes bash bench/objectives_compare.sh
#
# Knobs: KIND (eagle3, peagle, dflash, dspark), OBJECTIVES (names or JSON mixes, space-separated),
# STEPS or MINUTES (the budget; MINUTES wins), FEATURES (a stored-features folder to read, default
# OUT/features), LIMIT (ShareGPT conversations), REGENERATE, PER_CATEGORY and TOKENS (MT-bench prompts per
# category and new tokens), TEMPERATURE, DTYPE. One job at a time: parallel jobs skew each other.
set -euo pipefail
cd "$(dirname "$0")/.."
KIND=${KIND:-eagle3}
OBJECTIVES=${OBJECTIVES:-kl_div ce rkl jsd tv nla lk_hybrid}
STEPS=${STEPS:-150}
OUT=${OUT:-runs/objectives}
LIMIT=${LIMIT:-400}
REGENERATE=${REGENERATE:-false}
PER_CATEGORY=${PER_CATEGORY:-1}
TOKENS=${TOKENS:-96}
TEMPERATURE=${TEMPERATURE:-0}
DTYPE=${DTYPE:-auto}
FEATURES=${FEATURES:-$OUT/features}
if [ -n "${MINUTES:-}" ]; then
  BUDGET=(--training.max_steps null --training.max_minutes "$MINUTES"); LABEL="$MINUTES min"
else
  BUDGET=(--training.max_steps "$STEPS" --training.max_minutes null); LABEL="$STEPS steps"
fi
COMMON=(--target.dtype "$DTYPE" --data.limit "$LIMIT" --data.max_length 512 --data.held_out_fraction 0.05
        --data.regenerate.enabled "$REGENERATE" --drafter.features offline --drafter.features_dir "$FEATURES"
        "${BUDGET[@]}" --training.num_epochs 50 --training.eval_every 0 --training.save_every 0
        --tracking.report_to none)
mkdir -p "$OUT"
read -r -a OBJECTIVE_LIST <<< "$OBJECTIVES"
# each objective's folder name, one Python start for all of them
mapfile -t NAMES < <(python -c "import sys; from draftsmith.train.objectives import parse_objective, slug
print('\n'.join(slug(parse_objective(o)) for o in sys.argv[1:]))" "${OBJECTIVE_LIST[@]}")
DRAFTERS=()
for i in "${!NAMES[@]}"; do
  name=${NAMES[$i]}
  if [ ! -f "$OUT/$name/checkpoint-final/config.json" ]; then
    /usr/bin/time -f "%e" -o "$OUT/$name.seconds" python "train/$KIND.py" "recipes/smollm2-$KIND.yaml" "${COMMON[@]}" \
      --drafter.objective "${OBJECTIVE_LIST[$i]}" --training.output_dir "$OUT/$name" > "$OUT/train_$name.log" 2>&1
  fi
  DRAFTERS+=(--drafter "$KIND:$OUT/$name/checkpoint-final?name=$name")
done
python - "$OUT" "$LABEL" "${NAMES[@]}" > "$OUT/steps.md" <<'PY'
import json, sys
from pathlib import Path
out, budget, names = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
print(f"| objective ({budget} each) | steps | wall s (the first run also prepares data and features) | held-out top-1 @1 / @3 |")
print("|---|---|---|---|")
for name in names:
    final = out / name / "checkpoint-final"
    acc = json.loads((final / "config.json").read_text()).get("depth_accuracy") or []
    at = lambda d: f"{acc[d - 1]:.3f}" if len(acc) >= d else "-"
    steps = json.loads((final / "state" / "trainer_state.json").read_text()).get("step", "-")
    seconds = float((out / f"{name}.seconds").read_text())
    print(f"| {name} | {steps} | {seconds:.0f} | {at(1)} / {at(3)} |")
PY
python eval/run.py --dtype "$DTYPE" --bench mt_bench --per-category "$PER_CATEGORY" --max-new-tokens "$TOKENS" \
  --temperature "$TEMPERATURE" "${DRAFTERS[@]}" --out "$OUT/mt_bench" > "$OUT/mt_bench.log" 2>&1
first=--header
for name in "${NAMES[@]}"; do
  [ "$name" = kl_div ] && continue
  python bench/paired_tau.py "$OUT/mt_bench/results.json" --base kl_div --other "$name" $first
  first=
done > "$OUT/paired.md"
echo "done: $OUT (steps.md, mt_bench.log, paired.md)"
