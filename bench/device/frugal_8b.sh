# One Llama-3.1-8B run per optimizer state in $RUNS (default: 8bit) with the lean policy (one layer a pack) at
# --gpu-mem 24GiB, 65,536 tokens/step, traced, on one GPU machine, from the repository root:
#   RUNS="8bit fp32" bash bench/device/frugal_8b.sh   -> $OUT/hostbw.json, $OUT/frugal_h200.jsonl, $OUT/run-*.trace.json
# tokens/s, peak RSS, GPU peak, each resource's busy seconds and the prediction beside each (bench/device/frugal.py).
. bench/device/setup.sh
(cd /tmp && python3 -c "from tinypipe.backends import fused_host_adamw as k; print('host kernel:', k.name(), k.unavailable() or '')")
LEAN=bench/policies/h200x1-24g-lean1-sync.json
HW=""  # on an H100 (the same compute, less and slower HBM) no shipped preset describes the GPU: the H200's
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100; then HW="--hardware h200x1"; echo "an H100: $HW"; fi
for state in ${RUNS:-8bit}; do
  timeout -k 10 ${RUN_TIMEOUT:-250} python3 bench/device/frugal.py --out "$OUT" --parts runs --label "8b-" \
    --runs "$state:$LEAN" $HW >>"$OUT/log.txt" 2>&1
  echo "8B $state: exit status $?"
done
python3 bench/device/frugal.py --out "$OUT" --parts summary
