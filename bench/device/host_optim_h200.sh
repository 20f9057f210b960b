# The host optimizer's one-pass kernel on one H200 machine (16 cores, 125 GiB host), from the repository root:
#   bash bench/device/host_optim_h200.sh     -> $OUT/hostbw.json, $OUT/frugal_h200.jsonl, $OUT/host_optim_precision_h200.json
# 1. this host's copy bandwidth, and which kernel steps the host here (native, or torch and why);
# 2. host AdamW per state precision and thread count: the kernel beside the torch operators and torch's fused
#    AdamW (64M parameters; G params/s, GB/s and the share of the copy bandwidth);
# 3. Llama-3.1-8B, --gpu-mem 24GiB, 65,536 tokens/step, the lean policy (one layer a pack), each run traced:
#    fp32 moments first, then 8-bit, with the same policy: tokens/s, peak RSS, GPU peak, predicted beside each.
. bench/device/setup.sh
(cd /tmp && python3 -c "from tinypipe.backends import fused_host_adamw as k; print('host kernel:', k.name(), k.unavailable() or '')")
timeout -k 10 150 python3 bench/device/frugal.py --out "$OUT" --parts optim >>"$OUT/log.txt" 2>&1
tail -40 "$OUT/log.txt"
timeout -k 10 ${RUNS_TIMEOUT:-400} python3 bench/device/frugal.py --out "$OUT" --parts runs \
  --runs fp32:bench/policies/h200x1-24g-lean1-sync.json 8bit:bench/policies/h200x1-24g-lean1-sync.json \
  >>"$OUT/log.txt" 2>&1
echo "runs exit status $?"
grep -v "^training \[" "$OUT/log.txt" | tail -12
python3 - "$OUT/frugal_h200.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("part") == "runs":
        keys = ("optimizer_state", "tokens_per_s", "predicted_tokens_per_s", "peak_host_rss_bytes",
                "predicted_peak_host_bytes", "peak_gpu_bytes", "predicted_peak_gpu_bytes", "error", "wall_s",
                "busy_s_per_iteration", "main_thread_issue_share", "calibration", "host_kernel", "iteration_s_each")
        print({k: (round(r[k] / 2**30, 2) if k.endswith("bytes") else r[k]) for k in keys if k in r})
PY
