# On a lent H200 machine, from the repository root (carry .whl):
#   DEADLINE_S=560 [STEPS=8] [GPUS=N] [PROFILES=DIR] [MORE_PROFILES=DIR] [MODELS="qwen3 llama"] [EAGER=0]
#   [RANK=N] [RANK_GAP=F] [CONTENTION="OPTIONS"] bash bench/device/fidelity_h200.sh RUN...
# Issue 10's fidelity campaign: profile once, then run every configuration planned from that profile.
# GPUS (default 1): the machine's GPUs; the profile's hardware.json is the h200xGPUS preset with the
# measured rates, and the host optimizer is timed at one rank's threads (cores / GPUS - 1).
# 1. Unless PROFILES names the folders of an earlier call (committed under bench/results/), `tinypipe
#    profile` with each kind's host optimizer step: Qwen3-1.7B at 2 and 4 x 2048 eager ($OUT/pq), at
#    4 x 2048 compiled ($OUT/pq-compiled), Llama-3.1-8B at 4 x 2048 eager ($OUT/pl) and compiled
#    ($OUT/pl-compiled) (MODELS: which of the two; EAGER=0: the compiled folders only); the first one also measures the copy and optimizer
#    rates (rates.json, hardware.json, copied into every folder); then the
#    profiler's GPU test (NO_TEST=1: not). With RANK=N, bench/search_rank.py pick: the first N distinct candidates of
#    `tinypipe search --gpu-mem 24GiB` for Qwen3-1.7B on this profile (compiled, pq's hardware.json),
#    as $OUT/rank/rank-K.json, which a RUN names as its POLICY; with RANK_GAP=F also a ladder of N, each
#    pick at least F slower than the one before ($OUT/ladder/ladder-K.json).
# With CONTENTION, bench/host_contention.py OPTIONS runs after the profiles ($OUT/host_contention.json).
# 2. Each RUN = MODEL:CASE:MB:MODE[:POLICY[:ENV]] runs bench/cuda_bench.py's CASE (65,536 tokens per step,
#    --gpu-mem 24GiB) on MODEL (qwen3-1.7b or llama-3.1-8b) at MB sequences per microbatch, MODE
#    compile or eager (+peaks: with `run --trace-memory`, labelled -mem- instead of -fid-, so that
#    bench/fidelity.py leaves its perturbed timing out), with POLICY (a file in $OUT/rank/, else under bench/policies/) instead of the case's policy when
#    given (a path with a / is taken from the repository root); planned with the profile of step 1 that matches (pq / pq-compiled / pl / pl-compiled) and
#    its hardware.json (MORE_PROFILES: where a folder this call did not make is found), appended to $OUT/cuda_h200.jsonl with its trace. ENV: VAR=VALUE[,VAR=VALUE] set for that run only (an A/B run, labelled -ab-...-VAR_VALUE,
#    which bench/fidelity.py leaves out; backends/hostwork.py host_settings reads TINYPIPE_GIL_SWITCH_S and TINYPIPE_THREADS). A run that would pass
#    DEADLINE_S is skipped.
# Throughout, the host's /proc/stat "cpu" line once a second with the wall clock ($OUT/stat.txt), which
# bench/steal_spells.py lines up with each trace's iterations (otherData.origin_unix_s), and the page
# fault, NUMA-balancing and huge-page counters of /proc/vmstat beside it ($OUT/vmstat.txt: what might
# slow a host step without steal; bench/steal_spells.py --vmstat).
# What comes back (at most 8 files): log.txt, cuda_h200.jsonl, stat.txt, vmstat.txt, and results.tgz
# with the profile folders and the runs' traces.
. bench/device/setup.sh
ROOT=$(pwd)
START=$(date +%s)
cd /tmp
nproc; free -g | head -2
pack() { cd "$OUT" && tar czf results.tgz --remove-files $(ls -d p* rank ladder *.trace.json 2>/dev/null) 2>/dev/null; ls -la "$OUT"; }
(while :; do t=$(date +%s.%N); echo "$t $(head -1 /proc/stat)" >>"$OUT/stat.txt"
  echo "$t $(grep -E '^(pgfault|pgmajfault|numa_hint_faults|numa_pages_migrated|thp_fault_alloc|thp_collapse_alloc|compact_stall) ' /proc/vmstat | tr '\n' ' ')" >>"$OUT/vmstat.txt"
  sleep 1; done) &
SAMPLER=$!
trap 'kill $SAMPLER; pack' EXIT
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
if [ -n "$CONTENTION" ]; then  # bench/host_contention.py first, with these options (e.g. "--steps 5")
  t0=$(date +%s)
  (cd "$ROOT/bench" && timeout 200 python3 host_contention.py $CONTENTION --out host_contention.json) 2>&1 | tee -a "$OUT/log.txt" | tail -20
  cp "$ROOT/bench/results/host_contention.json" "$OUT/" 2>/dev/null
  echo "host_contention: $(( $(date +%s) - t0 )) s"
fi
if [ -n "$RANK" ]; then
  python3 "$ROOT/bench/search_rank.py" pick --model qwen3-1.7b --hardware "$P/pq-compiled/hardware.json" \
    --profile "$P/pq-compiled" --n "$RANK" --out "$OUT/rank" 2>&1 | tee -a "$OUT/log.txt"
  [ -n "$RANK_GAP" ] && python3 "$ROOT/bench/search_rank.py" pick --model qwen3-1.7b --hardware "$P/pq-compiled/hardware.json" \
    --profile "$P/pq-compiled" --n "$RANK" --min-gap "$RANK_GAP" --out "$OUT/ladder" 2>&1 | tee -a "$OUT/log.txt"
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
    f="$ROOT/bench/policies/$policy"; [ -f "$OUT/rank/$policy" ] && f="$OUT/rank/$policy"
    [ -f "$OUT/ladder/$policy" ] && f="$OUT/ladder/$policy"
    case "$policy" in */*) f="$ROOT/$policy";; esac
    pol=(--policy "$f"); policy=$(basename "$policy"); label="$label-${policy%.json}"
  fi
  pp="$P/$p"; [ -d "$pp" ] || pp="$ROOT/$MORE_PROFILES/$p"  # a model not profiled in this call
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
