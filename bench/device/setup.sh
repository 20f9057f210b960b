# Source on the lent GPU machine (the device tool runs commands in the repository root):
#   . bench/device/setup.sh
# The image has torch, transformers and safetensors but not simpy: the wheel travels in .whl/
# (carry it). The project installs without dependencies into /tmp/site.
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . >/dev/null
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# a run that hangs prints every thread's Python stack (backends/worker.py) instead of dying silently
export TINYPIPE_STACKS_AFTER_S=${TINYPIPE_STACKS_AFTER_S:-240}
set +e
python3 -c "import torch, tinypipe, simpy; print('torch', torch.__version__, 'gpus', torch.cuda.device_count(), torch.cuda.get_device_name(0))"
