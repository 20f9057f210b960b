# On a lent H200 machine (1 GPU is enough), from the repository root (carry .whl):
#   bash bench/device/profile_optim.sh
# `tinypipe profile` with each layer kind's host optimizer step (issue 10: alone and beside the device's
# work, both host layouts, at the thread count one rank of `run --gpus 1` gets), blocks compiled as
# `run` compiles them on CUDA: Llama-3.1-8B at 4 x 2048 tokens with the copy and optimizer rates
# ($OUT/pl, hardware.json from h200x1), Qwen3-1.7B at 2 and 4 x 2048 ($OUT/pq); then the profiler's GPU
# test. Each profile's wall time is printed; the per-kind steps are in the table each one prints.
. bench/device/setup.sh
ROOT=$(pwd)
START=$(date +%s)
cd /tmp
nproc; free -g | head -2
prof() {  # out dir, then profile options
  o=$1; shift
  t0=$(date +%s)
  timeout 420 tinypipe profile --backend cuda --seq-len 2048 --hardware h200x1 --out "$OUT/$o" "$@" >>"$OUT/log.txt" 2>&1
  echo "profile $o: exit $? in $(( $(date +%s) - t0 )) s"
  sed -n '/^host optimizer step per layer kind/,/^$/p' "$OUT/log.txt" | tail -10
}
prof pl --model llama-3.1-8b --microbatch-size 4
prof pq --model qwen3-1.7b --microbatch-size 2 4 --no-rates
cp "$OUT/pl/hardware.json" "$OUT/pq/" 2>/dev/null
timeout 150 python3 -m pytest -q -p no:cacheprovider --rootdir "$ROOT" "$ROOT/tests/backends/test_profile.py" -k cuda \
  2>&1 | tail -3 | tee -a "$OUT/log.txt"
echo "done in $(( $(date +%s) - START )) s"
