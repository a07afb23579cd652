"""The block-FP8 layout of an engine's model, as its user states it and as the engine reports it: what an
adapter puts in :attr:`~weightstream.engines.base.EngineInfo.fp8`, and what a statement contradicts."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from weightstream.wire.fp8 import BlockFP8, block_fp8_of

__all__ = ["StatedFormat", "stated_format", "describe_format", "settle_format"]


@dataclass(frozen=True)
class StatedFormat:
    """The weight layout of an engine's model as its user states it, for engines that do not report it
    (SGLang, vLLM, LMDeploy): block FP8 in ``fp8``'s layout, or unquantized (``fp8`` None, from a model whose
    ``config.json`` has no ``quantization_config``). ``source`` says where the statement came from."""

    fp8: BlockFP8 | None
    source: str


def stated_format(fp8: BlockFP8 | None, model_path: str | Path | None) -> StatedFormat | None:
    """What an adapter's ``fp8=`` and ``model_path=`` state (None: neither given). ``model_path``: the served
    model's directory (or its ``config.json``), whose ``quantization_config`` says the layout. Raises one
    ``ValueError`` where the model's config cannot be read, names a quantization other than block FP8, or
    disagrees with ``fp8``."""
    if model_path is None:
        return None if fp8 is None else StatedFormat(fp8, f"fp8={fp8}")
    path = Path(model_path)
    config_file = path / "config.json" if path.is_dir() else path
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"model_path {str(model_path)!r}: cannot read the served model's config.json "
                         f"({exc})") from None
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    from_config = block_fp8_of(qc if isinstance(qc, dict) else None)
    problems = []
    if qc and from_config is None:
        method = qc.get("quant_method") if isinstance(qc, dict) else qc
        problems.append(f"its quantization_config names {method!r} without a weight_block_size: weightstream "
                        "sends block FP8 or unquantized weights only")
    if fp8 is not None and fp8 != from_config:
        problems.append(f"it declares {describe_format(from_config)}, but fp8={fp8} was stated")
    if problems:
        raise ValueError(f"the model at {str(config_file)!r}: " + "; ".join(problems))
    return StatedFormat(from_config, f"the quantization_config of {config_file}")


def describe_format(fp8: BlockFP8 | None) -> str:
    return "unquantized weights" if fp8 is None else f"block FP8 {fp8.block} ({fp8.scale_fmt} scales)"


def settle_format(stated: StatedFormat | None, reported: BlockFP8 | None, method: str | None, *,
                  reports_layout: bool, names_fp8_method: bool) -> tuple[BlockFP8 | None, tuple[str, ...]]:
    """An engine's block-FP8 layout (``EngineInfo.fp8``) and what a statement contradicts in its report.

    ``reported``: the layout the engine reports where it reports one (``reports_layout``: a
    ``quantization_config`` in its reply, null for an unquantized model). ``method``: the FP8 method it names
    (``EngineInfo.quantization``) or any other quantization method it names. ``names_fp8_method``: the engine
    always names ``fp8`` for a block-FP8 checkpoint (vLLM), so naming nothing contradicts a stated layout.
    Without a statement the engine's report stands (None where it says nothing)."""
    if stated is None:
        return reported, ()
    said = f"stated ({stated.source}): {describe_format(stated.fp8)}"
    if reports_layout:
        if reported != stated.fp8:
            return reported, (f"{said}, but the engine reports {describe_format(reported)}",)
        return reported, ()
    if stated.fp8 is not None and method not in ("fp8", None):
        return stated.fp8, (f"{said}, but the engine names quantization {method!r}",)
    if stated.fp8 is not None and method is None and names_fp8_method:
        return stated.fp8, (f"{said}, but the engine names no FP8 method (its model is not quantized)",)
    if stated.fp8 is None and method is not None:
        return stated.fp8, (f"{said}, but the engine names quantization {method!r}",)
    return stated.fp8, ()
