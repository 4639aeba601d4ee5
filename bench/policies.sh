#!/usr/bin/env bash
# Draft-length policies (issue 17) on the bundled SmolLM2: two distilled students (6 and 2 of the
# target's 30 layers) and an EAGLE head, each at fixed depths and under policy=entropy,
# policy=confidence and both, the hierarchical drafter (M1 = the 2-layer student, M2 = the 6-layer
# one; and its default, untrained cuts of the target) and HF assisted generation with the 6-layer
# student (constant and dynamic draft length),
# all against plain decoding in the same run; greedy in fp32 (so "same output" is exact) and
# temperature 1 in the automatic dtype, with the cost model's predictions.
#
#   bash bench/policies.sh     # PER_CATEGORY=1 MAX_NEW=128 CORES=0 OUT=runs/policies EAGLE=runs/compare/eagle1/checkpoint-final
#                              # STAGES="t0 t1 lenience" (e.g. STAGES=t0 CORES=0 and STAGES="t1 lenience" CORES=1 at once)
#
# The students train on recipes/smollm2-distill.yaml with the EAGLE-3 recipes' data section (so
# the target's regenerated replies are shared with bench/eagle3_compare.sh, whose EAGLE-1 head this
# reuses), on those replies only (no on-policy samples: the cheapest data for greedy drafting).
# The 6-layer student trains in two stages, the second starting from the first's checkpoint with
# a fresh schedule: that is how the recorded run fitted its time.
set -euo pipefail
cd "$(dirname "$0")/.."
PER_CATEGORY="${PER_CATEGORY:-1}"
MAX_NEW="${MAX_NEW:-128}"
CORES="${CORES:-0}"
OUT="${OUT:-runs/policies}"
EAGLE="${EAGLE:-runs/compare/eagle1/checkpoint-final}"
PYTHON="${PYTHON:-python3}"
STAGES="${STAGES:-t0 t1 lenience}"
THREADS=$(( $(echo "$CORES" | tr ',' '\n' | wc -l) ))
PIN=(taskset -c "$CORES" env OMP_NUM_THREADS="$THREADS")

DISTILL=(recipes/smollm2-distill.yaml --data.max_length 768 --data.held_out_fraction 0.01
         --data.regenerate.max_new_tokens 256 --drafter.mixture.fixed 1.0 --drafter.mixture.student 0.0
         --training.max_steps 100000 --training.eval_every 1000 --training.save_every 1000 --tracking.report_to none)
[ -d "$OUT/student6-a/checkpoint-final" ] || "${PIN[@]}" "$PYTHON" train/distill.py "${DISTILL[@]}" \
    --training.max_minutes 20 --training.output_dir "$OUT/student6-a"
[ -d "$OUT/student6/checkpoint-final" ] || "${PIN[@]}" "$PYTHON" train/distill.py "${DISTILL[@]}" \
    --drafter.student "$OUT/student6-a/checkpoint-final" --training.warmup_steps 0 \
    --training.max_minutes 15 --training.output_dir "$OUT/student6"
[ -d "$OUT/student2/checkpoint-final" ] || "${PIN[@]}" "$PYTHON" train/distill.py "${DISTILL[@]}" \
    --drafter.num_layers 2 --training.max_minutes 22 --training.output_dir "$OUT/student2"

S6="$OUT/student6/checkpoint-final"
S2="$OUT/student2/checkpoint-final"
V="vocab=4096"
DRAFTERS=()
for depth in 1 2 3 4 6 8; do
    DRAFTERS+=(--drafter "draft_lm:$S6?depth=$depth&$V&name=student d$depth")
done
DRAFTERS+=(--drafter "draft_lm:$S6?depth=3&name=student d3 full vocab"
           --drafter "draft_lm:$S6?depth=8&$V&policy=entropy&name=student entropy"
           --drafter "draft_lm:$S6?depth=2&$V&policy=confidence&name=student confidence"
           --drafter "draft_lm:$S6?depth=8&$V&policy=entropy,confidence&name=student entropy+confidence"
           --drafter "hierarchical?m1=$S2&m2=$S6&$V&name=hierarchical 2+6 layers"
           --drafter "hierarchical?name=hierarchical default (6- and 28-layer cuts, untrained)")
for depth in 1 2 3 4 6 8; do
    DRAFTERS+=(--drafter "eagle:$EAGLE?depth=$depth&top_k=3&budget=12&name=eagle d$depth")
done
DRAFTERS+=(--drafter "eagle:$EAGLE?depth=8&top_k=3&budget=12&policy=entropy&name=eagle entropy"
           --drafter "eagle:$EAGLE?depth=6&top_k=3&budget=12&policy=confidence&name=eagle confidence"
           --drafter "eagle:$EAGLE?depth=8&top_k=3&budget=12&policy=entropy,confidence&name=eagle entropy+confidence")
HF=(--hf-baseline hf_assisted --hf-baseline hf_assisted_dynamic --hf-assistant "student d3 full vocab")
EVAL=(eval/run.py --per-category "$PER_CATEGORY" --max-new-tokens "$MAX_NEW" --cost-model "${DRAFTERS[@]}" "${HF[@]}")

if [[ " $STAGES " == *" t0 "* ]]; then
    "${PIN[@]}" "$PYTHON" "${EVAL[@]}" --dtype float32 --temperature 0 --out "$OUT/results-t0"
fi
if [[ " $STAGES " == *" t1 "* ]]; then
    "${PIN[@]}" "$PYTHON" "${EVAL[@]}" --temperature 1 \
        --drafter "draft_lm:$S6?depth=3&$V&lenience=0.5&name=student d3 lenience 0.5 (lossy)" \
        --drafter "eagle:$EAGLE?depth=6&top_k=3&budget=12&lenience=0.5&name=eagle d6 lenience 0.5 (lossy)" \
        --out "$OUT/results-t1"
fi
if [[ " $STAGES " == *" lenience "* ]]; then
    "${PIN[@]}" "$PYTHON" bench/lenience.py --draft "$S6" --per-category "$PER_CATEGORY" --max-new-tokens "$MAX_NEW" \
        | tee "$OUT/lenience.md"
fi
