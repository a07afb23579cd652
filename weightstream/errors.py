"""Errors that list every problem at once."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = ["WeightstreamError", "UnknownModelError", "ConversionError", "ProblemList", "UpdateError"]


class WeightstreamError(Exception):
    """Base class of every error weightstream raises on purpose."""


class UnknownModelError(WeightstreamError, KeyError):
    def __init__(self, model_type: str, known: Iterable[str]):
        self.model_type = model_type
        self.known = sorted(known)
        super().__init__(model_type)

    def __reduce__(self):
        return (type(self), (self.model_type, self.known))

    def __str__(self) -> str:
        return (
            f"no converter is registered for model_type {self.model_type!r}; "
            f"known model types: {', '.join(self.known) or '(none)'}"
        )


class ConversionError(WeightstreamError):
    """One error for a whole conversion: every problem, grouped by kind.

    ``problems`` maps a kind ("unmapped Megatron parameters", "missing HF tensors",
    "shape mismatches", ...) to the list of offending names, each with a short detail.
    """

    def __init__(self, headline: str, problems: Mapping[str, list[str]]):
        self.headline = headline
        self.problems = {k: list(v) for k, v in problems.items() if v}
        super().__init__(self._render())

    def __reduce__(self):
        return (type(self), (self.headline, self.problems))

    def _render(self) -> str:
        lines = [self.headline]
        for kind, items in self.problems.items():
            lines.append(f"  {kind} ({len(items)}):")
            lines.extend(f"    - {item}" for item in items)
        return "\n".join(lines)


class ProblemList:
    """Collects problems by kind; raises one ConversionError if any were found."""

    def __init__(self) -> None:
        self._problems: dict[str, list[str]] = {}

    def add(self, kind: str, item: str) -> None:
        self._problems.setdefault(kind, []).append(item)

    def __bool__(self) -> bool:
        return any(self._problems.values())

    def raise_if_any(self, headline: str) -> None:
        if self:
            raise ConversionError(headline, self._problems)


class UpdateError(WeightstreamError):
    """A weight update that did not complete: the phase it failed in (``connect``, ``group``,
    ``bucket k``, ``commit``), the engines involved and what happened. Every trainer rank raises it
    alike; the engines keep serving the weights of their last committed update."""

    def __init__(self, phase: str, detail: str, engines: Iterable[str] = ()):
        self.phase, self.detail, self.engines = phase, detail, list(engines)
        where = f" (engine {', '.join(self.engines)})" if self.engines else ""
        super().__init__(f"weight update failed at {phase}{where}: {detail}")

    def __reduce__(self):
        return (type(self), (self.phase, self.detail, self.engines))
