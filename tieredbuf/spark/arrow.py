"""Data objects to Arrow record batches in exactly the schema Spark expects.

Runs on executors.  Spark's Arrow path compares the batch schema with
``to_arrow_schema(schema, timezone="UTC")`` field by field: ``binary`` (not
``large_binary``), ``timestamp[us, tz=UTC]``, same order, same nullability.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tieredbuf.errors import ConfigError, TieredBufError
from tieredbuf.format import idem
from tieredbuf.format.batch import decode_batch_arrow
from tieredbuf.format.manifest import MetadataItem
from tieredbuf.spark.options import check_long

RECORDS_DDL = (
    "value binary, metadata binary, sequence long, index int, "
    "ingestion_time timestamp, location string"
)
SEQUENCE_COL = "_sequence"
BUNDLE_COL = "_bundle"
MAX_BATCH_BYTES = 64 << 20
"""An object's rows go to Spark as one Arrow batch up to this many bytes, larger ones
in row slices of about this size (a sliced binary column costs the IPC writer a
re-basing copy, so small objects are not sliced)."""


@dataclass(frozen=True, slots=True)
class ObjectRef:
    """What an executor needs to read one data object: no manifest read on executors."""

    sequence: int
    location: str
    metadata: tuple[MetadataItem, ...]
    size: int = 0
    """The object's size as the manifest recorded it (0: none recorded): the executor
    refuses an object of another size (DamagedObjectError)."""


def records_schema() -> pa.Schema:
    """The Arrow form of :data:`RECORDS_DDL` as Spark converts it (all nullable)."""
    return pa.schema(
        [
            ("value", pa.binary()),
            ("metadata", pa.binary()),
            ("sequence", pa.int64()),
            ("index", pa.int32()),
            ("ingestion_time", pa.timestamp("us", tz="UTC")),
            ("location", pa.string()),
        ]
    )


MAX_BINARY_BYTES = (1 << 31) - 1
"""A ``binary``/``string`` array's offsets are int32 (Spark wants those types, not the
large ones): an object's rows are cut into row ranges whose repeated columns fit."""


def records_batches(
    data: bytes,
    ref: ObjectRef,
    schema: pa.Schema,
    ts_from_ms: int | None = None,
    ts_to_ms: int | None = None,
) -> Iterator[pa.RecordBatch]:
    """The rows of one ``.batch`` object; ``[ts_from_ms, ts_to_ms)`` filters per record."""
    values = decode_batch_arrow(data, ref.location)
    n = len(values)
    if n == 0:
        return
    seq = check_long(ref.sequence)
    md = sorted(
        (
            MetadataItem(m.start_index, m.ingestion_time_ms, idem.own(m.payload))
            for m in ref.metadata
        ),
        key=lambda m: m.start_index,
    )  # a call's own payload: an idempotency tag taken off (format/idem.py)
    which, lead = _item_of_record(md, n)
    loc = ref.location.encode()
    widest = max([len(loc), *(len(m.payload) for m in md), 1])
    step = max(1, MAX_BINARY_BYTES // widest)
    for off in range(0, n, step):
        k = min(step, n - off)
        metadata, ingestion = _metadata_columns(md, which[off : off + k], max(0, lead - off))
        batch = pa.RecordBatch.from_arrays(
            [
                values.slice(off, k),
                metadata,
                pa.array(np.full(k, seq, dtype=np.int64)),
                pa.array(np.arange(off, off + k, dtype=np.int32)),
                ingestion,
                repeat_value(loc, k, pa.string()),
            ],
            schema=records_schema(),
        )
        if ts_from_ms is not None or ts_to_ms is not None:
            batch = batch.filter(_time_mask(ingestion, ts_from_ms, ts_to_ms))
        yield from _project(batch, schema)


def repeat_value(value: bytes, n: int, t: pa.DataType) -> pa.Array:
    """``value`` ``n`` times as a ``binary``/``string`` array, built from two buffers."""
    if len(value) * n > MAX_BINARY_BYTES:
        raise ValueError(f"{n} x {len(value)} bytes do not fit one {t} array (int32 offsets)")
    offsets = np.arange(n + 1, dtype=np.int64) * len(value)
    return pa.Array.from_buffers(
        t, n, [None, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(value * n)]
    )


def _item_of_record(md: Sequence[MetadataItem], n: int) -> tuple[np.ndarray, int]:
    """For each record, the index of the metadata item covering it (items sorted by start
    index; each covers the records up to the next one's start), and how many leading
    records no item covers."""
    if not md:
        return np.zeros(n, dtype=np.int64), n
    starts = np.clip(np.array([m.start_index for m in md], dtype=np.int64), 0, n)
    runs = np.diff(np.append(starts, n))
    lead = int(starts[0])
    which = np.concatenate(
        [np.zeros(lead, np.int64), np.repeat(np.arange(len(md), dtype=np.int64), runs)]
    )
    return which, lead


def _metadata_columns(
    md: Sequence[MetadataItem], which: np.ndarray, lead: int
) -> tuple[pa.Array, pa.Array]:
    """Per-record ``metadata`` and ``ingestion_time`` of the records ``which`` indexes
    (the first ``lead`` of them before any item: nulls)."""
    ts_type = pa.timestamp("us", tz="UTC")
    k = len(which)
    lead = min(lead, k)
    if not md or lead == k:
        return pa.nulls(k, pa.binary()), pa.nulls(k, ts_type)
    if len(md) == 1 and not lead:
        m = md[0]
        return (
            repeat_value(m.payload, k, pa.binary()),
            pa.array(np.full(k, m.ingestion_time_ms * 1000, dtype=np.int64), ts_type),
        )
    if lead:
        mask = np.zeros(k, dtype=bool)
        mask[:lead] = True
        idx = pa.array(which, mask=mask)
    else:
        idx = pa.array(which)
    metadata = pa.array([m.payload for m in md], pa.binary()).take(idx)
    times_us = np.array([m.ingestion_time_ms for m in md], dtype=np.int64) * 1000
    return metadata, pa.array(times_us, ts_type).take(idx)


def _time_mask(col: pa.Array, lo_ms: int | None, hi_ms: int | None) -> pa.Array:
    ts = col.cast(pa.int64())
    keep = pa.array(np.ones(len(col), dtype=bool))
    if lo_ms is not None:
        keep = pc.and_(keep, pc.greater_equal(ts, lo_ms * 1000))
    if hi_ms is not None:
        keep = pc.and_(keep, pc.less(ts, hi_ms * 1000))
    return pc.fill_null(keep, False)


def _project(batch: pa.RecordBatch, schema: pa.Schema) -> Iterator[pa.RecordBatch]:
    """Select ``schema``'s columns (Spark may prune); slice when over MAX_BATCH_BYTES."""
    if batch.schema.names != schema.names:
        batch = pa.RecordBatch.from_arrays([batch.column(f.name) for f in schema], schema=schema)
    elif not batch.schema.equals(schema):
        batch = pa.RecordBatch.from_arrays(batch.columns, schema=schema)
    size = batch.nbytes
    if size <= MAX_BATCH_BYTES or batch.num_rows < 2:
        yield batch
        return
    rows = max(1, batch.num_rows * MAX_BATCH_BYTES // size)
    for off in range(0, batch.num_rows, rows):
        yield batch.slice(off, rows)


# --- bundles -----------------------------------------------------------------------


def spark_compatible(t: pa.DataType) -> pa.DataType:
    """The nearest type Spark's Arrow conversion accepts (lossless where one exists)."""
    if pa.types.is_dictionary(t):
        return spark_compatible(t.value_type)
    if pa.types.is_uint8(t):
        return pa.int16()
    if pa.types.is_uint16(t):
        return pa.int32()
    if pa.types.is_uint32(t):
        return pa.int64()
    if pa.types.is_uint64(t):
        return pa.decimal128(20, 0)
    if pa.types.is_float16(t):
        return pa.float32()
    if pa.types.is_date64(t):
        return pa.date32()
    if pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return pa.string()
    if pa.types.is_large_binary(t) or pa.types.is_binary_view(t):
        return pa.binary()
    if pa.types.is_timestamp(t):
        return pa.timestamp("us", tz=None if t.tz is None else "UTC")
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return pa.list_(t.value_field.with_type(spark_compatible(t.value_type)))
    if pa.types.is_struct(t):
        return pa.struct(
            [t.field(i).with_type(spark_compatible(t.field(i).type)) for i in range(t.num_fields)]
        )
    if pa.types.is_map(t):
        return pa.map_(spark_compatible(t.key_type), spark_compatible(t.item_type))
    return t


def unify(schemas: Sequence[pa.Schema]) -> pa.Schema:
    """The representative schema of a slot: union of columns (first-seen order), each
    at the widest compatible type (as Quiver's DataFusion reader does)."""
    if not schemas:
        return pa.schema([])
    plain = [pa.schema([f.with_type(_undict(f.type)) for f in s]) for s in schemas]
    try:
        return pa.unify_schemas(plain, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise ConfigError(f"slot schemas cannot be unified: {e}") from e


def _undict(t: pa.DataType) -> pa.DataType:
    return t.value_type if pa.types.is_dictionary(t) else t


def conform(batch: pa.RecordBatch, target: pa.Schema) -> list[pa.Array]:
    """``batch``'s columns cast to ``target`` (missing columns become nulls)."""
    names = batch.schema.names
    out: list[pa.Array] = []
    for f in target:
        if f.name not in names:
            out.append(pa.nulls(batch.num_rows, f.type))
            continue
        col = batch.column(f.name)
        if pa.types.is_dictionary(col.type):
            col = col.dictionary_decode()
        if not col.type.equals(f.type):
            opts = pc.CastOptions(target_type=f.type, allow_time_truncate=True)
            col = pc.cast(col, options=opts)
        out.append(col)
    return out


def in_window(ts_ms: int, lo_ms: int | None, hi_ms: int | None) -> bool:
    """``lo_ms <= ts_ms < hi_ms`` (an absent bound is open)."""
    return (lo_ms is None or ts_ms >= lo_ms) and (hi_ms is None or ts_ms < hi_ms)


def bundle_batches(
    data: bytes,
    ref: ObjectRef,
    slot: int,
    schema: pa.Schema,
    ts_from_ms: int | None = None,
    ts_to_ms: int | None = None,
) -> Iterator[pa.RecordBatch]:
    """Rows of ``slot`` in one ``.qseg`` object, cast to ``schema`` (which ends with
    ``_sequence`` and ``_bundle``; Spark may have pruned other columns).  A bundle is
    one record for time windows: kept when its ingestion time is in
    ``[ts_from_ms, ts_to_ms)``."""
    from tieredbuf.format.segment import SegmentReader

    seq = check_long(ref.sequence)
    windowed = ts_from_ms is not None or ts_to_ms is not None
    reader = SegmentReader(data, obj=ref.location)
    for i, b in enumerate(reader.bundles(slots=[slot])):
        batch = b.slots.get(slot)
        if batch is None:
            continue
        if windowed:
            t = bundle_time_ms(b.ingestion_ts_nanos, ref.metadata)
            if t is None:  # never guess: a wrong guess drops or adds rows silently
                raise TieredBufError(
                    f"{ref.location} (sequence {ref.sequence}): bundle {i} has no ingestion "
                    "time (a Quiver batch manifest without tieredbuf's time column) and its "
                    "queue entry none either, so it cannot be placed in a time window; read "
                    "it without one"
                )
            if not in_window(t, ts_from_ms, ts_to_ms):
                continue
        yield from _bundle_rows(batch, seq, i, schema)


def bundle_time_ms(ts_nanos: int | None, metadata: Sequence[MetadataItem]) -> int | None:
    """A bundle's ingestion time (ms): its own (tieredbuf's segments record one per
    bundle), else its queue entry's latest metadata time (a segment whose batch manifest
    has only Quiver's two columns), else None."""
    if ts_nanos is not None:
        return ts_nanos // 1_000_000
    return max((m.ingestion_time_ms for m in metadata), default=None)


def stream_bundle_batches(
    chunks: Sequence[pa.RecordBatch],
    bundles: Sequence[int],
    ref: ObjectRef,
    schema: pa.Schema,
    times_ms: Sequence[int] = (),
    ts_from_ms: int | None = None,
    ts_to_ms: int | None = None,
) -> Iterator[pa.RecordBatch]:
    """Rows of the chunks of one stream of a ``.qseg`` object (one stream holds one
    slot); ``bundles[i]`` is the index of the bundle chunk ``i`` belongs to and
    ``times_ms[i]`` that bundle's ingestion time (for time windows)."""
    seq = check_long(ref.sequence)
    windowed = ts_from_ms is not None or ts_to_ms is not None
    if windowed and len(times_ms) != len(bundles):
        raise ValueError("a time window needs every chunk's bundle time")
    for j, (batch, i) in enumerate(zip(chunks, bundles, strict=True)):
        if not windowed or in_window(times_ms[j], ts_from_ms, ts_to_ms):
            yield from _bundle_rows(batch, seq, i, schema)


def _bundle_rows(
    batch: pa.RecordBatch, seq: int, bundle: int, schema: pa.Schema
) -> Iterator[pa.RecordBatch]:
    n = batch.num_rows
    if n == 0:
        return
    payload = pa.schema([f for f in schema if f.name not in (SEQUENCE_COL, BUNDLE_COL)])
    cols = dict(zip(payload.names, conform(batch, payload), strict=True))
    cols[SEQUENCE_COL] = pa.array(np.full(n, seq, dtype=np.int64))
    cols[BUNDLE_COL] = pa.array(np.full(n, bundle, dtype=np.int32))
    yield pa.RecordBatch.from_arrays([cols[f.name] for f in schema], schema=schema)
