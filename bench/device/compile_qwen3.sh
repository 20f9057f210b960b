# Compiled blocks against eager ones on one H200 (docs/performance.md), from the repository root:
#   DEADLINE_S=560 bash bench/device/compile_qwen3.sh RUN...
# (PROFILES=DIR: take step 1's folders from DIR, made by an earlier run on the same machine)
# 1. `tinypipe profile` on this GPU: Qwen3-1.7B at 2 and 4 x 2048 tokens with the copy and optimizer
#    rates ($OUT/pq, with hardware.json), its block compiled ($OUT/pq-compiled, 4 x 2048), and
#    Llama-3.1-8B's layers at 4 x 2048 eager ($OUT/pl) and compiled ($OUT/pl-compiled): the
#    block times of `--compile` beside eager ones, measured minutes apart on one GPU.
# 2. each RUN = CASE:MICROBATCH_SIZE[:compile] of bench/cuda_bench.py on Qwen3-1.7B (65,536 tokens
#    per step, --gpu-mem 24GiB), planned with the profile of step 1 (the compiled one for :compile),
#    appended to $OUT/cuda_h200.jsonl with its trace; a run that would pass DEADLINE_S is skipped.
. bench/device/setup.sh
ROOT=$(pwd)
START=$(date +%s)
cd /tmp
nproc; free -g | head -2
prof() {  # out dir, then profile options
  o=$1; shift
  timeout 200 tinypipe profile --backend cuda --seq-len 2048 --hardware h200x1 --out "$OUT/$o" "$@" >>"$OUT/log.txt" 2>&1
  echo "profile $o: exit $? at $(( $(date +%s) - START )) s"
}
if [ -n "$PROFILES" ]; then  # profiles taken by an earlier run on this machine: reuse them
  cp -r "$ROOT/$PROFILES"/pq* "$ROOT/$PROFILES"/pl* "$OUT/"
else
prof pq --model qwen3-1.7b --microbatch-size 2 4 --no-compile
prof pq-compiled --model qwen3-1.7b --microbatch-size 4 --no-rates --compile
cp "$OUT/pq/hardware.json" "$OUT/pq-compiled/" 2>/dev/null
prof pl --model llama-3.1-8b --microbatch-size 4 --no-rates --no-compile
prof pl-compiled --model llama-3.1-8b --microbatch-size 4 --no-rates --compile
fi
python3 - "$OUT" <<'PY'
import json, sys, glob
for d in ("pq", "pq-compiled", "pl", "pl-compiled"):
    for f in sorted(glob.glob(f"{sys.argv[1]}/{d}/h200-*.json")):
        k = json.load(open(f))["kinds"]["block"]
        print(f"{d:12s} {f.split('/')[-1]:40s} block fwd {k['fwd_s']*1e3:7.3f} ms  bwd {k['bwd_s']*1e3:7.3f} ms  "
              f"recompute+bwd {k['recompute_bwd_s']*1e3:7.3f} ms  saved {k['saved_act_bytes']/2**20:8.1f} MiB  "
              f"workspace {k['workspace_bytes']/2**20:8.1f} MiB")
PY
for spec in "$@"; do
  IFS=: read -r case mb comp <<<"$spec"
  left=$(( ${DEADLINE_S:-560} - ($(date +%s) - START) ))
  if [ "$left" -lt 75 ]; then echo "$spec: skipped, $left s left"; continue; fi
  p=pq; flag=(--no-compile); label="-qwen3-mb$mb"
  if [ "$comp" = compile ]; then p=pq-compiled; flag=(--compile); label="$label-compiled"; fi
  timeout -k 10 $(( left < 150 ? left - 10 : 140 )) python3 "$ROOT/bench/cuda_bench.py" --model qwen3-1.7b --cases "$case" \
    --label="$label" --steps 6 --trace-dir "$OUT" --out "$OUT/cuda_h200.jsonl" \
    --extra --microbatch-size "$mb" --profile "$OUT/$p" --hardware "$OUT/pq/hardware.json" "${flag[@]}" >>"$OUT/log.txt" 2>&1
  echo "$spec: exit $? at $(( $(date +%s) - START )) s"
  grep -v "^training \[" "$OUT/log.txt" | tail -1
done
