# On the lent 2x H200 machine, from the repository root (carry .whl):
#   bash bench/device/cuda_bench.sh CASE...    -> $OUT/cuda_h200.jsonl, $OUT/*.trace.json, $OUT/log.txt
. bench/device/setup.sh
ROOT=$(pwd)
cd /tmp
if [ -n "$CUDA_TESTS" ]; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider --rootdir "$ROOT" "$ROOT/tests/backends/test_run.py" -k cuda 2>&1 | tail -15
fi
timeout ${BENCH_TIMEOUT:-480} python3 "$ROOT/bench/cuda_bench.py" --cases "$@" --steps ${STEPS:-4} --trace-dir "$OUT" --out "$OUT/cuda_h200.jsonl" 2>&1 | tee "$OUT/log.txt" | grep -v "^training \[" | tail -40
