# LoRA on a frozen, streamed base on one H200 (docs/performance.md, "LoRA"), from the repository root:
#   bash bench/device/lora_h200.sh            -> $OUT/lora_block.json, $OUT/profile-lora/, $OUT/lora_h200.jsonl
# 1. bench/device/lora_block.py: one Llama-3.1-8B block at 4 x 2048 tokens, frozen, with peft's fp32 adapters
#    and with tinypipe's LoRA linear (compute-dtype adapters), eager and compiled;
# 2. `tinypipe profile --lora` of Llama-3.1-8B at microbatch 4 (the frozen block's FWD and BWD as a run issues them);
# 3. Llama-3.1-8B shapes, all 32 layers, random init, bf16, seq 2048, 65,536 tokens per step, --gpu-mem 24GiB,
#    LoRA r 16, alpha 32, on all seven linears, planned with that profile: tokens/s, GPU peak, host RSS, prediction.
# PARTS (default "block profile run qwen") picks parts; `qwen` runs a Qwen3-32B-shaped model with the same LoRA
# on the whole GPU. bench/cuda_bench.py prints per case: tokens/s, GPU peak, host RSS per parameter, the
# prediction and the floor; its records go to $OUT/lora_h200.jsonl.
# `run --lora` saves adapters with peft's LoraConfig: put the peft and accelerate wheels in .whl/ on a machine
# without them (pip download --no-deps -d .whl peft accelerate; setup.sh installs .whl/*.whl).
. bench/device/setup.sh
ROOT=$(pwd)
LORA="--lora 16 --lora-alpha 32 --lora-targets all"
PARTS=${PARTS:-block profile run qwen}
python3 -c "import peft; print('peft', peft.__version__)" || { echo "peft is not installed: see the header"; exit 2; }
free -g | head -2
part() { case " $PARTS " in *" $1 "*) return 0;; esac; return 1; }
if part block; then
  timeout -k 10 ${BLOCK_TIMEOUT:-240} python3 bench/device/lora_block.py --out "$OUT/lora_block.json" --compile \
    --variants frozen peft-fp32 lora-bf16 2>&1 | grep -v -i warn
fi
if part profile; then
  timeout -k 10 ${PROFILE_TIMEOUT:-200} tinypipe profile --backend cuda --model llama-3.1-8b --microbatch-size 4 \
    --no-rates --repeat 5 --warmup 2 $LORA --out "$OUT/profile-lora" 2>&1 | grep -v -i warn | tail -12
fi
if part run; then
  PROF=""; [ -d "$OUT/profile-lora" ] && PROF="--profile $OUT/profile-lora"
  timeout -k 10 ${CASE_TIMEOUT:-330} python3 bench/cuda_bench.py --cases 1gpu-lora-lean --label=-llama8b-r16 \
    --steps 8 --out "$OUT/lora_h200.jsonl" --extra $LORA $PROF --calibrate now --keep-checkpoints 0 >>"$OUT/log.txt" 2>&1
  echo "llama-3.1-8b: exit $?"; grep -v "^training \[" "$OUT/log.txt" | tail -4
fi
if part qwen; then
  cd /tmp && tinypipe simulate --model qwen3-32b --hardware h200x1 --policy tinypipe --batch-tokens 65536 \
    --gpu-mem 130GiB $LORA; cd "$ROOT"
  timeout -k 10 ${CASE_TIMEOUT:-330} python3 bench/cuda_bench.py --cases 1gpu-lora-preset --gpu-mem 130GiB \
    --label=-qwen3-32b-r16 --model qwen3-32b --steps 4 --out "$OUT/lora_h200.jsonl" --extra $LORA \
    >>"$OUT/log.txt" 2>&1
  echo "qwen3-32b: exit $?"; grep -v "^training \[" "$OUT/log.txt" | tail -4
fi
[ -f "$OUT/lora_h200.jsonl" ] && python3 - "$OUT/lora_h200.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "error" in r:
        print(r["case"], "failed:", r["error"])
        continue
    print(f"{r['case']}: {r['tokens_per_s']:,.0f} tokens/s (predicted {r['predicted_tokens_per_s']:,.0f}, "
          f"{100 * (r['predicted_tokens_per_s'] / r['tokens_per_s'] - 1):+.1f}%), GPU peak "
          f"{r['peak_gpu_bytes'] / 2**30:.2f} GiB (predicted {r['predicted_peak_gpu_bytes'] / 2**30:.2f}), host RSS "
          f"{r['peak_host_rss_bytes'] / 2**30:.2f} GiB (predicted host {r['predicted_peak_host_bytes'] / 2**30:.2f})")
PY
