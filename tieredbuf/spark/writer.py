"""The ``tieredbuf`` sink: tasks upload data objects, the driver appends them once.

* Tasks encode their rows -- a ``value`` column (binary or string) as RFC 0001
  records (``.batch``), any other schema as Arrow bundles (``.qseg``, one bundle
  per Arrow batch Spark hands over, in slot ``slot``) -- and PUT each object under
  a fresh ULID key with create-if-absent.  Nothing is visible yet.
* The driver's ``commit`` appends every object of the job to the manifest in one
  CAS, through ManifestQueue's exactly-once append: the producer id is unique to
  the job (batch) or to the query (streaming, producer sequence anchored at the
  micro-batch id), so a retried commit finds its watermark and appends nothing
  twice (I2).  The job's output appears atomically.
* An aborted job's objects stay unreferenced; GC deletes them past its grace period.

GC race (RFC 0001): an object uploaded more than half the GC grace period before
the commit may look like garbage to GC.  The commit copies any such object to a
fresh key first (the only case where data passes through the driver), as the
producer's publisher does (I5).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

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
from tieredbuf.config import Compression
from tieredbuf.errors import AlreadyExistsError, ConfigError, ObjectNotFoundError
from tieredbuf.format.batch import encode_batch
from tieredbuf.format.manifest import MetadataItem, NewEntry
from tieredbuf.spark.executor import shared_buffer
from tieredbuf.spark.options import WriteOptions

log = logging.getLogger(__name__)

STRIDE = 1 << 20
"""Producer sequence numbers reserved per commit: at most this many objects per job or
micro-batch.  A commit's last producer sequence is ``(epoch + 1) * STRIDE``, so a retry
of the same commit is recognised however many objects it carries."""

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
        self.first_ms: int | None = None

    def add(self, batch: pa.RecordBatch) -> None:
        from tieredbuf.format.segment import SegmentBundle

        if batch.num_rows == 0:
            return
        now_ns = time.time_ns()
        if self.first_ms is None:
            self.first_ms = now_ns // 1_000_000
        self.builder.add(SegmentBundle({self.wo.slot: batch}, now_ns, len(self.builder)))

    def full(self) -> bool:
        return self.builder.nbytes >= self.wo.max_object_bytes

    def take(self) -> tuple[bytes, str, tuple[MetadataItem, ...]] | None:
        if not len(self.builder):
            return None
        parts = self.builder.finish()
        body = b"".join(p if isinstance(p, bytes) else p.to_pybytes() for p in parts)
        items = (MetadataItem(0, self.first_ms or _now_ms(), b""),)
        self.builder, self.first_ms = self._new(), None
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

    for batch in batches:
        if enc is None:
            enc = _RecordsEncoder(wo, batch.schema) if records else _BundlesEncoder(wo)
        enc.add(batch)
        if enc.full():
            flush()
    flush()
    return out


def _refresh_stale(buf: tieredbuf.Buffer, objs: list[Uploaded], max_age_ms: int) -> bool:
    """Copy objects older than ``max_age_ms`` to fresh keys; True if any was copied."""
    now = _now_ms()
    copied = False
    for i, (key, items, size) in enumerate(objs):
        ulid = keys.parse_data_key(key)
        if ulid is None or now - ulid.milliseconds <= max_age_ms:
            continue
        suffix = keys.SEGMENT_SUFFIX if key.endswith(keys.SEGMENT_SUFFIX) else keys.BATCH_SUFFIX
        try:
            body = buf.store.get(key).data
        except ObjectNotFoundError as e:
            raise tieredbuf.DataLossError(
                f"{key} was deleted before the job committed (the job ran longer than the GC "
                "grace period); run the job again"
            ) from e
        fresh = keys.data_key(ULID(), suffix)
        log.warning("%s waited past half the GC grace period; copying it to %s", key, fresh)
        _put(buf, fresh, body)
        objs[i] = (fresh, items, size)
        copied = True
    return copied


class _Stale(Exception):
    pass


def publish(
    wo: WriteOptions, messages: Sequence[WriterCommitMessage | None], producer_id: str,
    epoch: int,
) -> list[int | None]:
    """Driver side: append every uploaded object, in task order, exactly once."""
    objs: list[Uploaded] = [
        o for m in messages if isinstance(m, UploadedObjects) for o in m.objects
    ]
    if not objs:
        return []
    if len(objs) >= STRIDE:
        raise ConfigError(f"{len(objs)} objects in one commit; at most {STRIDE - 1}")
    buf = shared_buffer(wo.url, wo.store)
    max_age = wo.gc_grace_ms // 2

    def check(_snap: object) -> None:
        now = _now_ms()
        for key, _, _ in objs:
            ulid = keys.parse_data_key(key)
            if ulid is not None and now - ulid.milliseconds > max_age:
                raise _Stale(key)

    while True:
        _refresh_stale(buf, objs, max_age)
        try:
            return buf.queue.append(
                [NewEntry(k, items, size) for k, items, size in objs], producer_id,
                (epoch + 1) * STRIDE,
                before_write=check,
            )
        except _Stale:
            continue


def _abort(messages: Sequence[WriterCommitMessage | None]) -> None:
    n = sum(len(m.objects) for m in messages if isinstance(m, UploadedObjects))
    log.warning("tieredbuf write aborted: %d uploaded objects left for GC", n)


class BatchWriter(DataSourceArrowWriter):
    """``df.write.format("tieredbuf").save(url)``."""

    def __init__(self, wo: WriteOptions, schema: StructType) -> None:
        self.wo = wo
        self.records = is_records(schema)
        self.producer_id = f"spark-job-{ULID()}"

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriterCommitMessage:
        return write_task(self.wo, self.records, iterator)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:  # type: ignore[override]
        publish(self.wo, messages, self.producer_id, 0)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:  # type: ignore[override]
        _abort(messages)


class StreamWriter(DataSourceStreamArrowWriter):
    """``df.writeStream.format("tieredbuf").start(url)``: one append per micro-batch."""

    def __init__(self, wo: WriteOptions, schema: StructType, producer_id: str) -> None:
        self.wo = wo
        self.records = is_records(schema)
        self.producer_id = producer_id

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriterCommitMessage:
        return write_task(self.wo, self.records, iterator)

    def commit(  # type: ignore[override]
        self, messages: list[WriterCommitMessage | None], batchId: int
    ) -> None:
        publish(self.wo, messages, self.producer_id, batchId)

    def abort(  # type: ignore[override]
        self, messages: list[WriterCommitMessage | None], batchId: int
    ) -> None:
        _abort(messages)
