"""What an engine rank holds to take updates: one :class:`Receiver` over its model, made of the session
(:class:`~weightstream.receiver.session.UpdateSession`), the receives over weight-update groups
(:class:`~weightstream.receiver.collective.CollectiveReceiver`) and the colocated ones
(:class:`~weightstream.receiver.ipc.IpcReceiver`). The engine hands it each typed request as it comes, and lends it
what it needs of the engine (:class:`~weightstream.receiver.session.Facilities`)."""

from __future__ import annotations

from typing import Any

from weightstream.receiver.ahead_plans import KeyedReceive
from weightstream.receiver.collective import CollectiveReceiver
from weightstream.receiver.ipc import IpcReceiver
from weightstream.receiver.model import HeldModel
from weightstream.receiver.plan import IpcReceive, Receive, TensorReceive
from weightstream.receiver.session import Facilities, UpdateSession
from weightstream.receiver.transfer import ReceiveBuffers

__all__ = ["Receiver"]


class Receiver:
    """One rank's receiver: ``session``, ``collective`` and ``ipc`` (:meth:`on` makes the usual ones)."""

    def __init__(self, session: UpdateSession, collective: CollectiveReceiver, ipc: IpcReceiver):
        self.session, self.collective, self.ipc = session, collective, ipc

    @classmethod
    def on(cls, model: HeldModel, at: Facilities, max_lent_bytes: int) -> Receiver:
        """The receiver of ``model`` on the rank ``at`` says; a buffer lent by name, and the bytes held for deltas
        in all, at most ``max_lent_bytes``."""
        session = UpdateSession(model, at, max_lent_bytes)
        collective = CollectiveReceiver(session, ReceiveBuffers(at.device))
        return cls(session, collective, IpcReceiver(session, max_lent_bytes))

    def receive(self, r: Receive) -> dict[str, Any] | None:
        """One receive over a weight-update group, by its plan's transport (or, ``prepare``, what comes before it)."""
        if r.prepare:
            return self.collective.prepare(r)
        return self.collective.receive(self._group(r.group_name), r)

    def receive_keyed(self, k: KeyedReceive) -> dict[str, Any]:
        """A broadcast sent ahead (or prepared) whose plan the engine keeps by key; the answer names the keys this
        rank holds after it (:meth:`CollectiveReceiver.receive_keyed`, :meth:`~CollectiveReceiver.prepare_keyed`)."""
        if k.receive.prepare:
            return self.collective.prepare_keyed(k)
        return self.collective.receive_keyed(self._group(k.receive.group_name), k)

    def _group(self, name: str) -> Any:
        groups = self.session.at.groups
        if name not in groups:
            raise RuntimeError(f"no weight-update group {name!r} (call init_weights_update_group first)")
        return groups[name]

    def receive_ipc(self, r: IpcReceive) -> dict[str, Any]:
        return self.ipc.receive(r)

    def receive_tensor(self, r: TensorReceive) -> dict[str, Any]:
        return self.ipc.receive_tensor(r)

    def release(self) -> None:
        """The weights' memory is about to be released: drop what holds views of it (:meth:`forget_weight_views`)
        and the receive buffers."""
        self.forget_weight_views()
        self.collective.buffers.clear()

    def forget_weight_views(self) -> None:
        """Drop what holds views of our weights' storage (the programs, those of the broadcast plans kept, the IPC
        plans' copies, the exports): the storage is about to go away, or has been made anew."""
        self.session.programs.clear()
        self.collective.forget_programs()
        self.ipc.forget_weight_views()

    def stats(self) -> dict[str, Any]:
        """What the receiver holds, for the engine's memory report."""
        session, ipc = self.session, self.ipc
        return {"ipc_buffers_opened": ipc.opened, "ipc_buffers_held": len(ipc.kept),
                "direct_updates": ipc.direct_updates, "checked_writes": ipc.checked_writes,
                "ipc_lease": ipc.lease is not None,
                "programs_kept": len(session.programs), "program_tensors_kept": session.programs.tensors,
                "program_tensors_bound": session.programs.capacity, "ipc_plans_kept": len(ipc.plans),
                "exports_kept": len(ipc.exports), "delta_buckets_held": len(session.deltas),
                **self.collective.stats()}
