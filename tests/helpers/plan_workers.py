"""The reference engine whose ranks keep each their own number of broadcast plans (the engine's server keeps
:data:`~weightstream.receiver.ahead_plans.KEPT_AHEAD_PLANS`): a rank that keeps fewer drops a plan the server still
holds, and must be sent its buckets again. Each worker is the engine's own (its real update session and receives),
and also answers :class:`~tests.helpers.faults.HeldWeights`."""

from __future__ import annotations

from functools import partial

from tests.helpers.faults import FaultyWorker, HeldWeights
from weightstream.receiver.collective import CollectiveReceiver
from weightstream.receiver.ipc import IpcReceiver
from weightstream.receiver.receiver import Receiver
from weightstream.receiver.session import Facilities, UpdateSession
from weightstream.receiver.transfer import ReceiveBuffers
from weightstream.reference_engine.server import EngineServer, serve
from weightstream.reference_engine.worker import Worker, worker_main


class PlansWorker(Worker):
    """A worker whose collective receiver keeps ``kept_plans[rank]`` broadcast plans (set in its process before the
    worker is made)."""

    kept_plans: tuple[int, ...] = ()
    held_weights = FaultyWorker.held_weights

    def make_receiver(self, at: Facilities, max_lent_bytes: int) -> Receiver:
        session = UpdateSession(self.model, at, max_lent_bytes)
        collective = CollectiveReceiver(session, ReceiveBuffers(at.device), self.kept_plans[self.rank])
        return Receiver(session, collective, IpcReceiver(session, max_lent_bytes))

    def handlers(self):
        return {**super().handlers(), HeldWeights: lambda _: self.held_weights()}


def plans_worker_main(kept_plans: tuple[int, ...], *args) -> None:
    PlansWorker.kept_plans = kept_plans
    worker_main(*args, worker_type=PlansWorker)


def serve_keeping(model_dir: str, kept_plans: tuple[int, ...], **kwargs) -> EngineServer:
    """A bf16 engine of one rank per entry of ``kept_plans``, each keeping that many broadcast plans."""
    return serve(model_dir, len(kept_plans), dtype="bfloat16", worker=partial(plans_worker_main, kept_plans), **kwargs)
