# Fidelity on H200s (docs/fidelity.md): profile this machine once, then run every configuration planned
# from that profile, each predicted later by bench/fidelity.py. From the repository root:
#   DEADLINE_S=560 [STEPS=8] [GPUS=N] [PROFILES=DIR] [MORE_PROFILES=DIR] [MODELS="qwen3 llama"] [EAGER=0]
#   bash bench/device/fidelity_h200.sh RUN...
# GPUS (default 1): the machine's GPUs; the profile's hardware.json is the h200xGPUS preset with the
# measured rates, and the host optimizer is timed at one rank's threads (cores / GPUS - 1).
# 1. Unless PROFILES names the folders of an earlier profile, `tinypipe profile` with each kind's host
#    optimizer step: Qwen3-1.7B at 2 and 4 x 2048 eager ($OUT/pq), at 4 x 2048 compiled ($OUT/pq-compiled),
#    Llama-3.1-8B at 4 x 2048 eager ($OUT/pl) and compiled ($OUT/pl-compiled) (MODELS: which of the two;
#    EAGER=0: the compiled folders only); the first one also measures the copy and optimizer rates
#    (rates.json, hardware.json, copied into every folder); then the profiler's GPU test (NO_TEST=1: not).
# 2. Each RUN = MODEL:CASE:MB:MODE[:POLICY[:ENV]] runs bench/cuda_bench.py's CASE (65,536 tokens per step,
#    --gpu-mem 24GiB) on MODEL (qwen3-1.7b or llama-3.1-8b) at MB sequences per microbatch, MODE compile or
#    eager (+peaks: with `run --trace-memory`, labelled -mem- instead of -fid-, so that bench/fidelity.py
#    leaves its perturbed timing out), with POLICY (a policy JSON under bench/policies/, or a path with a /
#    from the repository root) instead of the case's policy when given; planned with the profile of step 1
#    that matches (pq / pq-compiled / pl / pl-compiled) and its hardware.json (MORE_PROFILES: where a folder
#    this run did not make is found), appended to $OUT/cuda_h200.jsonl with its trace. ENV: VAR=VALUE[,...]
#    set for that run only (an A/B run, labelled -ab-...-VAR_VALUE, which bench/fidelity.py leaves out;
#    backends/rank/hostwork.py host_settings reads TINYPIPE_GIL_SWITCH_S and TINYPIPE_THREADS). A run that would
#    pass DEADLINE_S is skipped.
# At the end $OUT holds log.txt, cuda_h200.jsonl, the profile folders and the runs' traces; then
#   python bench/fidelity.py --records $OUT/cuda_h200.jsonl --profile $OUT
. bench/device/setup.sh
ROOT=$(pwd)
START=$(date +%s)
cd /tmp
nproc; free -g | head -2
trap 'ls -la "$OUT"' EXIT
GPUS=${GPUS:-1}
RATES_TAKEN=
left() { echo $(( ${DEADLINE_S:-560} - ($(date +%s) - START) )); }
prof() {  # out dir, then profile options
  o=$1; shift
  t0=$(date +%s)
  rates=(--no-rates); [ -z "$RATES_TAKEN" ] && rates=() && RATES_TAKEN=$o
  timeout 240 tinypipe profile --backend cuda --seq-len 2048 --hardware "h200x$GPUS" \
    --threads $(( $(nproc) / GPUS - 1 )) --out "$OUT/$o" "${rates[@]}" "$@" >>"$OUT/log.txt" 2>&1
  echo "profile $o: exit $? in $(( $(date +%s) - t0 )) s"
  sed -n '/^host optimizer step/,/^$/p' "$OUT/log.txt" | tail -6
}
if [ -n "$PROFILES" ]; then
  P="$ROOT/$PROFILES"
else
  P="$OUT"
  case " ${MODELS:-qwen3 llama} " in *" qwen3 "*)
    [ "${EAGER:-1}" = 0 ] || prof pq --model qwen3-1.7b --microbatch-size 2 4 --no-compile
    prof pq-compiled --model qwen3-1.7b --microbatch-size 4 --compile;;
  esac
  case " ${MODELS:-qwen3 llama} " in *" llama "*)
    [ "${EAGER:-1}" = 0 ] || prof pl --model llama-3.1-8b --microbatch-size 4 --no-compile
    prof pl-compiled --model llama-3.1-8b --microbatch-size 4 --compile;;
  esac
  for d in "$OUT"/p*/; do [ -f "$d/hardware.json" ] || cp "$OUT/$RATES_TAKEN/hardware.json" "$d" 2>/dev/null; done
  [ -z "$NO_TEST" ] && timeout 150 python3 -m pytest -q -p no:cacheprovider --rootdir "$ROOT" "$ROOT/tests/backends/test_profile.py" \
    "$ROOT/tests/backends/test_profile_optim.py" -k cuda 2>&1 | tail -2 | tee -a "$OUT/log.txt"
fi
for spec in "$@"; do
  IFS=: read -r model case mb mode policy envs <<<"$spec"
  short=${model%%-*}; p=p${short:0:1}; flag=(--no-compile)
  [ "$short" = llama ] && p=pl
  [ "$short" = qwen3 ] && p=pq
  [ "${mode%+peaks}" = compile ] && p=$p-compiled && flag=(--compile)
  peaks=(); tag=fid
  case "$mode" in *+peaks) mode=${mode%+peaks}; peaks=(--trace-memory); tag=mem;; esac
  label="-$tag-$short-mb$mb-$mode"
  knobs=()
  if [ -n "$envs" ]; then  # an A/B run: labelled -ab-, which bench/fidelity.py leaves out
    IFS=, read -ra knobs <<<"$envs"
    label="${label/-$tag-/-ab-}-$(echo "$envs" | tr -c 'A-Za-z0-9.\n' _ | sed 's/TINYPIPE_//g')"
  fi
  pol=()
  if [ -n "$policy" ]; then
    f="$ROOT/bench/policies/$policy"
    case "$policy" in */*) f="$ROOT/$policy";; esac
    pol=(--policy "$f"); policy=$(basename "$policy"); label="$label-${policy%.json}"
  fi
  pp="$P/$p"; [ -d "$pp" ] || pp="$ROOT/$MORE_PROFILES/$p"  # a model not profiled in this run
  need=$([ "$short" = llama ] && echo 230 || echo 90)
  if [ "$(left)" -lt "$need" ]; then echo "$spec: skipped, $(left) s left"; continue; fi
  env "${knobs[@]}" timeout -k 10 $(( $(left) - 5 )) python3 "$ROOT/bench/cuda_bench.py" --model "$model" --cases "$case" \
    --label="$label" --steps "${STEPS:-8}" --trace-dir "$OUT" --out "$OUT/cuda_h200.jsonl" \
    --extra --microbatch-size "$mb" --profile "$pp" --hardware "$pp/hardware.json" "${flag[@]}" "${pol[@]}" "${peaks[@]}" \
    >>"$OUT/log.txt" 2>&1
  echo "$spec: exit $? at $(( $(date +%s) - START )) s"
  grep -v "^training \[" "$OUT/log.txt" | tail -1
done
echo "done in $(( $(date +%s) - START )) s"
