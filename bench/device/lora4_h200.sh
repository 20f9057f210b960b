# LoRA on a 4-bit (NF4) base beside the bf16 base on one H200 (docs/performance.md, "LoRA"), from the repository root:
#   bash bench/device/lora4_h200.sh            -> $OUT/lora4_h200.jsonl, $OUT/lora4_h200.json, $OUT/lora4_peers.json
# setup.sh prints this machine's host copy bandwidth first. Then, each case a `tinypipe run --backend cuda` through
# bench/cuda_bench.py (random init, bf16 compute, seq 2048, --gpu-mem 24GiB, LoRA r 16, alpha 32 on all seven
# linears; timing runs: --checkpoint-minutes 0 --keep-checkpoints 0 --no-save), each with tokens/s, GPU peak, host
# RSS and the prediction beside them:
# (a) Llama-3.1-8B, 65,536 tokens per step, the `1gpu-lora-lean` policy: bf16 base, then the same with
#     --load-in-4bit; then RoundPipe with peft's LoRA on the same model (bench/peers/run.py) when its wheels are in
#     .peers/wheels (bench/peers/fetch_wheels.sh) and the time left allows;
# (b) Llama-3.1-70B with --load-in-4bit, 16,384 tokens per step, 3 steps (`1gpu-lora-70b-4bit`: 40 GiB of NF4
#     base on the host, which the bf16 base's 131 GiB would not leave room for on this 125 GiB machine).
# Under 9 minutes: each case runs under its own limit (CASE_TIMEOUT, BIG_TIMEOUT), cut to what is left of BUDGET_S
# (default 530 s, counted from the start, setup included), and RoundPipe gets what is left after them or is
# skipped. An 8B case took 164 s for 8 steps on 2026-12-02 (bench/results/lora_h200.json: build, calibration and
# compilation before the steps), so with STEPS8B=4 the two 8B cases and the 70B one (its build draws and
# quantises 70B weights) may leave RoundPipe no time: run `PARTS=peers` (or `PARTS=70b`) as a call of its own then, or
# bench/device/peers.sh with `--lora 16 --runs tinypipe roundpipe`, which runs (a)'s bf16 case beside RoundPipe.
# PARTS (default "bf16 nf4 70b peers") picks parts: bf16 and nf4 are (a)'s two tinypipe cases.
# Wheels: peft, accelerate and bitsandbytes in .whl/ (pip download --no-deps -d .whl peft accelerate bitsandbytes);
# setup.sh installs .whl/*.whl.
START=$(date +%s)
. bench/device/setup.sh
LORA="--lora 16 --lora-alpha 32 --lora-targets all"
TIMING="--checkpoint-minutes 0 --keep-checkpoints 0 --no-save --hardware ${HW:-h200x1}"
PARTS=${PARTS:-bf16 nf4 70b peers}
BUDGET_S=${BUDGET_S:-530}
JSONL="$OUT/lora4_h200.jsonl"
part() { case " $PARTS " in *" $1 "*) return 0;; esac; return 1; }
left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }
python3 -c "from tinypipe.backends.model import nf4; nf4.functional(); import bitsandbytes, peft; \
print('bitsandbytes', bitsandbytes.__version__, 'peft', peft.__version__)" || { echo "see the header: wheels"; exit 2; }
free -g | head -2
case_run() {  # label, limit in s (cut to the time left), then bench/cuda_bench.py options
  label=$1; limit=$2; shift 2
  [ "$limit" -gt $(( $(left) - 10 )) ] && limit=$(( $(left) - 10 ))
  [ "$limit" -lt 60 ] && { echo "$label: skipped, $(left) s left"; return; }
  timeout -k 10 "$limit" python3 bench/cuda_bench.py --out "$JSONL" --label="$label" "$@" >>"$OUT/lora4_log.txt" 2>&1
  echo "$label: exit $? at $(( $(date +%s) - START )) s"; grep -v "^training \[" "$OUT/lora4_log.txt" | tail -2
}
if part bf16; then
  case_run -llama8b-bf16 "${CASE_TIMEOUT:-170}" --cases 1gpu-lora-lean --steps "${STEPS8B:-4}" --extra $LORA $TIMING
fi
if part nf4; then
  case_run -llama8b-nf4 "${CASE_TIMEOUT:-170}" --cases 1gpu-lora-lean --steps "${STEPS8B:-4}" \
    --extra $LORA --load-in-4bit $TIMING
fi
if part 70b; then
  case_run -llama70b-nf4 "${BIG_TIMEOUT:-300}" --cases 1gpu-lora-70b-4bit --model llama-3.1-70b --steps 3 \
    --batch-tokens 16384 --extra $LORA --load-in-4bit $TIMING
fi
if part peers; then
  if ls .peers/wheels/roundpipe/*.whl >/dev/null 2>&1 && [ "$(left)" -gt 150 ]; then
    rm -rf /tmp/peers-rp; mkdir -p /tmp/peers-rp
    python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --target /tmp/peers-rp \
      --find-links .peers/wheels/roundpipe --find-links .whl -r bench/peers/requirements-roundpipe.txt >/tmp/peers-rp/.install.log 2>&1
    echo $? >/tmp/peers-rp/.install.rc
    echo "install roundpipe: exit $(cat /tmp/peers-rp/.install.rc) at $(( $(date +%s) - START )) s"
    deadline=$(( $(left) - 15 ))
    python3 bench/peers/run.py --lora 16 --runs roundpipe --timeout-s $(( deadline < 260 ? deadline : 260 )) \
      --deadline-s "$deadline" --out "$OUT/lora4_peers.json" --workdir "$OUT/peers" 2>&1 | tail -8
  else
    echo "RoundPipe skipped: no wheels in .peers/wheels/roundpipe, or $(left) s left"
  fi
fi
[ -f "$JSONL" ] && python3 - "$JSONL" "$OUT/lora4_h200.json" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
json.dump(rows, open(sys.argv[2], "w"), indent=1)
for r in rows:
    if "error" in r:
        print(r["case"], "failed:", r["error"])
        continue
    print(f"{r['case']}: {r['tokens_per_s']:,.0f} tokens/s (predicted {r['predicted_tokens_per_s']:,.0f}, "
          f"{100 * (r['predicted_tokens_per_s'] / r['tokens_per_s'] - 1):+.1f}%), GPU peak "
          f"{r['peak_gpu_bytes'] / 2**30:.2f} GiB (predicted {r['predicted_peak_gpu_bytes'] / 2**30:.2f}), host RSS "
          f"{r['peak_host_rss_bytes'] / 2**30:.2f} GiB (predicted host {r['predicted_peak_host_bytes'] / 2**30:.2f}), "
          f"host state {r['host_state_bytes'] / 2**30:.2f} GiB")
PY
echo "done at $(( $(date +%s) - START )) s"
