# Issue 28's show on one H200 (16 cores, 125 GiB host, 64 GiB disk), from the repository root:
#   bash bench/device/frugal_h200.sh          -> $OUT/frugal_h200.jsonl, $OUT/host_optim_precision_h200.json, $OUT/log.txt
# 1. host AdamW speed per optimizer-state precision (fp32 / bf16 / 8bit moments on the compact planes) and
#    thread count, beside torch's fused fp32 AdamW;
# 2. Llama-3.1-8B, 1 GPU, --gpu-mem 24GiB, 65,536 tokens/step with 8-bit, bf16 and fp32 moments: tokens/s, peak
#    host RSS (target for 8-bit: <= 60 GiB, >= 9,000 tokens/s) and the simulator's prediction beside each;
# 3. the 8B run with checkpoints on this disk (refused before training with the size it needs), then a
#    Qwen3-1.7B run with 8-bit moments checkpointed (safetensors + JSON, no pickle) and resumed.
# Each part runs in its own process under its own time limit (PART_TIMEOUT, seconds).
# Dry run of the Python parts on a CPU: python3 bench/device/frugal.py --out /tmp/frugal --dry-run
. bench/device/setup.sh
for part in optim runs checkpoint; do
  timeout -k 10 ${PART_TIMEOUT:-900} python3 bench/device/frugal.py --out "$OUT" --parts "$part" >>"$OUT/log.txt" 2>&1
  rc=$?
  if [ $rc -ne 0 ]; then
    echo "{\"part\": \"$part\", \"error\": \"exit status $rc (124: killed after ${PART_TIMEOUT:-900} s)\", \"date\": \"$(date +%F)\"}" >>"$OUT/frugal_h200.jsonl"
  fi
  grep -v "^training \[" "$OUT/log.txt" | tail -5
done
tail -c 6000 "$OUT/frugal_h200.jsonl"
