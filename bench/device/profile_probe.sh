# On a lent H200 machine, from the repository root (carry .whl):  bash bench/device/profile_probe.sh
# Why did a compiled profile's host optimizer steps run 2.3-4.5x slower than the same machine's runs
# minutes later (2026-12-01, fifth session, call 1)? Three compiled Qwen3-1.7B profiles in a row:
# pa as fidelity_h200.sh takes it, pb with inductor's compile workers off (TORCHINDUCTOR_COMPILE_THREADS=1),
# pd as pa again (a cold machine's first minutes against later ones), while `top` samples the machine
# every 3 s ($OUT/top.txt). Each profile's optimizer table goes to log.txt.
. bench/device/setup.sh
nproc; free -g | head -2; uptime
(while true; do echo "== $(date +%T)"; top -b -n1 -w 180 | sed -n '1,5p;7,20p'; sleep 3; done) >"$OUT/top.txt" 2>&1 &
SAMPLER=$!
START=$(date +%s)
prof() {  # out, env..., then -- profile options
  o=$1; shift; envs=(); while [ "$1" != -- ]; do envs+=("$1"); shift; done; shift
  t0=$(date +%s)
  echo "== profile $o (${envs[*]}) starts at $(( t0 - START )) s" >>"$OUT/log.txt"
  env "${envs[@]}" timeout 200 tinypipe profile --backend cuda --seq-len 2048 --hardware h200x1 --threads $(( $(nproc) - 1 )) \
    --model qwen3-1.7b --microbatch-size 4 --compile --out "$OUT/$o" "$@" >>"$OUT/log.txt" 2>&1
  echo "profile $o (${envs[*]}): exit $? in $(( $(date +%s) - t0 )) s"
  sed -n '/^host optimizer step/,/^$/p' "$OUT/log.txt" | tail -8
}
prof pa --
prof pb TORCHINDUCTOR_COMPILE_THREADS=1 -- --no-rates
prof pd -- --no-rates
kill $SAMPLER
cd "$OUT" && tar czf results.tgz --remove-files pa pb pd && ls -la
