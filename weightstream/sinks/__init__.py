"""Sinks deliver buckets: over a broadcast group, point to point per TP rank, by IPC, or to disk."""

from weightstream.sinks.base import Sink
from weightstream.sinks.broadcast import BroadcastSink
from weightstream.sinks.ipc import IPCSink
from weightstream.sinks.p2p import P2PSink
from weightstream.sinks.safetensors import SafetensorsSink

__all__ = ["BroadcastSink", "IPCSink", "P2PSink", "SafetensorsSink", "Sink"]
