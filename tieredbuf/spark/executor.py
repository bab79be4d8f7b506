"""Executor side of the ``tieredbuf`` source: partitions, and reading them.

A partition carries everything a task needs -- its objects' keys and manifest
metadata, and for batch time windows the per-record time range -- so executors
never read the manifest; they GET data objects straight from the store (no data
passes through the driver).  Each task is shipped only its own partition.

Every object is checked against what the manifest recorded before a row of it goes to
Spark (``Buffer.read_object``: the recorded size, a ``.qseg`` object's CRC; a zstd
``.batch`` block's checksum when it is decoded): a damaged one is a ``CorruptError``.

``failOnDataLoss=false`` is honoured here too: an object that is missing from the
store when the task reads it (deleted by hand, or by GC after a grace-period
violation), or that fails those checks (replaced, cut, changed), is skipped and logged
on the executor instead of failing the query; none of its rows is returned.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import InputPartition
from pyspark.sql.types import StructType

import tieredbuf
from tieredbuf import keys
from tieredbuf.errors import CorruptError, DataLossError, ObjectNotFoundError
from tieredbuf.format.manifest import ManifestEntry
from tieredbuf.format.segment import StreamInfo
from tieredbuf.format.segment_tail import decode_stream
from tieredbuf.spark import arrow as ta
from tieredbuf.spark import options as opt

log = logging.getLogger(__name__)

_buffers: dict[tuple[str, tuple[tuple[str, Any], ...]], tieredbuf.Buffer] = {}
_buffers_lock = threading.Lock()


def shared_buffer(url: str, store: tuple[tuple[str, Any], ...]) -> tieredbuf.Buffer:
    """One Buffer per (URL, options) per Python worker (workers are reused by tasks);
    its node cache then serves consecutive micro-batches of a streaming query."""
    key = (url, store)
    with _buffers_lock:
        buf = _buffers.get(key)
        if buf is None:
            buf = _buffers[key] = tieredbuf.open(url, **dict(store))
        return buf


def arrow_schema(schema: StructType) -> pa.Schema:
    from pyspark.sql.pandas.types import to_arrow_schema

    result: pa.Schema = to_arrow_schema(schema, timezone="UTC")
    return result


@dataclass(frozen=True, slots=True)
class StreamSlice:
    """One stream of a ``.qseg`` object: the bundle index and the bundle's ingestion
    time (ms) of each of its chunks."""

    stream: StreamInfo
    bundles: tuple[int, ...]
    times_ms: tuple[int, ...] = ()


class ObjectPartition(InputPartition):
    """Consecutive data objects (and, for batch time windows, the per-record time
    window ``[ts_from_ms, ts_to_ms)``); or, with ``streams``, only those streams of one
    large ``.qseg`` object (ranged GETs)."""

    def __init__(
        self,
        refs: Sequence[ta.ObjectRef],
        ts_from_ms: int | None = None,
        ts_to_ms: int | None = None,
        streams: tuple[StreamSlice, ...] | None = None,
    ) -> None:
        if not refs or (streams is not None and len(refs) != 1):
            raise ValueError("a partition holds objects, or streams of exactly one object")
        first = refs[0].sequence
        super().__init__(first if streams is None else (first, streams[0].stream.stream_id))
        self.refs = tuple(refs)
        self.ts_from_ms = ts_from_ms
        self.ts_to_ms = ts_to_ms
        self.streams = streams

    @property
    def ref(self) -> ta.ObjectRef:
        """The first (for a stream partition, the only) object."""
        return self.refs[0]


def _damaged(ref: ta.ObjectRef, ro: opt.ReadOptions, cause: CorruptError) -> None:
    """A data object failed its checks: fail (the default) or, with failOnDataLoss=false,
    skip it whole and log it."""
    if ro.fail_on_data_loss:
        raise cause
    log.warning(
        "tieredbuf: skipping data object %s of sequence %d: %s (failOnDataLoss=false)",
        ref.location,
        ref.sequence,
        cause,
    )


def _lost(ref: ta.ObjectRef, ro: opt.ReadOptions, cause: Exception) -> None:
    """A data object is gone: fail (the default) or, with failOnDataLoss=false, log it."""
    if ro.fail_on_data_loss:
        if isinstance(cause, DataLossError):
            raise cause
        raise DataLossError(
            f"data object {ref.location} of sequence {ref.sequence} is missing from the "
            "store (deleted by hand, or by GC after a grace-period violation); "
            "failOnDataLoss=false skips it"
        ) from cause
    log.warning(
        "tieredbuf: skipping data object %s of sequence %d: missing from the store "
        "(failOnDataLoss=false)",
        ref.location,
        ref.sequence,
    )


def read_partition(
    ro: opt.ReadOptions, schema: pa.Schema, part: ObjectPartition
) -> Iterator[pa.RecordBatch]:
    """GET each object, decode it, yield Arrow batches in ``schema``.

    The next object is fetched and decoded on a helper thread (one object ahead)
    while the current one's batches go to Spark, so the store's latency and the
    decoding overlap with Spark's work; at most two objects are held at a time."""
    buf = shared_buffer(ro.url, ro.store)
    if part.streams is not None:
        yield from _read_streams(buf, ro, schema, part)
        return
    suffix = keys.BATCH_SUFFIX if ro.slot is None else keys.SEGMENT_SUFFIX
    refs = [r for r in part.refs if r.location.endswith(suffix)]
    if not refs:
        return
    lo, hi = part.ts_from_ms, part.ts_to_ms

    def fetch(ref: ta.ObjectRef) -> list[pa.RecordBatch]:
        entry = ManifestEntry(ref.sequence, ref.location, ref.metadata)
        try:
            data = buf.read_object(entry, ref.size)
            if ro.slot is not None:
                return list(ta.bundle_batches(data, ref, ro.slot, schema, lo, hi))
            return list(ta.records_batches(data, ref, schema, lo, hi))
        except DataLossError as e:
            _lost(ref, ro, e)
        except CorruptError as e:  # the whole object is decoded before a row is yielded
            _damaged(ref, ro, e)
        return []

    with ThreadPoolExecutor(1, thread_name_prefix="tieredbuf-prefetch") as pool:
        ahead = pool.submit(fetch, refs[0])
        try:
            for i in range(len(refs)):
                batches = ahead.result()
                if i + 1 < len(refs):
                    ahead = pool.submit(fetch, refs[i + 1])
                yield from batches
                del batches
        finally:
            ahead.cancel()


def _read_streams(
    buf: tieredbuf.Buffer,
    ro: opt.ReadOptions,
    schema: pa.Schema,
    part: ObjectPartition,
) -> Iterator[pa.RecordBatch]:
    """GET each stream's byte range only, decode it, yield its rows."""
    ref = part.ref
    for sl in part.streams or ():
        s = sl.stream
        try:
            data = buf.store.get_range(ref.location, s.byte_offset, s.byte_offset + s.byte_length)
        except ObjectNotFoundError as e:
            _lost(ref, ro, e)
            return
        chunks = decode_stream(data, s, ref.location)
        yield from ta.stream_bundle_batches(
            chunks, sl.bundles, ref, schema, sl.times_ms, part.ts_from_ms, part.ts_to_ms
        )
