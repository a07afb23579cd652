"""Where a stream's tensors come from: a live Megatron-Core model, an FSDP2/DTensor model, a Megatron
checkpoint on disk (see :mod:`weightstream.streaming.sources.base`)."""

from weightstream.streaming.sources.base import Source, as_source

__all__ = ["Source", "as_source"]
