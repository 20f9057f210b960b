# Profile an H200 machine (1 GPU is enough), from the repository root:
#   bash bench/device/profile_h200.sh
# 1. `tinypipe profile` of Llama-3.1-8B (with host rates -> hardware.json) and Qwen3-1.7B shapes,
#    4 x 2048 tokens, on this GPU; 2. the profiler's GPU test; 3. a Qwen3-1.7B run planned with its
#    profile (prediction beside measurement in the run's summary) and its replay.
. bench/device/setup.sh
ROOT=$(pwd)
cd /tmp
HW=$(python3 -c "import torch; print('h200x2' if torch.cuda.device_count() > 1 else 'h200x1')")
mkdir -p "$OUT/p8" "$OUT/pq"
timeout 240 tinypipe profile --backend cuda --model llama-3.1-8b --seq-len 2048 --microbatch-size 4 \
  --hardware "$HW" --out "$OUT/p8" 2>&1 | tee -a "$OUT/log.txt" | tail -30
timeout 120 tinypipe profile --backend cuda --model qwen3-1.7b --seq-len 2048 --microbatch-size 4 --no-rates \
  --hardware "$HW" --out "$OUT/pq" 2>&1 | tee -a "$OUT/log.txt" | tail -12
timeout 90 python3 -m pytest -q -p no:cacheprovider --rootdir "$ROOT" "$ROOT/tests/backends/test_profile.py" -k cuda \
  2>&1 | tail -3 | tee -a "$OUT/log.txt"
hw=(); [ -f "$OUT/p8/hardware.json" ] && hw=(--hardware "$OUT/p8/hardware.json")
timeout 200 tinypipe run --backend cuda --gpus 1 --model qwen3-1.7b --seq-len 2048 --batch-tokens 65536 \
  --microbatch-size 4 --policy tinypipe --gpu-mem 24GiB --steps 6 --checkpoint-minutes 0 --out /tmp/q \
  --profile "$OUT/pq" "${hw[@]}" --trace "$OUT/qwen3.trace.json" 2>&1 | grep -v "^training \[" | tee -a "$OUT/log.txt" | tail -25
[ -f "$OUT/qwen3.trace.json" ] && timeout 60 tinypipe replay "$OUT/qwen3.trace.json" --warmup 2 2>&1 | tee "$OUT/qwen3.replay.txt" | head -40
