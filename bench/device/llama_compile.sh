# Llama-3.1-8B on one H200 with compiled blocks (docs/performance.md), from the repository root:
#   bash bench/device/llama_compile.sh CASE...
# Each CASE of bench/cuda_bench.py (Llama-3.1-8B shapes, 65,536 tokens per step, --gpu-mem 24GiB) with
# `--compile`, planned with the compiled-block profile of bench/device/compile_qwen3.sh
# (bench/results/profile_h200_compile/pl-compiled, and the copy and optimizer rates of that machine).
. bench/device/setup.sh
ROOT=$(pwd)
P="$ROOT/bench/results/profile_h200_compile"
cd /tmp
free -g | head -2
for case in "$@"; do
  timeout -k 10 ${CASE_TIMEOUT:-280} python3 "$ROOT/bench/cuda_bench.py" --cases "$case" --label="${LABEL:--compiled}" --steps 6 \
    --trace-dir "$OUT" --out "$OUT/cuda_h200.jsonl" \
    --extra --compile --profile "$P/pl-compiled" --hardware "$P/pq/hardware.json" >>"$OUT/log.txt" 2>&1
  echo "$case: exit $?"
  grep -v "^training \[" "$OUT/log.txt" | tail -2
done
python3 - "$OUT/cuda_h200.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    for rank, phases in enumerate(r.get("host_rss_phases_per_rank", [])):
        print(r["case"], "rank", rank, {k: f"{v[0] / 1e9:.1f} GB now, {v[1] / 1e9:.1f} peak" for k, v in phases.items()})
PY
