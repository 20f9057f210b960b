# Llama-3.1-8B on H200s at a 24 GiB cap (docs/performance.md), from the repository root:
#   bash bench/device/cuda_bench.sh CASE...    -> $OUT/cuda_h200.jsonl, $OUT/*.trace.json, $OUT/log.txt
# Each case runs in its own process under its own time limit (CASE_TIMEOUT, seconds): a case that
# hangs is recorded as failed and the next one still runs.
. bench/device/setup.sh
ROOT=$(pwd)
cd /tmp
if [ -n "$CUDA_TESTS" ]; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider --rootdir "$ROOT" "$ROOT/tests/backends/test_run.py" -k cuda 2>&1 | tail -15
fi
for case in "$@"; do
  timeout -k 10 ${CASE_TIMEOUT:-240} python3 "$ROOT/bench/cuda_bench.py" --cases "$case" --steps ${STEPS:-6} \
    --trace-dir "$OUT" --out "$OUT/cuda_h200.jsonl" >>"$OUT/log.txt" 2>&1
  rc=$?
  if [ $rc -ne 0 ]; then
    echo "{\"case\": \"$case\", \"error\": \"exit status $rc (124: killed after ${CASE_TIMEOUT:-240} s)\", \"date\": \"$(date +%F)\"}" >>"$OUT/cuda_h200.jsonl"
  fi
  grep -v "^training \[" "$OUT/log.txt" | tail -3
done
grep -v "^training \[" "$OUT/log.txt" | tail -60
