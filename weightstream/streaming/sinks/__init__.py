"""Sinks deliver buckets: over a broadcast group, point to point per TP rank, by IPC, or to disk."""

from weightstream.streaming.checkpoint import SafetensorsSink
from weightstream.streaming.sinks.base import Sink
from weightstream.streaming.sinks.broadcast import BroadcastSink
from weightstream.streaming.sinks.ipc import IPCSink
from weightstream.streaming.sinks.p2p import P2PSink

__all__ = ["BroadcastSink", "IPCSink", "P2PSink", "SafetensorsSink", "Sink"]
