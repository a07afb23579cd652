"""The declaration language of a converter.

A converter is a list of :class:`Mapping` entries, each tying one Megatron parameter pattern to
its HF names through a :class:`~weightstream.converters.ops.TensorOp`. Patterns use ``*`` for a
layer or expert index and ``**`` for any dotted path; the HF side refers to the same captures with
``*``/``**`` in the same order, and ``{e}`` in an HF name makes one name per routed expert (the op
then makes its tensors once per expert, expert by expert). Mappings are compiled once.

A family also declares, in the same language, how transformers holds the model in memory where that
differs from the checkpoint names engines load (``Converter.memory``: transformers 5 keeps MoE experts
fused in 3-D parameters); :meth:`Converter.in_memory` is the converter from those names.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from weightstream.converters.ops import IDENTITY, TensorOp
from weightstream.models.spec import ModelSpec

__all__ = ["Condition", "tied", "untied", "compile_pattern", "fill_pattern", "Mapping", "Resolved", "Converter"]


Condition = Callable[[ModelSpec], bool]


def _always(spec: ModelSpec) -> bool:
    return True


def tied(spec: ModelSpec) -> bool:
    return spec.tie_word_embeddings


def untied(spec: ModelSpec) -> bool:
    return not spec.tie_word_embeddings


_TOKEN = re.compile(r"\*\*|\*")


def compile_pattern(pattern: str) -> re.Pattern[str]:
    out, pos = [], 0
    for m in _TOKEN.finditer(pattern):
        out.append(re.escape(pattern[pos : m.start()]))
        out.append(r"(.+?)" if m.group() == "**" else r"(\d+)")
        pos = m.end()
    out.append(re.escape(pattern[pos:]))
    return re.compile("".join(out) + r"\Z")


def fill_pattern(pattern: str, captures: Sequence[str]) -> str:
    it = iter(captures)
    try:
        return _TOKEN.sub(lambda _m: next(it), pattern)
    except StopIteration:
        raise ValueError(f"pattern {pattern!r} has more wildcards than the Megatron pattern captures") from None


@dataclass(frozen=True, slots=True)
class Mapping:
    """One Megatron parameter pattern and the HF tensors it becomes.

    ``tp_dim`` is the dimension along which Megatron splits the parameter over tensor parallel
    ranks (None: replicated). It is declared here, not read off the parameter, because Megatron
    does not always report it right. ``tp_group`` says which group splits it: ``"tp"`` (dense) or
    ``"etp"`` (expert tensor parallel). ``emit=False`` marks a parameter that is read from the HF
    names when loading but not emitted (the last stage's copy of a tied embedding).
    ``when`` limits the mapping to the specs it holds for. ``whole_or_split``: split on ``tp_dim`` under one
    Megatron spec and held whole on every rank under another (multi-latent attention's down projections: a
    column-parallel linear in the local spec, a duplicated one under Transformer Engine); a tensor whose every
    rank holds the whole HF shape is taken as replicated.

    Multi-token prediction (DeepSeek-V3): ``mtp_depth`` says the first ``*`` captures an MTP depth ``k``, which HF
    checkpoints number after the decoder's layers (``model.layers.{num_hidden_layers + k}``); an HF name holding
    ``{mtp}`` is made once per MTP depth, as that layer (the op makes them after the other names, in depth order).
    """

    megatron: str  # the source pattern (a Megatron name; an in-memory HF name in ``Converter.memory``)
    hf: tuple[str, ...] | str  # one HF name may be given alone; kept as a tuple
    op: TensorOp = IDENTITY
    tp_dim: int | None = None
    tp_group: str = "tp"
    emit: bool = True
    when: Condition = _always
    whole_or_split: bool = False
    mtp_depth: bool = False
    _regex: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.hf, str):
            object.__setattr__(self, "hf", (self.hf,))
        if len(self.hf) != self.op.arity:
            raise ValueError(
                f"mapping {self.megatron!r}: op {type(self.op).__name__} makes {self.op.arity} "
                f"tensors{' per expert' if self.per_expert else ''} but {len(self.hf)} HF names are given"
            )
        if self.tp_group not in ("tp", "etp"):
            raise ValueError(f"mapping {self.megatron!r}: tp_group must be 'tp' or 'etp'")
        object.__setattr__(self, "_regex", compile_pattern(self.megatron))

    @property
    def per_expert(self) -> bool:
        return any("{e}" in h for h in self.hf)

    def match(self, name: str) -> tuple[str, ...] | None:
        m = self._regex.match(name)
        return None if m is None else m.groups()

    def hf_names(self, captures: Sequence[str], spec: ModelSpec) -> tuple[str, ...]:
        if self.mtp_depth:
            captures = (str(spec.num_layers + int(captures[0])), *captures[1:])
        names = [fill_pattern(p, captures) for p in self.hf]
        if any("{mtp}" in n for n in names):
            return tuple([n for n in names if "{mtp}" not in n] + [
                n.replace("{mtp}", str(spec.num_layers + k)) for k in range(spec.mtp_layers) for n in names
                if "{mtp}" in n])
        if not self.per_expert:
            return tuple(names)
        return tuple(n.replace("{e}", str(e)) for e in range(spec.num_experts) for n in names)


@dataclass(frozen=True, slots=True)
class Resolved:
    """A Megatron name matched to its mapping, with the HF names filled in."""

    megatron_name: str
    mapping: Mapping
    hf_names: tuple[str, ...]

    @property
    def emit(self) -> bool:
        return self.mapping.emit


def _no_features(config: Any) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Converter:
    """Megatron <-> HF for one model family: declarations only, no parallelism."""

    model_type: str
    mappings: tuple[Mapping, ...]
    # Reads the family's facts (q/k/v bias, q/k norm, experts) from an HF config into ModelSpec fields.
    features: Callable[[Any], dict[str, Any]] = _no_features
    # Whether each TP shard converts on its own (per_rank mode). True for every op that keeps
    # whole query groups / gate-up halves / rows per shard, as the built-in ops do.
    per_rank: bool = True
    # How transformers holds the model in memory, where it differs from the checkpoint's HF names
    # (source patterns are in-memory names); every other in-memory name is the checkpoint name.
    memory: tuple[Mapping, ...] = ()
    # Block FP8: the HF weights a quantized model holds in float8 with per-block scales (HF name patterns, as
    # the published FP8 checkpoints of the family quantize them); every other tensor stays as it is. Empty:
    # the family declares no FP8 layout.
    fp8: tuple[str, ...] = ()
    # The HF tensors (name -> shape) the family's checkpoints hold besides those of transformers' model, given the
    # spec and the shapes of transformers' model (DeepSeek-V3's multi-token prediction layers).
    checkpoint_only: Callable[[ModelSpec, dict[str, tuple[int, ...]]], dict[str, tuple[int, ...]]] | None = None

    def resolve(self, megatron_name: str, spec: ModelSpec) -> Resolved | None:
        """The first mapping that holds for ``spec`` and matches ``megatron_name``."""
        for mapping in self.mappings:
            if not mapping.when(spec):
                continue
            captures = mapping.match(megatron_name)
            if captures is not None:
                return Resolved(megatron_name, mapping, mapping.hf_names(captures, spec))
        return None

    def quantizes(self, hf_name: str) -> bool:
        """Whether a block-FP8 model of this family holds ``hf_name`` in float8."""
        return any(p.match(hf_name) for p in _fp8_patterns(self.fp8))

    def not_quantized(self, shapes: dict[str, tuple[int, ...]]) -> list[str]:
        """The modules whose 2-D weights among ``shapes`` (HF name -> shape) a block-FP8 model keeps as they are
        (a checkpoint's ``modules_to_not_convert``: embeddings, the output layer, routers)."""
        return sorted(name.removesuffix(".weight") for name, shape in shapes.items()
                      if name.endswith(".weight") and len(shape) == 2 and not self.quantizes(name))

    def in_memory(self) -> Converter:
        """The converter from the names and layout transformers holds in memory (an FSDP2 / DTensor
        source) to the checkpoint names: the family's ``memory`` mappings, then every other name as is."""
        built = _IN_MEMORY.get(id(self))
        if built is None or built[0] is not self:
            mappings = self.memory + (Mapping("**", "**"),)
            built = _IN_MEMORY[id(self)] = (self, replace(self, mappings=mappings, memory=()))
        return built[1]

    def derive(
        self,
        model_type: str,
        *,
        add: Iterable[Mapping] = (),
        remove: Iterable[str] = (),
        features: Callable[[Any], dict[str, Any]] | None = None,
        memory: Iterable[Mapping] = (),
        fp8: Iterable[str] = (),
    ) -> Converter:
        """A new family from this one: drop the mappings whose Megatron patterns are in ``remove``,
        append ``add`` (``memory`` to the in-memory mappings, ``fp8`` to the FP8 weights), and optionally
        replace ``features``."""
        removed = set(remove)
        unknown = removed - {m.megatron for m in self.mappings}
        if unknown:
            raise ValueError(f"cannot remove unknown mappings from {self.model_type}: {sorted(unknown)}")
        kept = tuple(m for m in self.mappings if m.megatron not in removed)
        return replace(self, model_type=model_type, mappings=kept + tuple(add), features=features or self.features,
                       memory=self.memory + tuple(memory), fp8=self.fp8 + tuple(fp8))


_IN_MEMORY: dict[int, tuple[Converter, Converter]] = {}


@functools.lru_cache(maxsize=64)
def _fp8_patterns(patterns: tuple[str, ...]) -> tuple[re.Pattern[str], ...]:
    return tuple(compile_pattern(p) for p in patterns)
