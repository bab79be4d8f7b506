"""The ``tieredbuf`` sink: tasks upload data objects, the driver appends them once.

* Tasks encode their rows -- a ``value`` column (binary or string) as RFC 0001
  records (``.batch``), any other schema, or any schema with ``slot`` set, as Arrow
  bundles (``.qseg``, one bundle per Arrow batch Spark hands over, in slot ``slot``)
  -- and PUT each object under a fresh ULID key with create-if-absent.  Nothing is
  visible yet.  Records keep only ``value`` and ``metadata``: other columns next to
  a ``value`` column, without ``slot``, are refused (:func:`is_records`).
* The driver's ``commit`` appends every object of the job (or micro-batch) to the
  manifest in one CAS: the output appears atomically, and exactly once.
  - With ``producerId`` the append is tagged ``(producerId, version)`` -- the
    micro-batch id when streaming, ``batchVersion`` for a batch write (Delta's
    ``txnAppId`` / ``txnVersion``) -- and recorded in the producer's watermark.  A
    commit whose tag is exactly the recorded one already landed (Spark re-running a
    micro-batch after a restart, a retried job) and appends nothing; a tag below the
    recorded one (or inside it) is a *different* writer using the same producerId (a
    new checkpoint, a second query): the commit fails naming the option, never
    skipping data as if it had landed (ProducerIdReusedError).  A streaming query
    records its tag under its own watermark id, ``producerId#spark-query=<query id>``
    (Spark's query id, kept in the checkpoint: the same across restarts of one
    checkpoint, another for another checkpoint), so an *equal* micro-batch id from
    another query is told apart too: a watermark of the same producerId written by
    another query (or by a batch write) fails the commit the same way.
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
from collections.abc import Iterator, Mapping, Sequence
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
    TieredBufError,
)
from tieredbuf.format import manifest as fm
from tieredbuf.format.batch import encode_batch
from tieredbuf.format.crc import crc32
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
    """Keys (and metadata) of the objects one task uploaded, in order, and the id of the
    streaming query the task ran for (None for a batch write)."""

    objects: list[Uploaded] = field(default_factory=list)
    query_id: str | None = None


QUERY_ID_PROPERTY = "sql.streaming.queryId"
"""The local property Spark sets on every task of a streaming query: the query's id,
stored in its checkpoint, so the same across restarts of one checkpoint and different
for another checkpoint."""


def _task_query_id() -> str | None:
    from pyspark import TaskContext

    tc = TaskContext.get()
    return None if tc is None else tc.getLocalProperty(QUERY_ID_PROPERTY)


def watermark_id(producer_id: str, query_id: str | None) -> str:
    """The manifest watermark a commit is recorded under: ``producerId`` for a batch
    write, ``producerId#spark-query=<query id>`` for a streaming query."""
    return producer_id if query_id is None else f"{producer_id}{opt.QUERY_TAG}{query_id}"


def split_watermark_id(wid: str) -> tuple[str, str | None]:
    """(producerId, query id or None) of a watermark id (inverse of :func:`watermark_id`)."""
    pid, tag, query = wid.rpartition(opt.QUERY_TAG)
    return (pid, query) if tag else (wid, None)


def is_records(schema: StructType, wo: WriteOptions) -> bool:
    """Records (``.batch``) or Arrow bundles (``.qseg``) for rows of ``schema``.

    Records need a binary or string ``value`` column and keep only it and an optional
    ``metadata`` column; a ``slot`` option asks for bundles (every column, ``value``
    included).  Rows with a ``value`` column and other columns, without ``slot``, are
    refused (ConfigError naming the columns): the records encoding would drop them."""
    if wo.slot is not None:
        return False
    by_name = {f.name.lower(): f for f in schema.fields}
    value = by_name.get("value")
    if value is None or not isinstance(value.dataType, (BinaryType, StringType)):
        return False
    meta = by_name.get("metadata")
    if meta is not None and not isinstance(meta.dataType, (BinaryType, StringType)):
        raise ConfigError(
            f"column {meta.name!r} is the records' metadata payload and must be binary or "
            f"string, got {meta.dataType.simpleString()}; cast it, or set option slot to "
            "write every column as Arrow bundles"
        )
    dropped = [f.name for f in schema.fields if f.name.lower() not in ("value", "metadata")]
    if dropped:
        raise ConfigError(
            f"columns {dropped} would be dropped: rows with a {value.name!r} column are "
            "written as records, which keep only 'value' and 'metadata'.  Select those "
            "columns to write records, or set option slot to write every column as Arrow "
            "bundles into that slot"
        )
    return True


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _put(buf: tieredbuf.Buffer, key: str, body: bytes) -> None:
    # One conditional PUT whatever the size: obstore 0.12.1 has no conditional multipart
    # (see tieredbuf/produce/publish.py), and S3 takes up to 5 GiB in one PUT.
    # AlreadyExists on a fresh ULID key is our own attempt whose response was lost.  A
    # .batch keeps its CRC32 beside it where the store can (readers check it, I10).
    with contextlib.suppress(AlreadyExistsError):
        if key.endswith(keys.BATCH_SUFFIX):
            buf.store.put_checksummed(key, body, crc32(body, 0), mode="create")
        else:
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
        slot = self.wo.slot or 0
        self.builder.add(SegmentBundle({slot: batch}, now_ns, len(self.builder)))

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
    out = UploadedObjects(query_id=_task_query_id())
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


def _query_id(messages: Sequence[WriterCommitMessage | None]) -> str:
    """The streaming query the tasks of a micro-batch ran for (Spark's query id)."""
    ids = {m.query_id for m in messages if isinstance(m, UploadedObjects) and m.objects}
    if len(ids) != 1 or None in ids:
        raise TieredBufError(
            f"cannot tell which streaming query wrote this micro-batch (tasks reported "
            f"query ids {sorted(map(str, ids))}; Spark sets the local property "
            f"{QUERY_ID_PROPERTY} on every streaming task): refusing to commit it, since "
            "a reused producerId could not be told from a retry"
        )
    (qid,) = ids
    assert qid is not None
    return qid


class _OtherWriter(Exception):
    """A watermark of the same producerId that another writer recorded."""

    def __init__(self, wid: str, wm: fm.Watermark) -> None:
        super().__init__(wid)
        self.wid, self.wm = wid, wm


def _refuse_other_writers(
    watermarks: Mapping[str, fm.Watermark], producer_id: str, mine: str, last_pseq: int
) -> None:
    """Raise :class:`_OtherWriter` when another writer records under ``producer_id``:
    another streaming query (its own query id), or -- for a streaming commit -- a
    watermark without a query id (a batch write, or a query run by a tieredbuf that did
    not record query ids) that is not below this commit's tag, which therefore cannot
    be told from a retry of ours."""
    streaming = split_watermark_id(mine)[1] is not None
    for wid, wm in watermarks.items():
        if wid == mine:
            continue
        pid, query = split_watermark_id(wid)
        if pid != producer_id:
            continue
        if query is not None or (streaming and wm.producer_seq >= last_pseq):
            raise _OtherWriter(wid, wm)


def _reused(
    wo: WriteOptions,
    producer_id: str,
    mine: str,
    version: int,
    recorded_wid: str,
    recorded_seq: int,
    attempted: int,
) -> ProducerIdReusedError:
    recorded = recorded_seq // opt.STRIDE - 1
    them = split_watermark_id(recorded_wid)[1]
    us = split_watermark_id(mine)[1]
    by = (
        f"streaming query {them} (the id in its checkpoint)"
        if them is not None
        else "a batch write (or a streaming query that ran without a query id recorded)"
    )
    this = f"streaming query {us}" if us is not None else "a batch write"
    same = recorded_wid == mine
    return ProducerIdReusedError(
        producer_id,
        recorded_seq,
        attempted,
        f"option producerId={producer_id!r}: the buffer at {wo.url} already has writes "
        f"tagged up to version {recorded} by {'this writer' if same else by}, and this "
        f"commit ({this}) is version {version}, which did not land before: another query "
        "or checkpoint (or batch job) uses the same producerId.  Give each streaming query "
        "/ checkpoint its own producerId, and batch writes increasing batchVersions (a "
        "retry repeats the same one)",
    )


def publish(
    buf: tieredbuf.Buffer,
    wo: WriteOptions,
    messages: Sequence[WriterCommitMessage | None],
    producer_id: str | None,
    version: int | None,
    *,
    streaming: bool = False,
) -> list[int | None]:
    """Driver side: append every uploaded object, in task order, in one CAS, once.

    ``producer_id`` and ``version`` tag the append (see the module docstring); with
    ``producer_id`` None it is appended untagged (``ManifestQueue.append_once``).
    ``streaming``: the tag is recorded under the query's own watermark
    (:func:`watermark_id`), so an equal version from another query is refused."""
    objs = _uploaded(messages)
    if not objs:
        return []
    if len(objs) >= opt.STRIDE:
        raise ConfigError(f"{len(objs)} objects in one commit; at most {opt.STRIDE - 1}")
    mine = (
        None
        if producer_id is None
        else watermark_id(producer_id, _query_id(messages) if streaming else None)
    )
    last_pseq = 0 if version is None else (version + 1) * opt.STRIDE

    def check(snap: Snapshot) -> None:
        if producer_id is not None and mine is not None:
            _refuse_other_writers(snap.view.watermarks, producer_id, mine, last_pseq)
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
            if producer_id is None or mine is None:
                return list(
                    buf.queue.append_once(entries, before_write=check, create=wo.create_buffer)
                )
            assert version is not None
            return buf.queue.append(
                entries, mine, last_pseq, before_write=check, create=wo.create_buffer, strict=True
            )
        except _Stale as s:
            _copy_fresh(buf, objs, s.indices)
        except _OtherWriter as o:
            assert producer_id is not None and mine is not None and version is not None
            raise _reused(
                wo, producer_id, mine, version, o.wid, o.wm.producer_seq, last_pseq
            ) from None
        except ProducerIdReusedError as e:
            assert producer_id is not None and mine is not None and version is not None
            raise _reused(wo, producer_id, mine, version, mine, e.recorded, e.attempted) from e


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
        self.records = is_records(schema, wo)
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
        self.records = is_records(schema, wo)
        self.producer_id = producer_id
        self.since = require_buffer(shared_buffer(wo.url, wo.store), wo)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriterCommitMessage:
        return write_task(self.wo, self.records, iterator)

    def commit(  # type: ignore[override]
        self, messages: list[WriterCommitMessage | None], batchId: int
    ) -> None:
        publish(
            shared_buffer(self.wo.url, self.wo.store),
            self.wo,
            messages,
            self.producer_id,
            batchId,
            streaming=True,
        )

    def abort(  # type: ignore[override]
        self, messages: list[WriterCommitMessage | None], batchId: int
    ) -> None:
        abort(shared_buffer(self.wo.url, self.wo.store), messages, self.since)
