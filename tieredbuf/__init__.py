"""tieredbuf: an object-store tiered buffer for Python.

buf = tieredbuf.open("file:///tmp/buf")          # or s3://bucket/prefix, memory://
producer = buf.producer()                        # stateless; staging_dir=... for the local tier
producer.produce([b"a", b"b"], metadata=b"m").wait(tieredbuf.Durability.REMOTE)
consumer = buf.consumer(); consumer.initialize()
batch = consumer.next_batch(); consumer.ack(batch.sequence); consumer.flush()
etl = buf.consumer(subscriber="etl")             # a named subscriber: own position and epoch
w = buf.worker("jobs"); b = w.claim(); w.ack(b.sequence)   # a shared work queue
svc = tieredbuf.service_producer("http://host1:8080,host2:8080")  # through `tieredbuf serve`
"""

from __future__ import annotations

from tieredbuf import errors
from tieredbuf.buffer import Buffer, open, service_producer
from tieredbuf.client.producer import ServiceProducer
from tieredbuf.config import (
    Compression,
    ConsumerConfig,
    GcConfig,
    ProducerConfig,
    RetryConfig,
    ServiceProducerConfig,
    TreeConfig,
    WorkerConfig,
)
from tieredbuf.consume.consumer import ConsumedBatch, Consumer
from tieredbuf.errors import (
    AckOrderError,
    BufferNotFoundError,
    ConflictError,
    CorruptError,
    DataLossError,
    FencedError,
    LeaseExpiredError,
    OutcomeUnknownError,
    ServiceError,
    ServiceRefusedError,
    ServiceUnavailableError,
    SubscriberRemovedError,
    TieredBufError,
)
from tieredbuf.format.manifest import MetadataItem, RetentionPolicy
from tieredbuf.ops import gc
from tieredbuf.produce.handles import Durability, DurabilityWatcher, WriteHandle, WriteOutcome

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """``tieredbuf.metrics`` (:mod:`tieredbuf.ops.metrics`), imported on first use: it
    brings in prometheus_client, which a producer or consumer never needs."""
    if name == "metrics":
        from tieredbuf.ops import metrics

        return metrics
    raise AttributeError(f"module 'tieredbuf' has no attribute {name!r}")


__all__ = [
    "AckOrderError",
    "Buffer",
    "BufferNotFoundError",
    "Compression",
    "ConflictError",
    "ConsumedBatch",
    "Consumer",
    "ConsumerConfig",
    "CorruptError",
    "DataLossError",
    "Durability",
    "DurabilityWatcher",
    "FencedError",
    "GcConfig",
    "LeaseExpiredError",
    "MetadataItem",
    "OutcomeUnknownError",
    "ProducerConfig",
    "RetentionPolicy",
    "RetryConfig",
    "ServiceError",
    "ServiceProducer",
    "ServiceProducerConfig",
    "ServiceRefusedError",
    "ServiceUnavailableError",
    "SubscriberRemovedError",
    "TieredBufError",
    "TreeConfig",
    "WorkerConfig",
    "WriteHandle",
    "WriteOutcome",
    "errors",
    "gc",
    "open",
    "service_producer",
]
