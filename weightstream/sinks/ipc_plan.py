"""What an :class:`~weightstream.sinks.ipc.IPCSink` does in one update, decided once: :func:`plan_ipc` reads the
sink's options, what the engine offers and what the stream is, and returns an :class:`IPCPlan`, which the sink
then runs. Plain data, no torch: every combination is checked without a process or a device.

The routes (the module doc of :mod:`weightstream.sinks.ipc` tells each at length):

- ``PER_BUCKET``: every rank's handle is gathered on trainer rank 0, which posts them, one request per bucket
  (an engine that does not declare ``ipc_ahead``, or a sync that sends no metadata ahead, or an empty stream; a
  delta-mode update where the engine takes deltas so, ``ipc_delta``, and not ahead);
- ``AHEAD``: the metadata of every bucket goes in one request; per bucket one frame on the control channel
  of each colocated rank names a lent buffer;
- ``DIRECT``: ahead, and the trainer writes every tensor straight into the engine's weights, which the
  engine offered on the control channel (:meth:`IPCPlan.offered`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

__all__ = ["Route", "Purpose", "IPCOptions", "EngineOffer", "StreamShape", "IPCPlan", "plan_ipc"]


class Route(Enum):
    """How an update's bytes reach the engine."""

    PER_BUCKET = "per_bucket"  # one request per bucket, every rank's handle gathered on rank 0
    AHEAD = "ahead"  # the metadata ahead; per bucket a frame on the control channel naming a lent buffer
    DIRECT = "direct"  # ahead; the stream writes into the engine's weights (no buffer lent)


class Purpose(Enum):
    """What the sink is asked to do."""

    UPDATE = "update"  # an update (``open`` .. ``close``)
    PREPARE = "prepare"  # before the first update: the engine learns the layout and maps the kept buffers


@dataclass(frozen=True, slots=True)
class IPCOptions:
    """The sink's options: ``ahead`` uses the engine's ``ipc_ahead`` where it has it; ``direct`` writes into the
    engine's weights where it offers them; ``checksums`` checks each lent buffer (no direct writes then: no
    transport copy is left to check)."""

    ahead: bool = True
    direct: bool = True
    checksums: bool = False


@dataclass(frozen=True, slots=True)
class EngineOffer:
    """What the engine offers, as trainer rank 0 asked it and told every rank: its TP size (engine rank r is
    colocated with trainer rank r), whether it takes control channels (declares ``ipc_ahead``), whether it takes
    delta buckets on them (``deltas_ahead``: declares ``delta``) and whether it takes them one request per bucket
    (``deltas_per_bucket``: declares ``ipc_delta``)."""

    url: str
    tp_size: int = 1
    keeps_channels: bool = False
    deltas_ahead: bool = False
    deltas_per_bucket: bool = False


@dataclass(frozen=True, slots=True)
class StreamShape:
    """What the planning reads of the stream: ``full`` (whole tensors on every rank), its ``buckets``, whether it
    is on the CPU, whether this rank makes every tensor itself (``writable``: it can write into the engine's
    weights), whether it packs into two buffers kept with the plan (``reuses_buffers``), and whether its
    buckets go as deltas of the snapshot (``deltas``)."""

    full: bool = True
    buckets: int = 1
    on_cpu: bool = False
    writable: bool = False
    reuses_buffers: bool = False
    deltas: bool = False


@dataclass(frozen=True, slots=True)
class IPCPlan:
    """One update (or preparation) of an IPC sink on one trainer rank, and what it keeps for the next.

    What is written where: ``route``; ``sends``, this rank has an engine rank (rank < ``engine_tp``) and
    lends it buffers or writes into its weights (on ``AHEAD`` the others send nothing; on ``PER_BUCKET``
    every rank joins the gather); ``takes_offer``, this rank takes the engine's offer of its weights to
    write into where it comes (``AHEAD`` becomes ``DIRECT``); ``deltas``, each bucket goes as the snapshot
    encodes it. Who announces: ``announce``, on ``PER_BUCKET`` on the CPU to an engine that takes control
    channels, every colocated rank opens one before the first payload (the engine learns which process
    made the shared memory the payloads name). ``prepares``: a preparation that runs (the engine learns the
    layout, and maps the kept buffers or exports its weights). What is kept between updates:
    ``keeps_channels``, the last control channel stays open as this rank's lease; ``announced``, the
    colocated ranks' leases are open (no announcing again); ``engine_holds``, the engine may keep buffers
    of this trainer mapped (trainer rank 0 asks it to let go at disconnect)."""

    purpose: Purpose = Purpose.UPDATE
    route: Route = Route.PER_BUCKET
    engine_tp: int = 1
    sends: bool = True
    takes_offer: bool = False
    deltas: bool = False
    announce: bool = False
    prepares: bool = False
    keeps_channels: bool = False
    announced: bool = False
    engine_holds: bool = False

    @property
    def metadata_ahead(self) -> bool:
        """Every bucket's metadata goes in one request, ahead; then one frame per bucket on a control channel."""
        return self.route is not Route.PER_BUCKET

    @property
    def writes(self) -> bool:
        """This update writes straight into the engine's weights (one copy); a preparation writes nothing."""
        return self.route is Route.DIRECT and self.purpose is Purpose.UPDATE

    def offered(self, direct: bool) -> IPCPlan:
        """The plan once the engine answered the control channel: ``direct``, it offers its weights to write
        into; taken where :attr:`takes_offer`."""
        if not (direct and self.takes_offer and self.route is Route.AHEAD):
            return self
        return replace(self, route=Route.DIRECT)

    def released(self) -> IPCPlan:
        """The plan once the sink let go of the engine (after a failure, or for good): nothing is written any
        more, no lease is open, the engine holds nothing of this trainer's."""
        route = Route.AHEAD if self.route is Route.DIRECT else self.route
        return replace(self, route=route, announce=False, announced=False, engine_holds=False)


def plan_ipc(options: IPCOptions, engine: EngineOffer, stream: StreamShape, *, rank: int, world: int,
             purpose: Purpose = Purpose.UPDATE, before: IPCPlan | None = None) -> IPCPlan:
    """The plan of trainer rank ``rank`` of ``world``, after ``before`` (the last update's plan; None: the sink
    holds nothing of the engine's). Raises one ``ValueError`` naming every problem: a stream that is not full,
    an engine of more TP ranks than the job has, a delta-mode update that can go neither ahead nor per bucket."""
    kept = before or IPCPlan()
    some = stream.buckets > 0
    ahead = _goes_ahead(options, engine, stream)
    problems = _problems(options, engine, stream, world, ahead)
    if problems:
        raise ValueError("; ".join(problems))
    announce = (engine.keeps_channels and not ahead and stream.on_cpu and some and purpose is Purpose.UPDATE
                and not kept.announced)
    return IPCPlan(
        purpose=purpose,
        route=Route.AHEAD if ahead else Route.PER_BUCKET,
        engine_tp=engine.tp_size,
        sends=rank < engine.tp_size,
        takes_offer=ahead and options.direct and not options.checksums and not stream.deltas and stream.writable,
        deltas=stream.deltas,
        announce=announce,
        prepares=purpose is Purpose.PREPARE and ahead and (stream.writable or stream.reuses_buffers),
        keeps_channels=engine.keeps_channels,
        announced=kept.announced or announce,
        engine_holds=kept.engine_holds or ahead or announce,
    )


def _goes_ahead(options: IPCOptions, engine: EngineOffer, stream: StreamShape) -> bool:
    """Whether the update goes ahead: where the engine takes control channels and the sync sends the metadata ahead,
    unless its deltas go one request per bucket (the engine takes them so, and not ahead)."""
    ahead = options.ahead and engine.keeps_channels and stream.buckets > 0
    if stream.deltas and ahead and not engine.deltas_ahead and engine.deltas_per_bucket:
        return False
    return ahead


def _problems(options: IPCOptions, engine: EngineOffer, stream: StreamShape, world: int, ahead: bool) -> list[str]:
    problems = []
    if not stream.full:
        problems.append("IPCSink sends whole tensors: it needs a full stream")
    if engine.tp_size > world:
        problems.append(f"engine TP {engine.tp_size} needs as many colocated trainer ranks; the job has {world}")
    carried = engine.deltas_ahead if ahead else engine.deltas_per_bucket
    if stream.deltas and stream.buckets > 0 and not carried:
        takes_ahead = engine.keeps_channels and engine.deltas_ahead
        problems.append(f"a delta update over IPC goes ahead or one request per bucket: the engine at {engine.url} "
                        f"must declare delta and ipc_ahead{'' if takes_ahead else ' (it does not)'} with the sync "
                        f"sending the metadata ahead{'' if options.ahead else ' (metadata_ahead=False)'}, or "
                        "ipc_delta (it does not)")
    return problems
