# On a lent H200 machine (1 GPU), from the repository root (carry .whl): more Qwen3-1.7B runs for
# bench/fidelity.py, each planned with the H200 profile in bench/results/profile_h200/ (a 2 x 2048
# profile is taken first, on this machine):
#   bash bench/device/qwen3_runs.sh     -> $OUT/qwen3-*.trace.json, $OUT/log.txt, $OUT/pq2/
. bench/device/setup.sh
ROOT=$(pwd)
cd /tmp
mkdir -p "$OUT/pq2"
timeout 120 tinypipe profile --backend cuda --model qwen3-1.7b --seq-len 2048 --microbatch-size 2 --no-rates \
  --hardware h200x1 --out "$OUT/pq2" 2>&1 | tee -a "$OUT/log.txt" | tail -8
cp "$ROOT"/bench/results/profile_h200/h200-qwen3-1.7b-mb4-seq2048.json "$OUT/pq2/" 2>/dev/null
run() {  # name, then run options
  name=$1; shift
  timeout 200 tinypipe run --backend cuda --gpus 1 --model qwen3-1.7b --seq-len 2048 --batch-tokens 65536 \
    --gpu-mem 24GiB --steps 6 --checkpoint-minutes 0 --out "/tmp/$name" --profile "$OUT/pq2" \
    --hardware "$ROOT/bench/results/profile_h200/hardware-h200x1.json" --trace "$OUT/qwen3-$name.trace.json" "$@" 2>&1 \
    | grep -v "^training \[" | sed "s/^/[$name] /" | tee -a "$OUT/log.txt" | grep -E "speed|predicted|device|error" 
  rm -rf "/tmp/$name"
}
run mb2-sync --policy tinypipe --microbatch-size 2
run mb4-async --policy "$ROOT/bench/policies/tinypipe-async.json" --microbatch-size 4
