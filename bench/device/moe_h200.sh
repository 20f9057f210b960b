# Mixture of experts on one GPU (docs/models.md), from the repository root:
#   bash bench/device/moe_h200.sh   -> $OUT/moe_block.json, $OUT/prof/ (traces, hardware.json), $OUT/moe_h200.jsonl,
#                                      $OUT/moe_log.txt, $OUT/1gpu-lora-30b-a3b*.trace.json
# setup.sh prints this machine's host copy bandwidth first. HW: the hardware preset everything plans with (default:
# the shipped preset of this GPU, setup.sh's GPU_PRESET). PARTS (default "block profile lora full") picks:
# block:   bench/device/moe_block.py (BLOCK_ARGS: its options), one Qwen3-30B-A3B block by how its experts run and are adapted;
# profile: `tinypipe profile --no-optimizer` of Qwen3-30B-A3B, LoRA r 16, alpha 32 on all linears, 2 x 2048 tokens (the
#          block measured on this GPU, this host's rates in hardware.json) -> $OUT/prof;
# lora:    Qwen3-30B-A3B LoRA (the router frozen), random init, bf16, seq 2048, 16,384 tokens per step,
#          --gpu-mem 24GiB, MOE_STEPS steps (default 4; the first 2 warm-up), the `1gpu-lora-30b-a3b` policy, through
#          bench/cuda_bench.py, planned with the profile when there is one: tokens/s, GPU peak, host RSS, predicted;
# full:    full fine-tuning of the same model: what `tinypipe run` says before it trains (on a 125 GiB host the
#          parameters and optimizer state do not fit, which it says with the bytes).
START=$(date +%s)
. bench/device/setup.sh
PARTS=${PARTS:-block profile lora full}
HW=${HW:-$GPU_PRESET}
python3 -c "import torch, transformers; p = torch.cuda.get_device_properties(0); print('gpu', p.name, p.total_memory, \
'B; transformers', transformers.__version__)"; grep MemTotal /proc/meminfo; echo "hardware preset $HW"
LORA="--lora 16 --lora-alpha 32 --lora-targets all"
TIMING="--checkpoint-minutes 0 --keep-checkpoints 0 --no-save"
if [[ " $PARTS " == *" block "* ]]; then
  timeout -k 10 "${BLOCK_TIMEOUT:-150}" python3 bench/device/moe_block.py --out "$OUT/moe_block.json" $BLOCK_ARGS
  echo "block: exit $? at $(( $(date +%s) - START )) s"
fi
PLAN=(--hardware "$HW")
if [[ " $PARTS " == *" profile "* ]]; then
  timeout -k 10 "${PROFILE_TIMEOUT:-200}" tinypipe profile --backend cuda --model qwen3-30b-a3b --seq-len 2048 \
    --microbatch-size 2 --hardware "$HW" --no-optimizer $LORA --out "$OUT/prof" 2>&1 | tail -25
  echo "profile: exit ${PIPESTATUS[0]} at $(( $(date +%s) - START )) s"
  [ -f "$OUT/prof/hardware.json" ] && PLAN=(--hardware "$OUT/prof/hardware.json" --profile "$OUT/prof")
fi
if [[ " $PARTS " == *" lora "* ]]; then
  timeout -k 10 "${MOE_TIMEOUT:-230}" python3 bench/cuda_bench.py --out "$OUT/moe_h200.jsonl" --cases 1gpu-lora-30b-a3b \
    --model qwen3-30b-a3b --steps "${MOE_STEPS:-4}" --batch-tokens 16384 --trace-dir "$OUT" --extra $LORA $TIMING "${PLAN[@]}" \
    >"$OUT/moe_log.txt" 2>&1
  echo "qwen3-30b-a3b LoRA: exit $? at $(( $(date +%s) - START )) s"; grep -v "^training \[" "$OUT/moe_log.txt" | tail -6
fi
if [[ " $PARTS " == *" full "* ]]; then
  timeout 120 tinypipe run --backend cuda --gpus 1 --model qwen3-30b-a3b --gpu-mem 24GiB --batch-tokens 16384 \
    --steps 2 --optimizer-state 8bit --out /tmp/moe-full $TIMING --hardware "$HW" 2>&1 | tail -3
  echo "qwen3-30b-a3b full fine-tuning: exit ${PIPESTATUS[0]} at $(( $(date +%s) - START )) s"
fi
