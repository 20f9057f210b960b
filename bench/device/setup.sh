# Sourced by every script of bench/device/, from the repository root:  . bench/device/setup.sh
# Installs the project without dependencies into /tmp/site (the GPU image brings torch, transformers and
# safetensors; wheels in .whl/, if there, bring the rest, e.g. simpy, on a machine without a package
# index), sets OUT (default bench/out: logs, records, traces) and the NCCL settings of the H200 hosts.
set -e
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . >/dev/null
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
export OUT=${OUT:-$(pwd)/bench/out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# a run that hangs prints every thread's Python stack (backends/rank/worker.py) instead of dying silently
export TINYPIPE_STACKS_AFTER_S=${TINYPIPE_STACKS_AFTER_S:-240}
set +e
python3 -c "import torch, tinypipe, simpy; print('torch', torch.__version__, 'gpus', torch.cuda.device_count(), torch.cuda.get_device_name(0))"
# the shipped hardware preset of this GPU, by `run`'s own rule (scripts plan with ${HW:-$GPU_PRESET})
export GPU_PRESET=$(python3 -c "from tinypipe.backends.launch.devices import cuda_hardware; print(cuda_hardware(1, None).name)" 2>/dev/null || echo h200x1)
python3 bench/device/hostbw.py "$OUT/hostbw.json"  # this machine's host copy bandwidth: compare only within one machine
