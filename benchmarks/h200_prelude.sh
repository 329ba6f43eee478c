# Sourced at the start of an H200 command: installs the carried wheels (.whl/: trl, datasets and its pure-Python
# needs, liger-kernel, math-verify, and a wheel of this repo built with `pip wheel --no-deps .`) into /root/site and
# runs from /root/run, so the installed package (grpo_lab.loss.kernel included) is what imports.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
REPO="$(pwd)"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /root/site .whl/*.whl
export PYTHONPATH=/root/site
mkdir -p /root/run && cd /root/run
python3 -c "import torch, triton, trl, transformers, peft, datasets, liger_kernel, grpo_lab.loss.kernel as k; \
print('gpu', torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__, 'trl', trl.__version__, \
'transformers', transformers.__version__, 'peft', peft.__version__, 'kernel', k.fused_kernel_available(), k.__file__)"
