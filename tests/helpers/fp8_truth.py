"""The truth of a block-FP8 stream: the source checkpoint's tensors, those the family declares FP8 quantized
(``weightstream.converters.fp8``) into values and scales, the rest as they are."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from weightstream.common.hf_files import CheckpointReader
from weightstream.converters.fp8 import quantize_weight
from weightstream.converters.registry import get_converter
from weightstream.models.spec import load_hf_config
from weightstream.wire.fp8 import SCALE_SUFFIX, BlockFP8


class QuantizedTruth:
    """A checkpoint reader's view of what a quantized stream of it yields (``keys``, ``get``)."""

    def __init__(self, reader: CheckpointReader, model_type: str, fp8: BlockFP8):
        self.reader, self.fp8 = reader, fp8
        self.converter = get_converter(model_type)

    def keys(self) -> list[str]:
        plain = list(self.reader.keys())
        return sorted(plain + [k + SCALE_SUFFIX for k in plain if self.converter.quantizes(k)])

    def get(self, name: str) -> torch.Tensor:
        if name.endswith(SCALE_SUFFIX):
            return quantize_weight(self.fp8, self.reader.get(name.removesuffix(SCALE_SUFFIX)))[1]
        if self.converter.quantizes(name):
            return quantize_weight(self.fp8, self.reader.get(name))[0]
        return self.reader.get(name)


@contextmanager
def truth_of(src: str, fp8: BlockFP8 | None) -> Iterator[CheckpointReader | QuantizedTruth]:
    """The checkpoint at ``src`` as a stream of it yields it (quantized where ``fp8``)."""
    with CheckpointReader(src) as reader:
        yield reader if fp8 is None else QuantizedTruth(reader, load_hf_config(src).model_type, fp8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (for every dtype, float8 included)."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)))
