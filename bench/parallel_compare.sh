#!/bin/bash
# EAGLE-3 vs P-EAGLE vs DFlash at one compute budget (issue 26): the same data (the target's
# regenerated replies to ShareGPT first turns, cached), the same minutes of training each on this
# machine, then MT-bench and MT-bench's coding questions in draftsmith's engine (held-out accuracy
# per position from each run's log_history.jsonl, acceptance length, draft time per step, speedup
# against plain decoding and prompt lookup in the same run), each export through the vLLM gate, and the
# three exports served side by side in vLLM with its plain decoding and prompt lookup.
#
#   MINUTES=10 OUT=runs/parallel bash bench/parallel_compare.sh
#
# Runs one job at a time (a 2-core machine: parallel jobs would skew each other's timings).
set -euo pipefail
MINUTES=${MINUTES:-10}
OUT=${OUT:-runs/parallel}
PER_CATEGORY=${PER_CATEGORY:-2}
TOKENS=${TOKENS:-128}
DATA="--data.limit 1000 --data.max_length 768 --data.regenerate.max_new_tokens 128 --data.held_out_fraction 0.05 --data.regenerate.engine vllm
      --tracking.report_to none"
mkdir -p "$OUT"
for kind in eagle3 peagle dflash; do
  python "train/$kind.py" "recipes/smollm2-$kind.yaml" $DATA --training.max_minutes "$MINUTES" \
    --training.num_epochs 20 --training.eval_every 100 --training.output_dir "$OUT/$kind" > "$OUT/train_$kind.log" 2>&1
done
python bench/learning_curve.py --run "eagle3=$OUT/eagle3" --run "peagle=$OUT/peagle" --run "dflash=$OUT/dflash" \
  --depths 1 3 --out "$OUT/curves.png" > "$OUT/curves.md"
python - "$OUT/code.jsonl" <<'EOF'
import json, sys
from draftsmith.data_prep.prompts import load_prompts
with open(sys.argv[1], "w") as out:
    for p in load_prompts():
        if p.category == "coding":
            out.write(json.dumps({"prompt": p.turns[0], "category": "coding", "id": p.id}) + "\n")
EOF
DRAFTERS=(--drafter "eagle3:$OUT/eagle3/checkpoint-final" --drafter "peagle:$OUT/peagle/checkpoint-final"
          --drafter "dflash:$OUT/dflash/checkpoint-final" --drafter prompt_lookup)
python eval/run.py --bench mt_bench --per-category "$PER_CATEGORY" --max-new-tokens "$TOKENS" --cost-model \
  "${DRAFTERS[@]}" --out "$OUT/mt_bench" > "$OUT/mt_bench.log" 2>&1
python eval/run.py --prompts "$OUT/code.jsonl" --max-new-tokens "$TOKENS" --cost-model \
  "${DRAFTERS[@]}" --out "$OUT/code" > "$OUT/code.log" 2>&1
for kind in eagle3 peagle dflash; do
  rm -rf "$OUT/$kind-speculators"
  draftsmith-export "$OUT/$kind/checkpoint-final" --format speculators --out "$OUT/$kind-speculators" --check vllm \
    > "$OUT/gate_$kind.log" 2>&1 || echo "gate $kind: exit $?" >> "$OUT/gate_$kind.log"
done
# vLLM: the three exports beside its plain decoding and its prompt lookup, on the same prompts.
EXPORTS=("$OUT/eagle3-speculators" "$OUT/peagle-speculators" "$OUT/dflash-speculators")
python bench/vllm_serving.py compare "${EXPORTS[@]}" --per-category "$PER_CATEGORY" --max-new-tokens "$TOKENS" \
  --out "$OUT/vllm_mt.json" > "$OUT/vllm_mt.md"
python bench/vllm_serving.py compare "${EXPORTS[@]}" --prompts "$OUT/code.jsonl" --max-new-tokens "$TOKENS" \
  --out "$OUT/vllm_code.json" > "$OUT/vllm_code.md"
echo "done: $OUT (curves.md, mt_bench.log, code.log, gate_*.log, vllm_mt.md, vllm_code.md)"
