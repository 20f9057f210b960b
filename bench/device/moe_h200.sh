# Mixture of experts on one H200 (docs/models.md), from the repository root:
#   bash bench/device/moe_h200.sh     -> $OUT/moe_h200.jsonl, $OUT/moe_log.txt, $OUT/1gpu-lora-30b-a3b*.trace.json
# setup.sh prints this machine's host copy bandwidth first. Then:
# (a) Qwen3-30B-A3B LoRA (r 16, alpha 32, all linears: attention and every expert's; the router frozen), random
#     init, bf16 compute, seq 2048, 16,384 tokens per step, --gpu-mem 24GiB, 4 steps (the first 2 are warm-up),
#     the `1gpu-lora-30b-a3b` policy, through bench/cuda_bench.py: tokens/s, GPU peak, host RSS and the
#     prediction beside them, and the run's Chrome trace (every action of the MoE blocks as measured);
# (b) full fine-tuning of the same model: what `tinypipe run` says before it trains (on this 125 GiB host the
#     parameters and optimizer state do not fit, which it says with the bytes).
# MOE_TIMEOUT (default 230 s) limits (a). HW (default h200x1): the hardware preset both plan with (`--hardware`);
# on another GPU the prediction is the H200's.
START=$(date +%s)
. bench/device/setup.sh
LORA="--lora 16 --lora-alpha 32 --lora-targets all"
TIMING="--checkpoint-minutes 0 --keep-checkpoints 0 --no-save --hardware ${HW:-h200x1}"
timeout -k 10 "${MOE_TIMEOUT:-230}" python3 bench/cuda_bench.py --out "$OUT/moe_h200.jsonl" --cases 1gpu-lora-30b-a3b \
  --model qwen3-30b-a3b --steps 4 --batch-tokens 16384 --trace-dir "$OUT" --extra $LORA $TIMING >"$OUT/moe_log.txt" 2>&1
echo "qwen3-30b-a3b LoRA: exit $? at $(( $(date +%s) - START )) s"; grep -v "^training \[" "$OUT/moe_log.txt" | tail -4
timeout 120 tinypipe run --backend cuda --gpus 1 --model qwen3-30b-a3b --gpu-mem 24GiB --batch-tokens 16384 --steps 2 \
  --optimizer-state 8bit --out /tmp/moe-full $TIMING 2>&1 | tail -3
echo "qwen3-30b-a3b full fine-tuning: exit ${PIPESTATUS[0]} at $(( $(date +%s) - START )) s"
