"""Batch and streaming readers of the ``tieredbuf`` source.

The driver reads the manifest and packs consecutive data objects into partitions
(Spark's small-file rule: up to ``maxPartitionBytes``, spread over at least
``minPartitions``); each partition carries its objects' keys and metadata, and
executors GET the objects straight from the store (no data passes through the
driver).

Streaming offsets are ``{"sequence": next}``.  With the ``consumer`` option the
query is the queue's fenced consumer: it bumps the epoch when it starts (fencing
any older consumer, e.g. an older run of a query with the same name) and
``commit(end)`` dequeues through ``end - 1``.  Spark calls ``commit(end)`` only
after the micro-batch ending at ``end`` is in the commit log -- in fact one
micro-batch late (when it plans the next one) -- so nothing is dequeued while
Spark may still need it; GC deletes a dequeued object only past its grace period.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxBytes,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType
from ulid import ULID

import tieredbuf
from tieredbuf import keys
from tieredbuf.errors import DataLossError, FencedError, ObjectNotFoundError
from tieredbuf.format.manifest import ManifestEntry
from tieredbuf.format.segment import StreamInfo
from tieredbuf.format.segment_tail import bundles_by_stream, decode_stream
from tieredbuf.spark import arrow as ta
from tieredbuf.spark import options as opt
from tieredbuf.spark.bundles import segment_tail
from tieredbuf.store.base import Store

log = logging.getLogger(__name__)

_buffers: dict[tuple[str, tuple[tuple[str, Any], ...]], tieredbuf.Buffer] = {}
_buffers_lock = threading.Lock()
_PLAN_THREADS = 16


def shared_buffer(url: str, store: tuple[tuple[str, Any], ...]) -> tieredbuf.Buffer:
    """One Buffer per (URL, options) per Python worker (workers are reused by tasks)."""
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
    """One stream of a ``.qseg`` object and the bundle index of each of its chunks."""

    stream: StreamInfo
    bundles: tuple[int, ...]


class ObjectPartition(InputPartition):
    """Consecutive data objects (and, for time-bounded reads, the per-record time
    window); or, with ``streams``, only those streams of one large ``.qseg`` object
    (ranged GETs)."""

    def __init__(
        self, refs: Sequence[ta.ObjectRef], ts_from_ms: int | None = None,
        ts_to_ms: int | None = None, streams: tuple[StreamSlice, ...] | None = None,
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


def read_partition(
    ro: opt.ReadOptions, schema: pa.Schema, part: ObjectPartition
) -> Iterator[pa.RecordBatch]:
    """Executor side: GET each object, decode it, yield Arrow batches in ``schema``.

    The next object is fetched and decoded on a helper thread (one object ahead)
    while the current one's batches go to Spark, so the store's latency and the
    decoding overlap with Spark's work; at most two objects are held at a time."""
    buf = shared_buffer(ro.url, ro.store)
    if part.streams is not None:
        yield from _read_streams(buf, schema, part.ref, part.streams)
        return
    suffix = keys.BATCH_SUFFIX if ro.slot is None else keys.SEGMENT_SUFFIX
    refs = [r for r in part.refs if r.location.endswith(suffix)]
    if not refs:
        return

    def fetch(ref: ta.ObjectRef) -> list[pa.RecordBatch]:
        data = buf.read_object(ManifestEntry(ref.sequence, ref.location, ref.metadata))
        if ro.slot is not None:
            return list(ta.bundle_batches(data, ref, ro.slot, schema))
        return list(ta.records_batches(data, ref, schema, part.ts_from_ms, part.ts_to_ms))

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
    buf: tieredbuf.Buffer, schema: pa.Schema, ref: ta.ObjectRef,
    streams: tuple[StreamSlice, ...],
) -> Iterator[pa.RecordBatch]:
    """GET each stream's byte range only, decode it, yield its rows."""
    for sl in streams:
        s = sl.stream
        try:
            data = buf.store.get_range(ref.location, s.byte_offset, s.byte_offset + s.byte_length)
        except ObjectNotFoundError as e:
            raise DataLossError(
                f"data object {ref.location} of sequence {ref.sequence} is missing from the "
                "store (deleted by hand, or by GC after a grace-period violation)"
            ) from e
        chunks = decode_stream(data, s, ref.location)
        yield from ta.stream_bundle_batches(chunks, sl.bundles, ref, schema)


def split_streams(store: Store, e: ManifestEntry, ro: opt.ReadOptions
                  ) -> list[tuple[StreamSlice, ...]] | None:
    """The stream groups a large ``.qseg`` object is read in (None: read it whole).

    Splits only bundle reads of objects over ``splitStreamsBytes`` with at least two
    streams of the slot; consecutive streams are grouped up to that many bytes."""
    limit = ro.split_streams_bytes
    if ro.slot is None or limit <= 0 or not e.location.endswith(keys.SEGMENT_SUFFIX):
        return None
    try:
        tail = segment_tail(store, e.location)
    except ObjectNotFoundError:
        return None  # read whole: the executor reports the data loss as it always has
    mine = [s for s in tail.streams if s.slot_id == ro.slot]
    if tail.size <= limit or len(mine) < 2:
        return None
    groups: list[list[StreamInfo]] = [[]]
    size = 0
    for s in mine:
        if groups[-1] and size + s.byte_length > limit:
            groups.append([])
            size = 0
        groups[-1].append(s)
        size += s.byte_length
    if len(groups) < 2:
        return None
    of = bundles_by_stream(tail, e.location)
    return [tuple(StreamSlice(s, of[s.stream_id]) for s in g) for g in groups]


def object_partitions(
    store: Store, entries: Sequence[ManifestEntry], ro: opt.ReadOptions,
    sizes: Mapping[int, int] | None = None,
) -> list[ObjectPartition]:
    """Consecutive objects packed into partitions (:func:`options.pack`), a large
    ``.qseg`` one split by stream instead (its tail is read on the driver, in
    parallel: at most two suffix GETs per object).  ``sizes`` maps sequences to object
    sizes (the manifest's stats); a size missing there is read with a HEAD."""
    for e in entries:
        opt.check_long(e.sequence)
    if ro.slot is not None and ro.split_streams_bytes > 0 and len(entries) > 1:
        with ThreadPoolExecutor(min(_PLAN_THREADS, len(entries))) as pool:
            splits = list(pool.map(lambda e: split_streams(store, e, ro), entries))
    else:
        splits = [split_streams(store, e, ro) for e in entries]
    out = []
    whole: list[ManifestEntry] = []
    for e, groups in zip(entries, splits, strict=True):
        if groups is None:
            whole.append(e)
            continue
        ref = ta.ObjectRef(e.sequence, e.location, e.metadata)
        out += [ObjectPartition([ref], ro.starting_ts, ro.ending_ts, g) for g in groups]
    if whole:
        lengths = _sizes(store, whole, sizes or {}, ro)
        refs = [ta.ObjectRef(e.sequence, e.location, e.metadata) for e in whole]
        out += [ObjectPartition(refs[r.start : r.stop], ro.starting_ts, ro.ending_ts)
                for r in opt.pack(lengths, ro.max_partition_bytes, ro.min_partitions)]
    out.sort(key=lambda p: (p.ref.sequence, p.streams is not None))
    return out


def _sizes(store: Store, entries: Sequence[ManifestEntry], known: Mapping[int, int],
           ro: opt.ReadOptions) -> list[int]:
    """Object sizes for packing (HEADs, in parallel, for those the manifest lacks)."""
    if ro.max_partition_bytes <= 0 or len(entries) < 2:
        return [0] * len(entries)

    def size(e: ManifestEntry) -> int:
        n = known.get(e.sequence, 0)
        if n > 0:
            return n
        try:
            return store.head(e.location).size
        except ObjectNotFoundError:
            return 0  # the executor reports the loss when it reads the object

    missing = sum(1 for e in entries if known.get(e.sequence, 0) <= 0)
    if missing < 2:
        return [size(e) for e in entries]
    with ThreadPoolExecutor(min(_PLAN_THREADS, missing)) as pool:
        return list(pool.map(size, entries))


def plan(
    entries: Sequence[ManifestEntry], start: int, end: int, ro: opt.ReadOptions,
    sizes: Mapping[int, int] | None = None,
) -> list[ObjectPartition]:
    """Partitions of the objects with ``start <= sequence < end``
    (:func:`object_partitions`)."""
    store = shared_buffer(ro.url, ro.store).store
    return object_partitions(
        store, [e for e in entries if start <= e.sequence < end], ro, sizes
    )


def batch_range(
    ro: opt.ReadOptions, entries: Sequence[ManifestEntry], first: int, nxt: int
) -> tuple[int, int]:
    start = opt.resolve_start(ro.starting, ro.starting_ts, entries, first, nxt, default="earliest")
    end = opt.resolve_end(ro.ending, ro.ending_ts, entries, nxt)
    start = opt.check_data_loss(start, first, ro.fail_on_data_loss)
    return start, max(start, end)


class BatchReader(DataSourceReader):
    """``spark.read.format("tieredbuf")``: planned once, from one manifest snapshot."""

    def __init__(self, ro: opt.ReadOptions, schema: StructType) -> None:
        self.ro = ro
        self.schema = schema
        buf = shared_buffer(ro.url, ro.store)
        snap = buf.snapshot()
        sized = snap.sized_entries()
        entries = [e for e, _ in sized]
        start, end = batch_range(ro, entries, snap.footer.first_sequence,
                                 snap.footer.next_sequence)
        self.start, self.end = start, end
        self._parts = plan(entries, start, end, ro, {e.sequence: n for e, n in sized})

    def partitions(self) -> Sequence[InputPartition]:
        return list(self._parts)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if not isinstance(partition, ObjectPartition):
            return iter(())  # Spark's stand-in InputPartition(None) for an empty plan
        return read_partition(self.ro, arrow_schema(self.schema), partition)


def _seq(offset: dict[str, Any]) -> int:
    return int(offset["sequence"])


class StreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """``spark.readStream.format("tieredbuf")``.

    Spark also builds (and pickles to executors) a copy of this reader only to call
    :meth:`read`; so nothing happens in ``__init__``: the buffer is opened and the
    consumer initialized on first use by the driver's offset calls.
    """

    def __init__(self, ro: opt.ReadOptions, schema: StructType) -> None:
        self.ro = ro
        self.schema = schema
        self._epoch: int | None = None
        self._target: int | None = None
        self._sizes: dict[int, int] = {}
        self._entries: dict[int, ManifestEntry] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"ro": self.ro, "schema": self.schema}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["ro"], state["schema"])  # type: ignore[misc]

    # --- driver side -----------------------------------------------------------------

    def _buf(self) -> tieredbuf.Buffer:
        return shared_buffer(self.ro.url, self.ro.store)

    def _start_consumer(self) -> None:
        """Bump the epoch once per query run (fences every older consumer, I4)."""
        if self.ro.consumer is not None and self._epoch is None:
            owner = f"spark:{self.ro.consumer}/{ULID()}"
            self._epoch = self._buf().queue.initialize(owner)
            log.info("tieredbuf consumer %r initialized at epoch %d", owner, self._epoch)

    def _snapshot(self) -> tuple[int, int]:
        """Read the manifest: (first, next); checks the epoch when we are the consumer."""
        self._start_consumer()
        snap = self._buf().snapshot()
        if self._epoch is not None and snap.footer.epoch != self._epoch:
            raise FencedError(self._epoch, snap.footer.epoch)
        self._entries = {}
        for e, size in snap.sized_entries():
            self._entries[e.sequence] = e
            if size > 0:
                self._sizes[e.sequence] = size
        return snap.footer.first_sequence, snap.footer.next_sequence

    def initialOffset(self) -> dict[str, Any]:
        first, nxt = self._snapshot()
        entries = [self._entries[s] for s in sorted(self._entries)]
        start = opt.resolve_start(
            self.ro.starting, self.ro.starting_ts, entries, first, nxt, default="earliest"
        )
        return {"sequence": opt.check_data_loss(start, first, self.ro.fail_on_data_loss)}

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._snapshot()[1]

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.ro.max_offsets is not None:
            return ReadMaxRows(self.ro.max_offsets)
        if self.ro.max_bytes is not None:
            return ReadMaxBytes(self.ro.max_bytes)
        return ReadAllAvailable()

    def _size(self, seq: int) -> int:
        size = self._sizes.get(seq)
        if size is None:
            e = self._entries[seq]
            size = self._sizes[seq] = self._buf().store.head(e.location).size
        return size

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        first, nxt = self._snapshot()
        s = _seq(start)
        if s < first:
            s = opt.check_data_loss(s, first, self.ro.fail_on_data_loss)
        end = nxt if self._target is None else min(nxt, self._target)
        end = max(end, _seq(start))
        if isinstance(limit, ReadAllAvailable):
            return {"sequence": end}
        max_offsets = self.ro.max_offsets
        max_bytes = self.ro.max_bytes
        if isinstance(limit, ReadMaxRows):
            max_offsets = limit.max_rows
        elif isinstance(limit, ReadMaxBytes):
            max_bytes = limit.max_bytes
        admitted = opt.admit(s, end, max_offsets, max_bytes, self._size)
        for k in [k for k in self._sizes if k < s]:
            del self._sizes[k]
        return {"sequence": max(admitted, _seq(start))}

    def reportLatestOffset(self) -> dict[str, Any] | None:
        return {"sequence": self._buf().queue.read_footer().next_sequence}

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        s, e = _seq(start), _seq(end)
        if e <= s:
            return []
        if any(q not in self._entries for q in range(s, e)):
            self._snapshot()
        missing = [q for q in range(s, e) if q not in self._entries]
        if missing:
            if self.ro.fail_on_data_loss:
                raise DataLossError(
                    f"sequences {missing[0]}..{missing[-1]} of this micro-batch are no longer "
                    "in the queue (dequeued by another consumer?); failOnDataLoss=false skips"
                )
            log.warning("skipping %d sequences no longer in the queue", len(missing))
        entries = [self._entries[q] for q in range(s, e) if q in self._entries]
        return object_partitions(self._buf().store, entries, self.ro, self._sizes)

    def commit(self, end: dict[str, Any]) -> None:
        """Spark is done with everything before ``end``: ack and dequeue it (fenced)."""
        through = _seq(end) - 1
        for k in [k for k in self._entries if k <= through]:
            del self._entries[k]
        if self.ro.consumer is None or through < 0:
            return
        self._start_consumer()
        assert self._epoch is not None
        self._buf().queue.dequeue(through, self._epoch)

    def stop(self) -> None:
        pass

    # --- executor side -----------------------------------------------------------------

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if not isinstance(partition, ObjectPartition):
            return iter(())  # Spark's stand-in InputPartition(None) for an empty plan
        return read_partition(self.ro, arrow_schema(self.schema), partition)
