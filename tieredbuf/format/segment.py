"""Quiver segment (``.qseg``) format (otel-arrow's Quiver).  Pure codec: no I/O.

::

    stream data region   one Arrow IPC *file* per stream, each starting 64-byte aligned
    stream directory     Arrow IPC stream: stream_id u32, slot_id u16,
                         schema_fingerprint fixed_size_binary(32), byte_offset u64,
                         byte_length u64, row_count u64, chunk_count u32
    batch manifest       Arrow IPC stream: bundle_index u32, slot_refs
                         list<struct<slot_id u16, stream_id u32, chunk_index u32>>,
                         plus (tieredbuf) ingestion_ts_nanos i64, sequence u64
                         (read: also Quiver's two columns, see read_section)
    footer v1 (34 B)     version u16, stream_count u32, bundle_count u32,
                         directory_offset u64, directory_length u32,
                         manifest_offset u64, manifest_length u32
    trailer (16 B)       footer_size u32, magic b"QUIVER\\0S",
                         crc32 u32 (IEEE, over every byte of the file before it)

A stream holds the chunks of one ``(slot, schema fingerprint)`` pair.  Schema drift
opens a new stream.  Dictionaries are kept exactly as ingested (Quiver's "Resend"
rule: no unification, key types preserved); because an Arrow IPC *file* may carry only
one dictionary per field, a chunk whose dictionaries differ from its stream's opens a
new stream with the same ``(slot, fingerprint)``.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import pyarrow as pa

from tieredbuf.errors import CorruptError, UnsupportedVersionError
from tieredbuf.format.crc import crc32
from tieredbuf.format.wal import MAX_SLOTS, describe_error, schema_fingerprint

SEGMENT_MAGIC = b"QUIVER\x00S"
SEGMENT_VERSION = 1
FOOTER_V1_SIZE = 34
TRAILER_SIZE = 16
ALIGN = 64
FOOTER = struct.Struct("<HIIQIQI")
TRAILER_HEAD = struct.Struct("<I8s")
U32 = struct.Struct("<I")
WHAT = "segment"
_MATCH_WINDOW = 4

DIRECTORY_SCHEMA = pa.schema(
    [
        ("stream_id", pa.uint32()),
        ("slot_id", pa.uint16()),
        ("schema_fingerprint", pa.binary(32)),
        ("byte_offset", pa.uint64()),
        ("byte_length", pa.uint64()),
        ("row_count", pa.uint64()),
        ("chunk_count", pa.uint32()),
    ]
)
SLOT_REF = pa.struct(
    [
        ("slot_id", pa.uint16()),
        ("stream_id", pa.uint32()),
        ("chunk_index", pa.uint32()),
    ]
)
MANIFEST_SCHEMA = pa.schema(
    [
        ("bundle_index", pa.uint32()),
        ("slot_refs", pa.list_(SLOT_REF)),
        ("ingestion_ts_nanos", pa.int64()),
        ("sequence", pa.uint64()),
    ]
)


@dataclass(frozen=True, slots=True)
class SegmentBundle:
    """One RecordBundle: slot id -> batch, with its ingestion time and per-core sequence
    (None for both when read from a segment whose manifest has only Quiver's two
    columns; tieredbuf always writes them)."""

    slots: Mapping[int, pa.RecordBatch]
    ingestion_ts_nanos: int | None
    sequence: int | None


@dataclass(frozen=True, slots=True)
class StreamInfo:
    stream_id: int
    slot_id: int
    schema_fingerprint: bytes
    byte_offset: int
    byte_length: int
    row_count: int
    chunk_count: int


@dataclass(slots=True)
class _Stream:
    slot: int
    fingerprint: bytes
    dictionaries: tuple[pa.Array | None, ...]
    batches: list[pa.RecordBatch] = field(default_factory=list)


def _dictionaries(batch: pa.RecordBatch) -> tuple[pa.Array | None, ...] | None:
    """Top-level dictionaries of ``batch``; None when a dictionary is nested (such a
    batch always gets a stream of its own)."""
    out: list[pa.Array | None] = []
    for f, col in zip(batch.schema, batch.columns, strict=True):
        if pa.types.is_dictionary(f.type):
            out.append(col.dictionary)
        elif _has_nested_dictionary(f.type):
            return None
        else:
            out.append(None)
    return tuple(out)


def _has_nested_dictionary(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        return True
    return any(_has_nested_dictionary(t.field(i).type) for i in range(t.num_fields))


def _same_dictionaries(a: tuple[pa.Array | None, ...], b: tuple[pa.Array | None, ...]) -> bool:
    return all(
        (x is None and y is None) or (x is not None and y is not None and x.equals(y))
        for x, y in zip(a, b, strict=True)
    )


class SegmentBuilder:
    """In-memory accumulator for one open segment: streams per (slot, fingerprint)."""

    def __init__(self) -> None:
        self._streams: list[_Stream] = []
        self._current: dict[tuple[int, bytes], list[int]] = {}
        self._manifest: list[tuple[list[tuple[int, int, int]], int, int]] = []
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._manifest)

    def add(self, bundle: SegmentBundle) -> None:
        if bundle.ingestion_ts_nanos is None or bundle.sequence is None:
            raise ValueError("a written bundle needs its ingestion time and sequence")
        refs: list[tuple[int, int, int]] = []
        for slot in sorted(bundle.slots):
            if not 0 <= slot < MAX_SLOTS:
                raise ValueError(f"slot id {slot} outside 0..{MAX_SLOTS - 1}")
            batch = bundle.slots[slot]
            fp = schema_fingerprint(batch.schema)
            dicts = _dictionaries(batch)
            sid = self._find_stream(slot, fp, dicts)
            if sid is None:
                sid = len(self._streams)
                self._streams.append(_Stream(slot, fp, dicts or ()))
                if dicts is not None:
                    self._current.setdefault((slot, fp), []).append(sid)
            stream = self._streams[sid]
            refs.append((slot, sid, len(stream.batches)))
            stream.batches.append(batch)
            self.nbytes += batch.get_total_buffer_size()
        self._manifest.append((refs, bundle.ingestion_ts_nanos, bundle.sequence))

    def _find_stream(
        self, slot: int, fp: bytes, dicts: tuple[pa.Array | None, ...] | None
    ) -> int | None:
        """A stream of this (slot, fingerprint) whose dictionaries match (the most
        recent few are tried: dictionaries usually repeat or keep changing)."""
        if dicts is None:
            return None
        for sid in reversed(self._current.get((slot, fp), [])[-_MATCH_WINDOW:]):
            if _same_dictionaries(self._streams[sid].dictionaries, dicts):
                return sid
        return None

    def finish(self) -> list[bytes | pa.Buffer]:
        """The segment file as a list of buffers (write them in order)."""
        parts: list[bytes | pa.Buffer] = []
        pos = 0
        rows: list[StreamInfo] = []
        for sid, s in enumerate(self._streams):
            pad = -pos % ALIGN
            if pad:
                parts.append(b"\0" * pad)
                pos += pad
            sink = _PartsSink()
            with pa.ipc.new_file(pa.PythonFile(sink, mode="w"), s.batches[0].schema) as w:
                for b in s.batches:
                    w.write_batch(b)
            parts += sink.parts
            rows.append(
                StreamInfo(
                    sid,
                    s.slot,
                    s.fingerprint,
                    pos,
                    sink.size,
                    sum(b.num_rows for b in s.batches),
                    len(s.batches),
                )
            )
            pos += sink.size
        pad = -pos % ALIGN
        if pad:
            parts.append(b"\0" * pad)
            pos += pad
        directory = _ipc(_directory_batch(rows))
        manifest = _ipc(_manifest_batch(self._manifest))
        dir_off = pos
        man_off = dir_off + directory.size
        parts += [directory, manifest]
        footer = FOOTER.pack(
            SEGMENT_VERSION,
            len(rows),
            len(self._manifest),
            dir_off,
            directory.size,
            man_off,
            manifest.size,
        )
        trailer_head = TRAILER_HEAD.pack(len(footer), SEGMENT_MAGIC)
        parts += [footer, trailer_head]
        crc = 0
        for p in parts:
            crc = crc32(p if isinstance(p, bytes) else memoryview(p), crc)
        parts.append(U32.pack(crc))
        return parts


class _PartsSink:
    """A write-only file (for ``pa.PythonFile``) that keeps every write as a part.

    Arrow hands the batches' body buffers over as ``pa.Buffer`` views of their memory,
    so a segment's stream files are never copied into one growing buffer (that copy
    cost ~0.2 s per 32 MiB segment here: more than writing the file)."""

    __slots__ = ("closed", "parts", "size")

    def __init__(self) -> None:
        self.parts: list[bytes | pa.Buffer] = []
        self.size = 0
        self.closed = False

    def write(self, data: bytes | pa.Buffer) -> int:
        self.parts.append(data)
        self.size += len(data)
        return len(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def encode_segment(bundles: Iterable[SegmentBundle]) -> bytes:
    b = SegmentBuilder()
    for x in bundles:
        b.add(x)
    return b"".join(p if isinstance(p, bytes) else p.to_pybytes() for p in b.finish())


def _ipc(batch: pa.RecordBatch) -> pa.Buffer:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    return sink.getvalue()


def _directory_batch(rows: Sequence[StreamInfo]) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays(
        [
            pa.array([r.stream_id for r in rows], pa.uint32()),
            pa.array([r.slot_id for r in rows], pa.uint16()),
            pa.array([r.schema_fingerprint for r in rows], pa.binary(32)),
            pa.array([r.byte_offset for r in rows], pa.uint64()),
            pa.array([r.byte_length for r in rows], pa.uint64()),
            pa.array([r.row_count for r in rows], pa.uint64()),
            pa.array([r.chunk_count for r in rows], pa.uint32()),
        ],
        schema=DIRECTORY_SCHEMA,
    )


def _manifest_batch(
    entries: Sequence[tuple[list[tuple[int, int, int]], int, int]],
) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays(
        [
            pa.array(range(len(entries)), pa.uint32()),
            pa.array(
                [
                    [{"slot_id": s, "stream_id": i, "chunk_index": c} for s, i, c in refs]
                    for refs, _, _ in entries
                ],
                pa.list_(SLOT_REF),
            ),
            pa.array([ts for _, ts, _ in entries], pa.int64()),
            pa.array([seq for _, _, seq in entries], pa.uint64()),
        ],
        schema=MANIFEST_SCHEMA,
    )


# --- decoding -------------------------------------------------------------------

MANIFEST_FORMS: dict[tuple[str, ...], str] = {
    ("bundle_index", "slot_refs"): "Quiver",
    ("bundle_index", "item_count", "slot_refs"): "otel-arrow Quiver with item counts",
    ("bundle_index", "slot_refs", "ingestion_ts_nanos", "sequence"): "tieredbuf",
}
"""The batch manifest column sets a reader accepts, by column names in order: the
spec's two columns, otel-arrow's writer's optional ``item_count`` (read and ignored),
and the richer form tieredbuf writes."""
_MANIFEST_TYPES: dict[str, pa.DataType] = {f.name: f.type for f in MANIFEST_SCHEMA}
_MANIFEST_TYPES["item_count"] = pa.uint64()
_IPC_FILE_MAGIC = b"ARROW1"

RefRows = list[tuple[tuple[tuple[int, int, int], ...], int | None, int | None]]
"""Batch manifest rows: ``((slot, stream_id, chunk_index), ...), ts, sequence``."""


def _has_nulls(arr: pa.Array) -> bool:
    """Any null in ``arr`` or in its children (all of them, referenced or not).

    ``.values``, never ``.flatten()``: pyarrow 26's ``validate(full=True)`` accepts an
    empty list array whose first offset is past its (empty) child, and ``flatten()``
    then slices out of bounds and aborts the process (found by the segment fuzzer)."""
    if arr.null_count:
        return True
    if isinstance(arr, pa.ListArray):
        return _has_nulls(arr.values)
    if isinstance(arr, pa.StructArray):
        return any(_has_nulls(arr.field(i)) for i in range(arr.type.num_fields))
    return False


def _same_type(a: pa.DataType, b: pa.DataType) -> bool:
    """Equal types, ignoring nullability and a list's item field name (Quiver declares
    every field non-nullable; pyarrow's defaults are nullable)."""
    if pa.types.is_list(a) and pa.types.is_list(b):
        return _same_type(a.value_type, b.value_type)
    if pa.types.is_struct(a) and pa.types.is_struct(b):
        return a.num_fields == b.num_fields and all(
            a.field(i).name == b.field(i).name and _same_type(a.field(i).type, b.field(i).type)
            for i in range(a.num_fields)
        )
    return bool(a.equals(b))


def _schema_ok(name: str, schema: pa.Schema) -> bool:
    if name == "stream directory":
        expected = [(f.name, f.type) for f in DIRECTORY_SCHEMA]
    elif tuple(schema.names) in MANIFEST_FORMS:
        expected = [(n, _MANIFEST_TYPES[n]) for n in schema.names]
    else:
        return False
    return len(schema) == len(expected) and all(
        f.name == n and _same_type(f.type, t) for f, (n, t) in zip(schema, expected, strict=True)
    )


def read_section(buf: pa.Buffer, off: int, obj: str | None, name: str, rows: int) -> pa.RecordBatch:
    """The stream directory or batch manifest held in ``buf`` (which starts at segment
    offset ``off``): one Arrow IPC batch -- the IPC stream format tieredbuf writes, or the
    IPC file format (the spec says only "Arrow IPC"; otel-arrow's writer uses files) --
    fully validated before any value is read, with ``rows`` rows, no nulls, and a
    schema the spec allows (nullable or not).  CorruptError naming ``obj`` and ``off``."""
    try:
        if bytes(memoryview(buf)[:6]) == _IPC_FILE_MAGIC:
            f = pa.ipc.open_file(buf)
            batches = [f.get_batch(i) for i in range(f.num_record_batches)]
        else:
            batches = list(pa.ipc.open_stream(buf))
        for b in batches:
            b.validate(full=True)  # offsets checked before any value is touched
        ok = (
            len(batches) == 1
            and _schema_ok(name, batches[0].schema)
            and batches[0].num_rows == rows
            and not any(_has_nulls(c) for c in batches[0].columns)
        )
    except Exception as e:  # any failure decoding untrusted Arrow bytes (I7)
        raise CorruptError(WHAT, obj, off, f"{name}: {describe_error(e)}") from e
    if not ok:
        raise CorruptError(
            WHAT, obj, off, f"{name}: schema, row count or nulls disagree with the footer"
        )
    return batches[0]


def directory_rows(b: pa.RecordBatch, off: int, obj: str | None) -> tuple[StreamInfo, ...]:
    """The directory's rows; each stream must lie before the directory (at ``off``)."""
    cols = [b.column(f.name).to_pylist() for f in DIRECTORY_SCHEMA]
    out = []
    for i, row in enumerate(zip(*cols, strict=True)):
        info = StreamInfo(*row)
        if info.stream_id != i or info.byte_offset + info.byte_length > off:
            raise CorruptError(WHAT, obj, off, f"stream directory row {i} is inconsistent")
        out.append(info)
    return tuple(out)


def manifest_rows(
    b: pa.RecordBatch, streams: Sequence[StreamInfo], off: int, obj: str | None
) -> RefRows:
    """The manifest's rows, each ref checked against the directory (``off``: where the
    manifest starts, named in errors)."""
    names = b.schema.names
    idx = b.column("bundle_index").to_pylist()
    refs = b.column("slot_refs").to_pylist()
    rich = "sequence" in names
    tss = b.column("ingestion_ts_nanos").to_pylist() if rich else [None] * b.num_rows
    seqs = b.column("sequence").to_pylist() if rich else [None] * b.num_rows
    out: RefRows = []
    used: list[set[int]] = [set() for _ in streams]
    for i in range(b.num_rows):
        if idx[i] != i:
            raise CorruptError(WHAT, obj, off, f"batch manifest row {i} is inconsistent")
        rr = []
        for r in refs[i]:
            sid, slot, chunk = r["stream_id"], r["slot_id"], r["chunk_index"]
            if (
                sid >= len(streams)
                or streams[sid].slot_id != slot
                or chunk >= streams[sid].chunk_count
            ):
                raise CorruptError(WHAT, obj, off, f"bundle {i} refers to a missing stream chunk")
            if chunk in used[sid]:  # its rows would be delivered twice
                raise CorruptError(WHAT, obj, off, f"stream {sid} chunk {chunk} is in two bundles")
            rr.append((slot, sid, chunk))
            used[sid].add(chunk)
        out.append((tuple(rr), tss[i], seqs[i]))
    for sid, s in enumerate(streams):
        # a writer puts every chunk in exactly one bundle (chunk indexes follow arrival)
        if len(used[sid]) != s.chunk_count:
            raise CorruptError(
                WHAT,
                obj,
                off,
                f"stream {sid} has {s.chunk_count} chunks, the manifest refers to {len(used[sid])}",
            )
    return out


def check_crc(data: pa.Buffer | bytes | memoryview, obj: str | None = None) -> None:
    """CorruptError unless the trailer's CRC32 matches every byte before it (a segment of
    at least its trailer's size; :class:`SegmentReader` checks the rest)."""
    view = memoryview(data)
    n = len(view)
    if n < TRAILER_SIZE:
        raise CorruptError(WHAT, obj, 0, f"truncated: {n} bytes cannot hold the trailer")
    (stored,) = U32.unpack_from(view, n - 4)
    actual = crc32(view[: n - 4], 0)
    if stored != actual:
        raise CorruptError(
            WHAT, obj, n - 4, f"CRC mismatch: stored {stored:#010x}, computed {actual:#010x}"
        )


class SegmentReader:
    """Parses and validates a segment held in ``data`` (a ``pa.Buffer`` over a memory
    map keeps every batch zero-copy).  Raises CorruptError naming ``obj`` and the offset."""

    def __init__(
        self,
        data: pa.Buffer | bytes | memoryview,
        obj: str | None = None,
        verify_crc: bool = True,
    ) -> None:
        self.buf = data if isinstance(data, pa.Buffer) else pa.py_buffer(data)
        self.obj = obj
        self.crc_verified = verify_crc
        view = memoryview(self.buf)
        n = len(view)
        if n < TRAILER_SIZE + FOOTER_V1_SIZE:
            raise self._fail(0, f"truncated: {n} bytes cannot hold footer and trailer")
        t_at = n - TRAILER_SIZE
        footer_size, magic = TRAILER_HEAD.unpack_from(view, t_at)
        if magic != SEGMENT_MAGIC:
            raise self._fail(t_at + 4, f"bad trailer magic {magic!r}")
        if verify_crc:
            check_crc(view, obj)
        if not 2 <= footer_size <= t_at:
            raise self._fail(t_at, f"footer_size {footer_size} out of range")
        f_at = t_at - footer_size
        (version,) = struct.unpack_from("<H", view, f_at)
        if version != SEGMENT_VERSION:
            raise UnsupportedVersionError(WHAT, obj, f_at, f"unknown footer version {version}")
        if footer_size < FOOTER_V1_SIZE:
            raise self._fail(t_at, f"footer_size {footer_size} < {FOOTER_V1_SIZE}")
        (_, stream_count, bundle_count, dir_off, dir_len, man_off, man_len) = FOOTER.unpack_from(
            view, f_at
        )
        self.stream_count = stream_count
        self.bundle_count = bundle_count
        d = self._section(dir_off, dir_len, f_at, 10, "stream directory", stream_count)
        self.streams = directory_rows(d, dir_off, obj)
        m = self._section(man_off, man_len, f_at, 22, "batch manifest", bundle_count)
        self._manifest = manifest_rows(m, self.streams, man_off, obj)
        self._files: dict[int, pa.ipc.RecordBatchFileReader] = {}

    def _fail(self, offset: int, detail: str) -> CorruptError:
        return CorruptError(WHAT, self.obj, offset, detail)

    def _section(
        self, off: int, length: int, f_at: int, field_at: int, name: str, rows: int
    ) -> pa.RecordBatch:
        if off + length > f_at:  # named at the footer field that says so
            raise self._fail(f_at + field_at, f"{name} [{off}, {off + length}) runs past {f_at}")
        return read_section(self.buf.slice(off, length), off, self.obj, name, rows)

    def _file(self, sid: int) -> pa.ipc.RecordBatchFileReader:
        f = self._files.get(sid)
        if f is None:
            s = self.streams[sid]
            try:
                f = pa.ipc.open_file(self.buf.slice(s.byte_offset, s.byte_length))
                ok = (
                    f.num_record_batches == s.chunk_count
                    and schema_fingerprint(f.schema) == s.schema_fingerprint
                )
            except Exception as e:  # any failure decoding untrusted Arrow bytes (I7)
                raise self._fail(s.byte_offset, f"stream {sid}: {describe_error(e)}") from e
            if not ok:
                raise self._fail(s.byte_offset, f"stream {sid} disagrees with the directory")
            self._files[sid] = f
        return f

    def _chunk(self, sid: int, chunk: int) -> pa.RecordBatch:
        try:
            batch = self._file(sid).get_batch(chunk)
            if not self.crc_verified:
                batch.validate(full=True)
            return batch
        except Exception as e:  # any failure decoding untrusted Arrow bytes (I7)
            at = self.streams[sid].byte_offset
            raise self._fail(at, f"stream {sid}: {describe_error(e)}") from e

    def bundles(self, slots: Iterable[int] | None = None) -> list[SegmentBundle]:
        """Every bundle in ingestion order, hydrating only ``slots`` (all when None)."""
        want = None if slots is None else frozenset(slots)
        return [
            SegmentBundle(
                {
                    slot: self._chunk(sid, chunk)
                    for slot, sid, chunk in refs
                    if want is None or slot in want
                },
                ts,
                seq,
            )
            for refs, ts, seq in self._manifest
        ]


def decode_segment(
    data: pa.Buffer | bytes | memoryview,
    obj: str | None = None,
    slots: Iterable[int] | None = None,
) -> list[SegmentBundle]:
    return SegmentReader(data, obj).bundles(slots)
