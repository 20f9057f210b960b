# On the lent 2x H200 machine, from the repository root (carry .whl):
#   bash bench/device/fidelity.sh CASE...
# 1. `tinypipe profile` of Llama-3.1-8B shapes (4 x 2048 tokens) on this GPU -> $OUT/prof/
# 2. the GPU test of the profiler; 3. bench/host_optim_rates.py (ranks stepping at once)
# 4. each CASE of bench/cuda_bench.py planned with that profile and its hardware.json, so its
#    prediction comes from a profile taken minutes before on the same machine.
. bench/device/setup.sh
ROOT=$(pwd)
cd /tmp
mkdir -p "$OUT/prof"
timeout 240 tinypipe profile --backend cuda --model llama-3.1-8b --seq-len 2048 --microbatch-size 4 \
  --hardware h200x2 --out "$OUT/prof" >>"$OUT/log.txt" 2>&1
echo "profile: exit $?"; tail -25 "$OUT/log.txt"
timeout 90 python3 -m pytest -q -p no:cacheprovider --rootdir "$ROOT" "$ROOT/tests/backends/test_profile.py" -k cuda \
  >>"$OUT/log.txt" 2>&1
echo "profile GPU test: exit $?"
timeout 150 python3 "$ROOT/bench/host_optim_rates.py" --steps 5 --out "$OUT/host_optim_rates.json" 2>&1 | tee -a "$OUT/log.txt"
extra=()
if ls "$OUT"/prof/h200-*.json >/dev/null 2>&1; then
  extra=(--extra --profile "$OUT/prof" --hardware "$OUT/prof/hardware.json")
fi
for case in "$@"; do
  timeout -k 10 ${CASE_TIMEOUT:-200} python3 "$ROOT/bench/cuda_bench.py" --cases "$case" --steps ${STEPS:-6} \
    --trace-dir "$OUT" --out "$OUT/cuda_h200.jsonl" "${extra[@]}" >>"$OUT/log.txt" 2>&1
  rc=$?
  if [ $rc -ne 0 ]; then
    echo "{\"case\": \"$case\", \"error\": \"exit status $rc (124: killed after ${CASE_TIMEOUT:-200} s)\", \"date\": \"$(date +%F)\"}" >>"$OUT/cuda_h200.jsonl"
  fi
  grep -v "^training \[" "$OUT/log.txt" | tail -3
done
