# tinypipe beside its peers on one GPU machine (docs/performance.md), from the repository root; the peers'
# wheels in .peers/wheels come from `bash bench/peers/fetch_wheels.sh` on a machine with PyPI:
#   bash bench/device/peers.sh [RUNNER OPTIONS]   -> the table on stdout, $OUT/peers_h200.json, $OUT/peers/
# 1. installs RoundPipe (with transformers 4.57) into /tmp/peers-rp and DeepSpeed (from its source
#    distribution, DS_BUILD_OPS=0) into /tmp/peers-ds, from .peers/wheels only; each install's output and
#    exit status go into its directory (.install.log, .install.rc), where the runner reads them. tinypipe's
#    own runs never see these directories: only the RoundPipe and DeepSpeed processes get them on PYTHONPATH.
# 2. bench/peers/run.py: every run (default: 1 GPU, 24 GiB cap), each in its own process under its time
#    limit, all within what is left of BUDGET_S (default 580 s).
#    RUNNER OPTIONS pass through, e.g. `--caps none`, `--runs deepspeed mobius mobius-async`, `--gpus 1,2`.
# LoRA (r 16, alpha 32, all seven linears, the whole Llama-3.1-8B): tinypipe's own adapters beside RoundPipe
# with peft's (in /tmp/peers-rp), the JSON in $OUT/peers_h200_lora.json; DeepSpeed is not installed (its
# script trains every parameter, so its run is skipped):
#   bash bench/device/peers.sh --lora 16 --runs tinypipe roundpipe --layers 32 --timeout-s 260
. bench/device/setup.sh
START=$(date +%s)
W=.peers/wheels
export TORCH_EXTENSIONS_DIR=/tmp/peers-torch-extensions  # where RoundPipe and DeepSpeed build their CPU Adam ops
nproc; free -g | head -2; nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader 2>&1
g++ --version 2>&1 | head -1; ninja --version 2>&1 | sed 's/^/ninja /'; nvcc --version 2>&1 | tail -1
install() {  # name, target, then pip options
  name=$1; target=$2; shift 2
  rm -rf "$target"; mkdir -p "$target"
  python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --target "$target" \
    --find-links "$W/$name" --find-links .whl -r "bench/peers/requirements-$name.txt" "$@" >"$target/.install.log" 2>&1
  echo $? >"$target/.install.rc"
  echo "install $name: exit $(cat "$target/.install.rc") at $(( $(date +%s) - START )) s"
  tail -3 "$target/.install.log"
}
lora=0
for arg in "$@"; do case $arg in --lora|--lora=*) lora=1;; esac; done
install roundpipe /tmp/peers-rp
if [ $lora = 0 ]; then
  export DS_BUILD_OPS=0  # no op is compiled at install: CPU Adam is built at first use
  install deepspeed /tmp/peers-ds --no-build-isolation
fi
json=peers_h200; [ $lora = 1 ] && json=peers_h200_lora
left=$(( ${BUDGET_S:-580} - ($(date +%s) - START) - 10 ))
deadline=$(( left < 540 ? left : 540 ))
echo "runner deadline: $deadline s"
python3 bench/peers/run.py --out "$OUT/$json.json" --workdir "$OUT/peers" --deadline-s "$deadline" "$@"
echo "done at $(( $(date +%s) - START )) s"
