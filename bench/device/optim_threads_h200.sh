# The host optimizer's thread count in a run, on one H200 machine (16 cores, 125 GiB host), from the repository root:
#   bash bench/device/optim_threads_h200.sh  -> $OUT/hostbw.json, $OUT/frugal_h200.jsonl, $OUT/host_optim_precision_h200.json,
#                                               $OUT/run-*.trace.json
# 1. this host's copy bandwidth and which kernel steps the host (native, or torch and why);
# 2. host AdamW per state precision at 1, 8 and 15 threads (64M parameters; G params/s, GB/s, share of the copy
#    bandwidth);
# 3. Llama-3.1-8B shapes with 12 decoder layers (a config.json), fp32 moments, the lean policy, --gpu-mem 24GiB,
#    65,536 tokens/step, traced, with the rank's intra-op threads (the optimizer's) at 15 and at 8: does a host
#    optimizer that takes every core slow the GPU's feed?
# 4. the full Llama-3.1-8B with 8-bit moments at the faster of the two thread counts, traced.
. bench/device/setup.sh
(cd /tmp && python3 -c "from tinypipe.backends import fused_host_adamw as k; print('host kernel:', k.name(), k.unavailable() or '')")
timeout -k 10 80 python3 bench/host_optim_precision.py --params 67108864 --threads 1 8 15 --repeat 2 \
  --out "$OUT/host_optim_precision_h200.json" >"$OUT/optim.txt" 2>&1
cat "$OUT/optim.txt"
mkdir -p /tmp/l12
(cd /tmp && python3 -c "
import json, importlib.resources as r
d = json.loads((r.files('tinypipe.traces') / 'models' / 'llama-3.1-8b.json').read_text())
d = {k: v for k, v in d.items() if not k.startswith('_')}
d['num_hidden_layers'] = 12
json.dump(d, open('/tmp/l12/config.json', 'w'))")
LEAN=bench/policies/h200x1-24g-lean1-sync.json
# on an H100 (the same compute, less and slower HBM) no shipped preset describes the GPU: plan with the H200's
HW=""
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100; then HW="--hardware h200x1"; echo "an H100: $HW"; fi
for th in 15 8; do
  TINYPIPE_THREADS=$th timeout -k 10 140 python3 bench/device/frugal.py --out "$OUT" --parts runs --model /tmp/l12/config.json \
    --label "l12-t$th-" --runs "fp32:$LEAN" $HW >>"$OUT/log.txt" 2>&1
  echo "12-layer, $th threads: exit status $?"
done
BEST=$(python3 - "$OUT/frugal_h200.jsonl" <<'PY'
import json, sys
rows = [json.loads(x) for x in open(sys.argv[1])]
best = max((r for r in rows if r.get("label", "").startswith("l12-") and "tokens_per_s" in r),
           key=lambda r: r["tokens_per_s"], default={"threads_env": "15"})
print(best["threads_env"])
PY
)
echo "8B 8-bit run at $BEST threads"
TINYPIPE_THREADS=$BEST timeout -k 10 ${RUN8B_TIMEOUT:-260} python3 bench/device/frugal.py --out "$OUT" --parts runs \
  --label "t$BEST-" --runs "8bit:$LEAN" $HW >>"$OUT/log.txt" 2>&1
echo "8B 8-bit: exit status $?"
python3 bench/device/frugal.py --out "$OUT" --parts summary
