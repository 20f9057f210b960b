# Where a LoRA step's time goes on one GPU, and Qwen3-32B LoRA to the end (docs/performance.md, "LoRA"),
# from the repository root:  bash bench/device/lora_diag_h200.sh   -> $OUT/lora_diag/ (logs, traces, replays)
# PARTS (default "diag qwen32") picks:
# diag:   Llama-3.1-8B shapes (random init), LoRA r 16, alpha 32, all seven linears, seq 2048, 65,536 tokens/step,
#         --gpu-mem 24GiB: `tinypipe search` picks the policy, `tinypipe run` runs it 4 steps with a Chrome trace,
#         `tinypipe replay` says per resource and action kind where the time went, beside the prediction.
# qwen32: Qwen3-32B shapes, the same LoRA and workload, --gpu-mem ${QWEN_GPU_MEM:-24GiB}, the policy `search`
#         picks, 3 steps (the first is warm-up): tokens/s, GPU peak, RSS, prediction.
# HW: the hardware preset both plan with (default: the shipped preset of this GPU, setup.sh's GPU_PRESET).
# Needs the peft and accelerate wheels in .whl/ (pip download --no-deps -d .whl peft accelerate psutil).
. bench/device/setup.sh
PARTS=${PARTS:-diag qwen32}
HW=${HW:-$GPU_PRESET}
D=$OUT/lora_diag; mkdir -p "$D"
LORA="--lora 16 --lora-alpha 32 --lora-targets all"
W="--seq-len 2048 --batch-tokens 65536"
QUIET="--checkpoint-minutes 0 --keep-checkpoints 0 --no-save --hardware $HW"
free -g | head -2; echo "hardware preset $HW"
cd /tmp
if [[ " $PARTS " == *" diag "* ]]; then
  timeout -k 10 60 tinypipe search --model llama-3.1-8b --hardware "$HW" --gpu-mem 24GiB $W $LORA \
    --out "$D/pick8b.json" 2>&1 | grep -v "^search: [0-9]" | tail -8
  timeout -k 10 ${RUN8_TIMEOUT:-240} tinypipe run --backend cuda --gpus 1 --model llama-3.1-8b --gpu-mem 24GiB $W \
    $LORA --policy "$D/pick8b.json" --steps 4 $QUIET --calibrate now --trace "$D/lora8b.trace.json" >"$D/lora8b.txt" 2>&1
  echo "llama-3.1-8b lora: exit $?"; grep -v "^training \[" "$D/lora8b.txt" | tail -22
  [ -f "$D/lora8b.trace.json" ] && timeout -k 10 60 tinypipe replay "$D/lora8b.trace.json" --gpu-mem 24GiB 2>&1 | tail -40
fi
if [[ " $PARTS " == *" qwen32 "* ]]; then
  timeout -k 10 120 tinypipe search --model qwen3-32b --hardware "$HW" --gpu-mem "${QWEN_GPU_MEM:-24GiB}" $W $LORA \
    --out "$D/pick32b.json" 2>&1 | grep -v "^search: [0-9]" | tail -4
  timeout -k 10 ${QWEN_TIMEOUT:-330} tinypipe run --backend cuda --gpus 1 --model qwen3-32b --policy "$D/pick32b.json" \
    --gpu-mem "${QWEN_GPU_MEM:-24GiB}" $W $LORA --steps 3 $QUIET --calibrate now >"$D/qwen32b.txt" 2>&1
  echo "qwen3-32b lora: exit $?"; grep -v "^training \[" "$D/qwen32b.txt" | tail -24
fi
