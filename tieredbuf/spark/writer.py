"""The ``tieredbuf`` sink: tasks upload data objects, the driver appends them once.

* Tasks encode their rows -- a ``value`` column (binary or string) as RFC 0001
  records (``.batch``), any other schema as Arrow bundles (``.qseg``, one bundle
  per Arrow batch Spark hands over, in slot ``slot``) -- and PUT each object under
  a fresh ULID key with create-if-absent.  Nothing is visible yet.
* The driver's ``commit`` appends every object of the job (or micro-batch) to the
  manifest in one CAS: the output appears atomically, and exactly once.
  - With ``producerId`` the append is tagged ``(producerId, version)`` -- the
    micro-batch id when streaming, ``batchVersion`` for a batch write (Delta's
    ``txnAppId`` / ``txnVersion``) -- and recorded in the producer's watermark.  A
    commit whose tag is exactly the recorded one already landed (Spark re-running a
    micro-batch after a restart, a retried job) and appends nothing; a tag below the
    recorded one (or inside it) is a *different* writer using the same producerId (a
    new checkpoint, a second query): the commit fails naming the option, never
    skipping data as if it had landed (ProducerIdReusedError).
  - Without it (a batch job) nothing is recorded in the manifest; the commit's own
    retries after a lost response recognise their landing by the objects' keys
    (``ManifestQueue.append_once``).  A re-run job appends again: at-least-once.
* An aborted job deletes the objects it uploaded (unless its commit got them into the
  queue: then they stay): a failing task deletes its own, the driver's ``abort`` those
  of the tasks that reported.  A task still running when the job is aborted can finish
  its upload after the driver's ``abort``; nothing references that object, and GC
  reclaims it after the buffer's grace period.
* The GC race (RFC 0001): an object uploaded more than half the buffer's GC grace
  period before the commit may look like garbage to GC.  The commit copies each such
  object to a fresh key first -- server-side (S3 CopyObject, a hard link on a local
  directory), in parallel -- as the producers re-upload theirs (I5).  The grace period
  is the buffer's (root section 6), the one GC reads.
* The sink never creates a buffer unless ``createBuffer`` is true.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import BinaryType, StringType, StructType
from ulid import ULID

import tieredbuf
from tieredbuf import keys
from tieredbuf.config import DEFAULT_GC_GRACE_PERIOD, Compression
from tieredbuf.errors import (
    AlreadyExistsError,
    BufferNotFoundError,
    ConfigError,
    ObjectNotFoundError,
    ProducerIdReusedError,
)
from tieredbuf.format.batch import encode_batch
from tieredbuf.format.manifest import MetadataItem, NewEntry
from tieredbuf.queue.manifest_queue import Snapshot
from tieredbuf.spark import options as opt
from tieredbuf.spark.executor import shared_buffer
from tieredbuf.spark.options import WriteOptions

log = logging.getLogger(__name__)

Uploaded = tuple[str, tuple[MetadataItem, ...], int]
"""(key, metadata, size in bytes) of one uploaded data object."""


@dataclass
class UploadedObjects(WriterCommitMessage):
    """Keys (and metadata) of the objects one task uploaded, in order."""

    objects: list[Uploaded] = field(default_factory=list)


def is_records(schema: StructType) -> bool:
    """Rows with a binary or string ``value`` column are records; anything else, bundles."""
    for f in schema.fields:
        if f.name.lower() == "value":
            return isinstance(f.dataType, (BinaryType, StringType))
    return False


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _put(buf: tieredbuf.Buffer, key: str, body: bytes) -> None:
    # One conditional PUT whatever the size: obstore 0.12.1 has no conditional multipart
    # (see tieredbuf/publish.py), and S3 takes up to 5 GiB in one PUT.
    # AlreadyExists on a fresh ULID key is our own attempt whose response was lost.
    with contextlib.suppress(AlreadyExistsError):
        buf.store.put(key, body, mode="create")


def _binary(col: pa.Array | pa.ChunkedArray, name: str) -> list[bytes]:
    if col.null_count:
        raise ConfigError(f"column {name!r} holds nulls; every record needs a value")
    if not pa.types.is_binary(col.type):
        col = col.cast(pa.binary())
    values: list[bytes] = col.to_pylist()
    return values


class _RecordsEncoder:
    def __init__(self, wo: WriteOptions, schema: pa.Schema) -> None:
        self.wo = wo
        self.value = next(n for n in schema.names if n.lower() == "value")
        meta = [n for n in schema.names if n.lower() == "metadata"]
        self.meta = meta[0] if meta else None
        self.records: list[bytes] = []
        self.items: list[MetadataItem] = []
        self.size = 0

    def add(self, batch: pa.RecordBatch) -> None:
        values = _binary(batch.column(self.value), self.value)
        now = _now_ms()
        if self.meta is None:
            if not self.items:
                self.items.append(MetadataItem(0, now, b""))
        else:
            metas = batch.column(self.meta)
            if not pa.types.is_binary(metas.type):
                metas = metas.cast(pa.binary())
            last = self.items[-1].payload if self.items else None
            for i, m in enumerate(metas.to_pylist()):
                payload = m or b""
                if payload != last:
                    self.items.append(MetadataItem(len(self.records) + i, now, payload))
                    last = payload
        self.records.extend(values)
        self.size += sum(len(v) + 4 for v in values)

    def full(self) -> bool:
        return self.size >= self.wo.max_object_bytes

    def take(self) -> tuple[bytes, str, tuple[MetadataItem, ...]] | None:
        if not self.records:
            return None
        comp = Compression.ZSTD if self.wo.zstd else Compression.NONE
        body = encode_batch(self.records, comp)
        items = tuple(self.items)
        self.records, self.items, self.size = [], [], 0
        return body, keys.BATCH_SUFFIX, items


class _BundlesEncoder:
    def __init__(self, wo: WriteOptions) -> None:
        from tieredbuf.format.segment import SegmentBuilder

        self.wo = wo
        self._new = SegmentBuilder
        self.builder = SegmentBuilder()
        self.last_ms: int | None = None

    def add(self, batch: pa.RecordBatch) -> None:
        from tieredbuf.format.segment import SegmentBundle

        if batch.num_rows == 0:
            return
        now_ns = time.time_ns()
        self.last_ms = now_ns // 1_000_000
        self.builder.add(SegmentBundle({self.wo.slot: batch}, now_ns, len(self.builder)))

    def full(self) -> bool:
        return self.builder.nbytes >= self.wo.max_object_bytes

    def take(self) -> tuple[bytes, str, tuple[MetadataItem, ...]] | None:
        if not len(self.builder):
            return None
        parts = self.builder.finish()
        body = b"".join(p if isinstance(p, bytes) else p.to_pybytes() for p in parts)
        # the newest bundle's time: the entry's time in the manifest (what time lookups
        # bisect) is then an upper bound of its bundles' times, as for records
        items = (MetadataItem(0, self.last_ms or _now_ms(), b""),)
        self.builder, self.last_ms = self._new(), None
        return body, keys.SEGMENT_SUFFIX, items


def write_task(
    wo: WriteOptions, records: bool, batches: Iterator[pa.RecordBatch]
) -> UploadedObjects:
    """Executor side: encode and upload; returns what was uploaded (not yet enqueued)."""
    buf = shared_buffer(wo.url, wo.store)
    out = UploadedObjects()
    enc: _RecordsEncoder | _BundlesEncoder | None = None

    def flush() -> None:
        got = enc.take() if enc is not None else None
        if got is not None:
            body, suffix, items = got
            key = keys.data_key(ULID(), suffix)
            _put(buf, key, body)
            out.objects.append((key, items, len(body)))

    try:
        for batch in batches:
            if enc is None:
                enc = _RecordsEncoder(wo, batch.schema) if records else _BundlesEncoder(wo)
            enc.add(batch)
            if enc.full():
                flush()
        flush()
    except BaseException:
        # a failing task reports nothing to the driver, whose abort() therefore cannot
        # know these keys: delete them here (what fails to delete, GC reclaims)
        _delete_uploaded(buf, [k for k, _, _ in out.objects])
        raise
    return out


def _delete_uploaded(buf: tieredbuf.Buffer, mine: Sequence[str]) -> None:
    failed = buf.store.delete_many(sorted(mine))
    for key, err in failed:
        log.warning("tieredbuf write aborted: could not delete %s (GC will): %s", key, err)
    if mine:
        log.warning("tieredbuf write aborted: deleted %d uploaded objects", len(mine) - len(failed))


COPY_THREADS = 16


class _Stale(Exception):
    def __init__(self, indices: list[int]) -> None:
        super().__init__(f"{len(indices)} objects older than half the GC grace period")
        self.indices = indices


def _copy_fresh(buf: tieredbuf.Buffer, objs: list[Uploaded], indices: Sequence[int]) -> None:
    """Copy the objects at ``indices`` to fresh keys, server-side and in parallel.

    The old keys become orphans for GC (they are never enqueued); they are not deleted
    here, in case a lost-response append that named them lands late."""

    def copy(i: int) -> str:
        key = objs[i][0]
        suffix = keys.SEGMENT_SUFFIX if key.endswith(keys.SEGMENT_SUFFIX) else keys.BATCH_SUFFIX
        fresh = keys.data_key(ULID(), suffix)
        try:
            buf.store.copy(key, fresh)
        except ObjectNotFoundError as e:
            raise tieredbuf.DataLossError(
                f"{key} was deleted before the job committed (the job ran longer than the "
                "buffer's GC grace period: raise it with Buffer.set_gc_grace_period); run "
                "the job again"
            ) from e
        log.warning("%s waited past half the GC grace period; copied to %s", key, fresh)
        return fresh

    with ThreadPoolExecutor(min(COPY_THREADS, len(indices))) as pool:
        fresh = list(pool.map(copy, indices))
    for i, key in zip(indices, fresh, strict=True):
        objs[i] = (key, objs[i][1], objs[i][2])


def _uploaded(messages: Sequence[WriterCommitMessage | None]) -> list[Uploaded]:
    return [o for m in messages if isinstance(m, UploadedObjects) for o in m.objects]


def publish(
    buf: tieredbuf.Buffer,
    wo: WriteOptions,
    messages: Sequence[WriterCommitMessage | None],
    producer_id: str | None,
    version: int | None,
) -> list[int | None]:
    """Driver side: append every uploaded object, in task order, in one CAS, once.

    ``producer_id`` and ``version`` tag the append (see the module docstring); with
    ``producer_id`` None it is appended untagged (``ManifestQueue.append_once``)."""
    objs = _uploaded(messages)
    if not objs:
        return []
    if len(objs) >= opt.STRIDE:
        raise ConfigError(f"{len(objs)} objects in one commit; at most {opt.STRIDE - 1}")

    def check(snap: Snapshot) -> None:
        grace = snap.gc_grace_ms
        max_age = (
            DEFAULT_GC_GRACE_PERIOD // timedelta(milliseconds=1) if grace is None else grace
        ) // 2
        now = _now_ms()
        stale = [
            i
            for i, (key, _, _) in enumerate(objs)
            if (u := keys.parse_data_key(key)) is not None and now - u.milliseconds > max_age
        ]
        if stale:
            raise _Stale(stale)

    while True:
        entries = [NewEntry(k, items, size) for k, items, size in objs]
        try:
            if producer_id is None:
                return list(
                    buf.queue.append_once(entries, before_write=check, create=wo.create_buffer)
                )
            assert version is not None
            return buf.queue.append(
                entries,
                producer_id,
                (version + 1) * opt.STRIDE,
                before_write=check,
                create=wo.create_buffer,
                strict=True,
            )
        except _Stale as s:
            _copy_fresh(buf, objs, s.indices)
        except ProducerIdReusedError as e:
            recorded = e.recorded // opt.STRIDE - 1
            raise ProducerIdReusedError(
                e.producer_id,
                e.recorded,
                e.attempted,
                f"option producerId={producer_id!r}: the buffer at {wo.url} already has a "
                f"write tagged up to version {recorded} by this producerId, and this one is "
                f"version {version}, which did not land before: another query or checkpoint "
                "(or batch job) uses the same producerId.  Give each streaming query / "
                "checkpoint its own producerId, and batch writes increasing batchVersions "
                "(a retry repeats the same one)",
            ) from e


def abort(
    buf: tieredbuf.Buffer, messages: Sequence[WriterCommitMessage | None], since: int
) -> None:
    """Delete what an aborted job uploaded -- unless its commit got it into the queue.

    ``since`` is the queue's next sequence when the job was planned: a commit of this
    job can only have appended after it, so only the entries from there on are checked
    (never the whole backlog)."""
    objs = _uploaded(messages)
    if not objs:
        return
    mine = {k for k, _, _ in objs}
    snap = buf.snapshot()
    for e in snap.iter_from(max(since, snap.low)):
        if e.location in mine:
            log.warning(
                "tieredbuf write aborted after its commit appended %s: keeping its %d objects",
                e.location,
                len(objs),
            )
            return
    _delete_uploaded(buf, sorted(mine))


def require_buffer(buf: tieredbuf.Buffer, wo: WriteOptions) -> int:
    """The buffer's next sequence; BufferNotFoundError unless it exists or createBuffer."""
    snap = buf.snapshot()
    if not snap.exists and not wo.create_buffer:
        raise BufferNotFoundError(
            wo.url, "the sink creates one only with .option('createBuffer', 'true')"
        )
    return snap.root.next_seq


class BatchWriter(DataSourceArrowWriter):
    """``df.write.format("tieredbuf").save(url)``."""

    def __init__(self, wo: WriteOptions, schema: StructType) -> None:
        if (wo.producer_id is None) != (wo.batch_version is None):
            raise ConfigError(
                "a batch write takes producerId and batchVersion together (or "
                "neither): the pair makes it idempotent, like Delta's "
                "txnAppId / txnVersion"
            )
        self.wo = wo
        self.records = is_records(schema)
        self.since = require_buffer(shared_buffer(wo.url, wo.store), wo)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriterCommitMessage:
        return write_task(self.wo, self.records, iterator)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:  # type: ignore[override]
        buf = shared_buffer(self.wo.url, self.wo.store)
        publish(buf, self.wo, messages, self.wo.producer_id, self.wo.batch_version)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:  # type: ignore[override]
        abort(shared_buffer(self.wo.url, self.wo.store), messages, self.since)


class StreamWriter(DataSourceStreamArrowWriter):
    """``df.writeStream.format("tieredbuf").start(url)``: one append per micro-batch,
    tagged with its batch id."""

    def __init__(self, wo: WriteOptions, schema: StructType, producer_id: str) -> None:
        if wo.batch_version is not None:
            raise ConfigError(
                "batchVersion is for batch writes: a streaming write is tagged "
                "with its micro-batch id"
            )
        self.wo = wo
        self.records = is_records(schema)
        self.producer_id = producer_id
        self.since = require_buffer(shared_buffer(wo.url, wo.store), wo)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriterCommitMessage:
        return write_task(self.wo, self.records, iterator)

    def commit(  # type: ignore[override]
        self, messages: list[WriterCommitMessage | None], batchId: int
    ) -> None:
        publish(
            shared_buffer(self.wo.url, self.wo.store), self.wo, messages, self.producer_id, batchId
        )

    def abort(  # type: ignore[override]
        self, messages: list[WriterCommitMessage | None], batchId: int
    ) -> None:
        abort(shared_buffer(self.wo.url, self.wo.store), messages, self.since)
