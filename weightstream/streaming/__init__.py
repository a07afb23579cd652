"""Walking local parameters, gathering, planning, packing buckets, and delivering them."""

from weightstream.streaming.bucket import Bucket, Shard, TensorMeta
from weightstream.streaming.checkpoint import CheckpointReport, save_hf_checkpoint
from weightstream.streaming.plan import ALIGN, BucketPlan, plan_buckets
from weightstream.streaming.stream import BucketStream, StreamStats, stream_hf_weights
from weightstream.streaming.topology import Topology

__all__ = [
    "ALIGN", "Bucket", "BucketPlan", "BucketStream", "CheckpointReport", "Shard", "StreamStats", "TensorMeta",
    "Topology", "plan_buckets", "save_hf_checkpoint", "stream_hf_weights",
]
