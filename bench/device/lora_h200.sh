# LoRA on a frozen, streamed base on one H200 (docs/performance.md, "LoRA"), from the repository root:
#   bash bench/device/lora_h200.sh
# 1. Llama-3.1-8B shapes, all 32 layers, random init, bf16, seq 2048, 65,536 tokens per step, --gpu-mem 24GiB,
#    LoRA r 16, alpha 32, on all seven linears (q,k,v,o,gate,up,down): the issue's target is >= 11,500 tokens/s,
#    GPU peak <= 11.6 GiB, host RSS <= 24 GiB, the simulator's prediction within 5%.
# 2. A Qwen3-32B-shaped model (random init), the same LoRA, on the same box (125 GiB host): runs; tokens/s,
#    GPU and host peaks, the prediction.
# bench/cuda_bench.py prints per case: tokens/s, GPU peak, host RSS per parameter, the prediction and the floor;
# the records (with host RSS in bytes) go to $OUT/lora_h200.jsonl, the Chrome traces to $OUT.
# `run --lora` imports peft (and peft imports accelerate): put their wheels in .whl/ first, on a machine
# with PyPI:  pip download --no-deps -d .whl peft accelerate   (setup.sh installs .whl/*.whl)
. bench/device/setup.sh
ROOT=$(pwd)
LORA="--lora 16 --lora-alpha 32 --lora-targets all"
python3 -c "import peft; print('peft', peft.__version__)" || { echo "peft is not installed: see the header"; exit 2; }
cd /tmp
free -g | head -2
tinypipe simulate --model llama-3.1-8b --hardware h200x1 --policy "$ROOT/bench/policies/h200x1-24g-lora16.json" --policy "$ROOT/bench/policies/h200x1-24g-lora16-lean.json" --batch-tokens 65536 \
  --gpu-mem 24GiB $LORA
timeout -k 10 ${CASE_TIMEOUT:-280} python3 "$ROOT/bench/cuda_bench.py" --cases 1gpu-lora 1gpu-lora-lean --label=-llama8b-r16 \
  --steps 6 --trace-dir "$OUT" --out "$OUT/lora_h200.jsonl" --extra $LORA >>"$OUT/log.txt" 2>&1
echo "llama-3.1-8b: exit $?"; grep -v "^training \[" "$OUT/log.txt" | tail -3
tinypipe simulate --model qwen3-32b --hardware h200x1 --policy tinypipe --batch-tokens 65536 --gpu-mem 130GiB $LORA
timeout -k 10 ${CASE_TIMEOUT:-280} python3 "$ROOT/bench/cuda_bench.py" --cases 1gpu-lora-preset --gpu-mem 130GiB --label=-qwen3-32b-r16 \
  --model qwen3-32b --steps 4 --trace-dir "$OUT" --out "$OUT/lora_h200.jsonl" --extra $LORA >>"$OUT/log.txt" 2>&1
echo "qwen3-32b: exit $?"; grep -v "^training \[" "$OUT/log.txt" | tail -3
python3 - "$OUT/lora_h200.jsonl" <<'PY'
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
