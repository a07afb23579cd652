"""``update_weights``: between two rollout rounds, every trainer rank calls it and the engines hold the
new weights. It pauses generation, streams, loads, commits, resumes; chooses the transport (IPC for
colocated engines, point-to-point per TP rank when the engine's layout matches the trainer's,
broadcast otherwise) and says why; tags the update with a version the engine reports back.

:mod:`~weightstream.update.options`: what a :class:`WeightSync` is told (one validated :class:`SyncOptions`);
:mod:`~weightstream.update.transport`: which transport and why; :mod:`~weightstream.update.engine_sessions`: the
engines and their sessions; :mod:`~weightstream.update.sink_set`: the sinks kept; :mod:`~weightstream.update.sync`:
an update from start to report."""

from weightstream.update.options import (
    PAUSE_MODES,
    TRANSPORTS,
    EngineOptions,
    OptionsError,
    PayloadOptions,
    SafetyOptions,
    SyncOptions,
    TransferOptions,
)
from weightstream.update.report import UpdateReport
from weightstream.update.sync import WeightSync, engines_list, log, update_weights
from weightstream.update.transport import Decision, check_formats, choose_transport, reshards

__all__ = [
    "log", "TRANSPORTS", "PAUSE_MODES", "UpdateReport", "Decision", "choose_transport", "reshards", "check_formats",
    "WeightSync", "engines_list", "update_weights", "SyncOptions", "EngineOptions", "TransferOptions",
    "PayloadOptions", "SafetyOptions", "OptionsError",
]
