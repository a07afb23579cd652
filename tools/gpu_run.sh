#!/usr/bin/env bash
# Run on the GPU machine from the repo root, with the megatron-core wheel carried in .whl/:
#   bash tools/gpu_run.sh check                      # tiny Qwen3 into the reference engine, logits vs HF
#   bash tools/gpu_run.sh memory                     # reference engine memory release / resume / update on GPU
#   bash tools/gpu_run.sh bench ARGS...              # weightstream bench ARGS
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
if [ ! -d /tmp/site/megatron ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
what="${1:-check}"; shift || true
case "$what" in
  check) python3 tools/gpu_jobs.py ;;
  memory) python3 tools/gpu_memory.py ;;
  bench) python3 -m weightstream.cli bench "$@" ;;
  *) echo "usage: gpu_run.sh check | memory | bench ARGS..." >&2; exit 2 ;;
esac
