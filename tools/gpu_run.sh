#!/usr/bin/env bash
# Run on the GPU machine from the repo root, with the megatron-core wheel carried in .whl/:
#   bash tools/gpu_run.sh [check] [stream] [update]
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, megatron.core, transformers; print('torch', torch.__version__, 'mcore', megatron.core.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())"
python3 tools/gpu_jobs.py "$@"
