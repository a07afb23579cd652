"""Our block-FP8 quantization against the engines' own functions, run where they import on the CPU.

Run with a python that has vLLM (``vllm.utils.deep_gemm.per_block_cast_to_fp8``: DeepGEMM's function, which
vLLM's block-FP8 paths use) or SGLang (``sglang.srt.layers.quantization.fp8_utils.per_block_cast_to_fp8``: the
same with power-of-two scales); the repository root is put on ``sys.path``. Prints one JSON object.

On a CPU, torch computes DeepGEMM's ``amax / 448.0`` as a true division; CUDA computes it as
``amax * (1 / 448)``, and weightstream computes the latter on either device (weightstream/converters/fp8.py).
So against vLLM's function run here, the scales are equal exactly where the two roundings agree, and the fp8
values are equal bit for bit in every block whose scale is; each other block is checked to be one ulp apart in
its scale and to hold exactly ``x * (1 / scale)`` cast to e4m3 (the function's own last step). With
power-of-two scales both roundings give the same power (the check says how many blocks it compared).
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))  # torchvision_standin
sys.path.insert(0, str(ROOT))  # weightstream from this checkout
warnings.filterwarnings("ignore")

import torch  # noqa: E402

from weightstream.converters.fp8 import quantize_block_fp8  # noqa: E402
from weightstream.wire.fp8 import FP8  # noqa: E402

SHAPES = [(256, 384), (320, 200), (1000, 130), (128, 128), (7, 300)]


def _samples() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i, shape in enumerate(SHAPES):
        x = torch.randn(shape, generator=g) * (0.02 * (i + 1))
        if i == 2:
            x[:128, :128] = 0  # an all-zero block
        if i == 3:
            x[0, 0] = 1e4  # a block dominated by one value
        out.append(x.to(torch.bfloat16))
    return out


def _expand(mask: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    return mask.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]


def _compare(ours: tuple[torch.Tensor, torch.Tensor], theirs: tuple[torch.Tensor, torch.Tensor],
             x: torch.Tensor) -> dict:
    (q, s), (rq, rs) = ours, theirs
    same = s == rs
    where = _expand(same, tuple(x.shape))
    one_ulp = torch.nextafter(rs, torch.full_like(rs, float("inf"))) == s
    one_ulp |= torch.nextafter(rs, torch.full_like(rs, 0.0)) == s
    recomputed = (x.float() * (1.0 / _expand(s, tuple(x.shape)))).to(FP8)
    return {
        "shape": list(x.shape), "blocks": s.numel(), "scales_equal": int(same.sum()),
        "other_scales_one_ulp": bool(one_ulp[~same].all()),
        "fp8_equal_where_scales_equal": torch.equal(q.view(torch.uint8)[where], rq.view(torch.uint8)[where]),
        "fp8_is_own_last_step": torch.equal(q.view(torch.uint8), recomputed.view(torch.uint8)),
        "dtypes": [str(q.dtype), str(s.dtype)], "scale_shape": list(s.shape),
    }


def check_vllm() -> dict:
    import vllm
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    ref = per_block_cast_to_fp8.__wrapped__  # the eager function (the compiled one computes the same)
    rows = [_compare(quantize_block_fp8(x), ref(x, [128, 128], use_ue8m0=False), x) for x in _samples()]
    ue8m0 = []
    for x in _samples():
        q, s = quantize_block_fp8(x, ue8m0=True)
        rq, rs = ref(x, [128, 128], use_ue8m0=True)
        ue8m0.append({"shape": list(x.shape), "scales_equal": torch.equal(s, rs),
                      "fp8_equal": torch.equal(q.view(torch.uint8), rq.view(torch.uint8))})
    return {"engine": "vllm", "version": vllm.__version__, "float": rows, "ue8m0": ue8m0}


def check_sglang() -> dict:
    import sglang
    import torchvision_standin  # noqa: F401  (before sglang.srt imports torchvision)
    from sglang.srt.layers.quantization.fp8_utils import per_block_cast_to_fp8

    ue8m0 = []
    for x in _samples():
        q, s = quantize_block_fp8(x, ue8m0=True)
        rq, rs = per_block_cast_to_fp8(x)
        ue8m0.append({"shape": list(x.shape), "scales_equal": torch.equal(s, rs),
                      "fp8_equal": torch.equal(q.view(torch.uint8), rq.view(torch.uint8))})
    return {"engine": "sglang", "version": sglang.__version__, "ue8m0": ue8m0}


if __name__ == "__main__":
    which = sys.argv[1]
    print(json.dumps(check_vllm() if which == "vllm" else check_sglang()))
