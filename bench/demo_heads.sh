#!/bin/bash
# The demo's head (issue 33, item 10): the main job run with its EAGLE-1 recipe and with the EAGLE-3
# challenger (recipes/smollm2-eagle3-demo.yaml), same budget and benchmark, at fp32 and at the
# measured dtype (`auto`: bf16 where it is fast); prints one line per run. The two heads of a dtype run
# side by side, each pinned to its own core with one thread (taskset; as bench/eagle3_compare.sh pins its
# runs), so they share the machine's conditions and the comparison takes half the wall time.
#
#   OUT=runs/demo_heads bash bench/demo_heads.sh        # TRAIN_MINUTES=3.5 PER_CATEGORY=1 MAX_NEW_TOKENS=64
set -euo pipefail
OUT=${OUT:-runs/demo_heads}
mkdir -p "$OUT"
summarise() {
  python - "$@" <<'PY'
import json, sys
from pathlib import Path
run, recipe, dtype = sys.argv[1:]
summary = json.loads((Path(run) / "results" / "results.json").read_text())["methods"]
history = [json.loads(line) for line in (Path(run) / "log_history.jsonl").read_text().splitlines()]
top1 = [h["eval/top1"] for h in history if "eval/top1" in h]
cells = [f"{m} tau {s['acceptance_length']:.2f} {s['speedup']:.2f}x" for m, s in summary.items() if s.get("speedup")]
held_out = f"held-out top-1 {top1[-1]:.3f}" if top1 else "no held-out evaluation"
print(f"{recipe} {dtype}: {history[-1]['step']} steps, {held_out}; " + "; ".join(cells), flush=True)
PY
}
for dtype in ${DTYPES:-float32 auto}; do
  core=0
  for recipe in smollm2-eagle-demo smollm2-eagle3-demo; do
    run="$OUT/$recipe-$dtype"
    OMP_NUM_THREADS=1 taskset -c $core python eval/demo.py --recipe "recipes/$recipe.yaml" --dtype "$dtype" \
      --out-dir "$run" --results "$run/results" --train-minutes "${TRAIN_MINUTES:-3.5}" \
      --per-category "${PER_CATEGORY:-1}" --max-new-tokens "${MAX_NEW_TOKENS:-64}" > "$run.log" 2>&1 &
    core=$((core + 1))
  done
  wait
  for recipe in smollm2-eagle-demo smollm2-eagle3-demo; do summarise "$OUT/$recipe-$dtype" "$recipe" "$dtype"; done
done
