# Training steps per minute and peak memory with the target in the trainer (features computed in
# each step, `drafter.features: online`) and without it (`offline`: a store filled beforehand by
# vLLM, the trainer loads the target head-only), same recipe, data, seed and steps, one after the other.
#
#   OUT=R STEPS=40 LIMIT=200 bash bench/target_in_trainer.sh
#
# Prints each run's median logged training tokens/s (supervised tokens, after its first log) and
# peak resident memory (GNU time), and the ratio offline / online.
set -euo pipefail
OUT=${OUT:?set OUT to a results folder}
STEPS=${STEPS:-40}
LIMIT=${LIMIT:-200}
mkdir -p "$OUT"
COMMON=(recipes/smollm2-eagle3.yaml --data.limit "$LIMIT" --data.regenerate.enabled false
  --tracking.report_to none --training.max_minutes null --training.max_steps "$STEPS"
  --training.log_every 5 --training.save_every 0 --training.eval_every 0)
draftsmith-features "${COMMON[@]}" --output_dir "$OUT/unused" > "$OUT/features.log" 2>&1
for features in online offline; do
  /usr/bin/time -v -o "$OUT/$features.time" python train/eagle3.py "${COMMON[@]}" \
    --drafter.features "$features" --output_dir "$OUT/$features" > "$OUT/$features.log" 2>&1
done
python - "$OUT" <<'EOF'
import json, re, statistics, sys
from pathlib import Path

out = Path(sys.argv[1])
rates = {}
for features in ("online", "offline"):
    logs = [json.loads(x) for x in (out / features / "log_history.jsonl").read_text().splitlines()]
    speeds = [e["train/tokens_per_second"] for e in logs if "train/tokens_per_second" in e][1:]
    timing = (out / f"{features}.time").read_text()
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", timing).group(1)) / 2**20
    rates[features] = statistics.median(speeds)
    print(f"| {features} | {rates[features]:,.0f} tok/s | {rss:.2f} GiB |")
print(f"offline / online: {rates['offline'] / rates['online']:.2f}x")
EOF
