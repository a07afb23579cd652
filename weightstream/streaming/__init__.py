"""Walking local parameters, gathering, planning, packing buckets, and delivering them."""

from weightstream.common.layout import ALIGN
from weightstream.sources.topology import Topology
from weightstream.streaming.bucket import Bucket, Shard, TensorMeta
from weightstream.streaming.plan import BucketPlan, plan_buckets
from weightstream.streaming.stream import BucketStream, StreamStats, stream_hf_weights

__all__ = [
    "ALIGN", "Bucket", "BucketPlan", "BucketStream", "Shard", "StreamStats", "TensorMeta",
    "Topology", "plan_buckets", "stream_hf_weights",
]
