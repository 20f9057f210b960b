# Trust on a fresh 1-GPU H200 machine (issue 26's Show), from the repository root, with no profile step:
#   bash bench/device/trust_h200.sh            # on the H200: OUT=... STEPS=12 by default
#   DRY=1 bash bench/device/trust_h200.sh      # anywhere: tiny-llama on the CPU backend, to check the script
# 1. `tinypipe search --gpu-mem 24GiB` for Llama-3.1-8B on h200x1 (this machine's host memory, the footprint
#    rule) -> $OUT/search.json and the winner's policy; 2. the winner run sync and async (`--backend cuda
#    --gpu-mem 24GiB`, launch-time calibration, checkpoints off), then the same two for a 12-layer 8B from a
#    config.json (num_hidden_layers=12); each run's summary -> $OUT/<label>.txt, its trace -> $OUT/<label>.trace.json;
# 3. bench/device/trust_report.py: predicted vs measured step time and GPU peak, and the calibration's figures
#    of every run -> $OUT/trust_h200.json (and the table on stdout).
if [ -n "$DRY" ]; then
  export OUT=${OUT:-$(mktemp -d)}
  MODEL=tiny-llama SEQ=64 BATCH=512 STEPS=${STEPS:-3} RUN=(--backend cpu --gpus 1) LAYERS=2
  SEARCH_GPU=(--gpu-mem 24GiB --workers 1)
else
  . bench/device/setup.sh
  MODEL=llama-3.1-8b SEQ=2048 BATCH=65536 STEPS=${STEPS:-12} RUN=(--backend cuda --gpus 1 --gpu-mem 24GiB) LAYERS=12
  SEARCH_GPU=(--gpu-mem 24GiB)
fi
mkdir -p "$OUT"
ROOT=$(pwd)
cd /tmp
# a config.json of the model with LAYERS decoder layers (random init: same layer shapes, fewer of them)
python3 - "$MODEL" "$LAYERS" "$OUT/$MODEL-${LAYERS}l.json" <<'PY'
import json, sys
from tinypipe.describe.hfconfig import config_path
cfg = json.loads(config_path(sys.argv[1])[0].read_text())
cfg["num_hidden_layers"] = int(sys.argv[2])
cfg.pop("_published_params", None)
open(sys.argv[3], "w").write(json.dumps(cfg, indent=1))
PY
SHORT="$OUT/$MODEL-${LAYERS}l.json"
rm -f "$OUT/winner.json" "$OUT/winner-async.json"
timeout 300 tinypipe search --model "$MODEL" --hardware h200x1 --seq-len "$SEQ" --batch-tokens "$BATCH" "${SEARCH_GPU[@]}" \
  --out "$OUT/winner.json" 2>&1 | grep -v "^search:" | tee "$OUT/search.txt" | head -30
timeout 300 tinypipe search --model "$MODEL" --hardware h200x1 --seq-len "$SEQ" --batch-tokens "$BATCH" "${SEARCH_GPU[@]}" \
  --json > "$OUT/search.json" 2>/dev/null
python3 - "$OUT/winner.json" "$OUT/winner-async.json" <<'PY'
import json, sys
p = json.load(open(sys.argv[1]))
p.update(name="searched-async", optimizer="async")
open(sys.argv[2], "w").write(json.dumps(p, indent=1))
PY
runs=()
for model in "$MODEL" "$SHORT"; do
  tag=$([ "$model" = "$MODEL" ] && echo full || echo "${LAYERS}l")
  for mode in sync async; do
    policy="$OUT/winner.json"; [ "$mode" = async ] && policy="$OUT/winner-async.json"
    label="$tag-$mode"
    rm -rf "/tmp/trust-$label"
    timeout 540 tinypipe run "${RUN[@]}" --model "$model" --policy "$policy" --seq-len "$SEQ" --batch-tokens "$BATCH" \
      --steps "$STEPS" --checkpoint-minutes 0 --out "/tmp/trust-$label" --trace "$OUT/$label.trace.json" \
      2>&1 | grep -v "^training \[" | tee "$OUT/$label.txt" | tail -16
    runs+=("$label=$OUT/$label.txt")
  done
done
python3 "$ROOT/bench/device/trust_report.py" "$OUT/trust_h200.json" "$OUT/search.json" "${runs[@]}"
