"""Quiver WAL byte layout (otel-arrow's Quiver; docs/format-local.md), plus one tieredbuf
entry type for opaque records.

Pure codec: bytes in, values out, typed errors; no I/O.  Everything is little-endian.

File header (v1, 38 bytes)::

    magic              [u8;10]  b"QUIVER\\0WAL"
    version            u16      1
    header_size        u16      38 (readers skip unknown trailing header bytes)
    segment_cfg_hash   [u8;16]  digest of the adapter layout contract
    wal_position_start u64      logical WAL position of this file's first entry byte

Entry (repeated until EOF)::

    u32 entry_len                  bytes from entry_type to the end of the body
                                   (neither the length itself nor the CRC)
    u8  entry_type                 0 = RecordBundle, 1 = checkpoint (reserved by Quiver),
                                   2 = Records (tieredbuf extension)
    i64 ingestion_ts_nanos
    u64 per_core_sequence
    body                           type-specific
    u32 crc32                      IEEE CRC32 over entry_type..body

RecordBundle body (type 0)::

    u64 slot_bitmap; then for every set bit n, ascending:
        u16 payload_type_id; [u8;32] schema_fingerprint; u32 row_count; u32 payload_len
        [u8;payload_len]  one Arrow IPC *streaming* payload holding the slot's batch

Records body (type 2, one ``produce(entries, metadata)`` call)::

    u32 metadata_len; [u8;metadata_len] metadata
    u32 record_count; record_count x ( u32 len; [u8;len] )

Logical positions: the entry at file offset ``off`` has WAL position
``wal_position_start + off - header_size``, so positions are stable across rotation
and purge (a new file's header carries the previous file's end position).
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, cast

import pyarrow as pa

from tieredbuf.errors import ConfigHashMismatchError, CorruptError, UnsupportedVersionError
from tieredbuf.format._reader import Reader
from tieredbuf.format.batch import interleave_lengths
from tieredbuf.format.crc import crc32

WAL_MAGIC = b"QUIVER\x00WAL"
WAL_VERSION = 1
WAL_HEADER_SIZE = 38
CFG_HASH_SIZE = 16
FINGERPRINT_SIZE = 32
MAX_SLOTS = 64

ENTRY_RECORD_BUNDLE = 0
ENTRY_CHECKPOINT = 1  # reserved by Quiver; never written by tieredbuf
ENTRY_RECORDS = 2

_HEADER = struct.Struct("<10sHH16sQ")
_PREFIX = struct.Struct("<I")
_ENTRY_HEAD = struct.Struct("<BqQ")  # type, ts, seq
_SLOT_META = struct.Struct("<H32sII")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
ENTRY_HEAD_SIZE = _ENTRY_HEAD.size  # 17
FRAME_OVERHEAD = _PREFIX.size + 4  # length prefix + CRC trailer
MAX_ENTRY_LEN = 0xFFFF_FFFF

WHAT = "WAL"


# --- header ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WalHeader:
    segment_cfg_hash: bytes
    wal_position_start: int
    version: int = WAL_VERSION
    header_size: int = WAL_HEADER_SIZE


def encode_header(segment_cfg_hash: bytes, wal_position_start: int) -> bytes:
    if len(segment_cfg_hash) != CFG_HASH_SIZE:
        raise ValueError("segment_cfg_hash must be 16 bytes")
    return _HEADER.pack(
        WAL_MAGIC, WAL_VERSION, WAL_HEADER_SIZE, segment_cfg_hash, wal_position_start
    )


def decode_header(
    data: bytes | memoryview, obj: str | None = None, expected_cfg_hash: bytes | None = None
) -> WalHeader:
    r = Reader(data, WHAT, obj)
    magic = bytes(r.take(len(WAL_MAGIC), "magic"))
    if magic != WAL_MAGIC:
        raise CorruptError(WHAT, obj, 0, f"bad magic {magic!r}")
    version = r.u16("version")
    if version != WAL_VERSION:
        raise UnsupportedVersionError(WHAT, obj, 10, f"unknown WAL version {version}")
    header_size = r.u16("header_size")
    if header_size < WAL_HEADER_SIZE:
        raise CorruptError(WHAT, obj, 12, f"header_size {header_size} < {WAL_HEADER_SIZE}")
    cfg = bytes(r.take(CFG_HASH_SIZE, "segment_cfg_hash"))
    start = r.u64("wal_position_start")
    r.need(header_size - WAL_HEADER_SIZE, "header extension")
    if expected_cfg_hash is not None and cfg != expected_cfg_hash:
        raise ConfigHashMismatchError(
            WHAT,
            obj,
            14,
            f"segment_cfg_hash {cfg.hex()} != expected {expected_cfg_hash.hex()}: drain this "
            "WAL with the build that wrote it",
        )
    return WalHeader(cfg, start, version, header_size)


def segment_cfg_hash(layout_contract: bytes) -> bytes:
    """128-bit digest of the adapter-owned layout contract (BLAKE2b-128: Quiver suggests
    a truncated BLAKE3, which is not in the standard library)."""
    return hashlib.blake2b(layout_contract, digest_size=CFG_HASH_SIZE).digest()


def schema_fingerprint(schema: pa.Schema) -> bytes:
    """32-byte fingerprint of an Arrow schema: SHA-256 of its IPC serialization
    (field names, types, nullability, dictionary key types, metadata)."""
    return hashlib.sha256(schema.serialize().to_pybytes()).digest()


# --- entries --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SlotPayload:
    slot: int
    payload_type_id: int
    schema_fingerprint: bytes
    row_count: int
    payload: bytes | memoryview  # Arrow IPC streaming bytes


@dataclass(frozen=True, slots=True)
class WalEntry:
    """One decoded frame.  ``offset``/``size`` are the frame's file offset and
    on-disk size (prefix + body + CRC)."""

    entry_type: int
    ingestion_ts_nanos: int
    sequence: int
    offset: int
    size: int


@dataclass(frozen=True, slots=True)
class BundleEntry(WalEntry):
    slots: tuple[SlotPayload, ...]

    def to_bundle(self, obj: str | None = None) -> dict[int, pa.RecordBatch]:
        """Decode every slot's IPC payload back into a RecordBatch."""
        return {s.slot: decode_ipc_stream(s.payload, obj, self.offset) for s in self.slots}


@dataclass(frozen=True, slots=True)
class RecordsEntry(WalEntry):
    records: tuple[bytes, ...]
    metadata: bytes


@dataclass(frozen=True, slots=True)
class UnknownEntry(WalEntry):
    """An entry type this build does not interpret; skipped by its length."""


def encode_ipc_stream(batch: pa.RecordBatch) -> pa.Buffer:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    return sink.getvalue()


def describe_error(e: BaseException) -> str:
    """An exception's message; pyarrow may raise one whose text is not valid UTF-8."""
    try:
        return f"{type(e).__name__}: {e}"
    except Exception:
        return type(e).__name__


def decode_ipc_stream(
    payload: bytes | memoryview | pa.Buffer, obj: str | None, offset: int
) -> pa.RecordBatch:
    try:
        batches = list(pa.ipc.open_stream(pa.py_buffer(payload)))
        for b in batches:
            b.validate(full=True)
    except Exception as e:  # any failure decoding untrusted Arrow bytes (I7)
        raise CorruptError(WHAT, obj, offset, f"Arrow IPC payload: {describe_error(e)}") from e
    if len(batches) != 1:
        raise CorruptError(WHAT, obj, offset, f"slot payload holds {len(batches)} batches")
    return batches[0]


_COALESCE_PARTS = 8
_COALESCE_MEAN = 4096
"""Bodies of more than 8 parts averaging under 4 KiB are joined into one buffer: one
CRC call (which releases the GIL above 5 KiB) and one iovec instead of one per part."""
_JOIN_RUN = 8192
"""Parts per ``bytes.join`` when coalescing.  A join holds an 80-byte ``Py_buffer``
per part while it runs: 16 MB besides the body itself for a produce() call of
100,000 tiny records (200,000 parts).  Longer bodies are joined run by run into one
buffer allocated up front, holding 640 KB of them at a time."""


def _coalesce(parts: Sequence[bytes | memoryview | pa.Buffer], n: int) -> bytes | memoryview:
    """``b"".join(parts)`` (``n`` bytes) without a transient cost per part."""
    if len(parts) <= _JOIN_RUN:
        return b"".join(parts)
    out = bytearray(n)
    pos = 0
    for i in range(0, len(parts), _JOIN_RUN):
        run = b"".join(parts[i : i + _JOIN_RUN])
        out[pos : pos + len(run)] = run
        pos += len(run)
    return memoryview(out)


@dataclass(frozen=True, slots=True)
class EntryBody:
    """An entry's sequence-independent bytes (everything after the 17-byte head), with
    their length and CRC32.  Encode it before taking a lock; :func:`frame_entry` then
    adds the head and combines the CRCs in O(log n), so no lock holder reads the body."""

    entry_type: int
    parts: tuple[bytes | memoryview, ...]
    size: int
    crc: int


def entry_body(entry_type: int, parts: Sequence[bytes | memoryview | pa.Buffer]) -> EntryBody:
    n = sum(map(len, parts))
    if n + ENTRY_HEAD_SIZE > MAX_ENTRY_LEN:
        raise ValueError(f"WAL entry of {n + ENTRY_HEAD_SIZE} bytes exceeds the u32 length field")
    views: tuple[bytes | memoryview, ...]
    if len(parts) > _COALESCE_PARTS and n < len(parts) * _COALESCE_MEAN:
        views = (_coalesce(parts, n),)
    else:
        views = tuple(p if isinstance(p, (bytes, memoryview)) else memoryview(p) for p in parts)
    crc = 0
    for v in views:
        crc = crc32(v, crc)
    return EntryBody(entry_type, views, n, crc)


def frame_entry(
    sequence: int, ingestion_ts_nanos: int, body: EntryBody
) -> list[bytes | memoryview]:
    """The whole frame (prefix, head, body, CRC) as buffers for ``os.writev``."""
    head = _ENTRY_HEAD.pack(body.entry_type, ingestion_ts_nanos, sequence)
    crc = crc32_combine(zlib.crc32(head), body.crc, body.size)
    return [_PREFIX.pack(ENTRY_HEAD_SIZE + body.size), head, *body.parts, _U32.pack(crc)]


def records_body(records: Sequence[bytes | memoryview], metadata: bytes | memoryview) -> EntryBody:
    """The body of a Records entry (type 2): metadata, then the length-prefixed records."""
    head: list[bytes | memoryview | pa.Buffer] = [
        _U32.pack(len(metadata)),
        metadata,
        _U32.pack(len(records)),
    ]
    return entry_body(ENTRY_RECORDS, head + interleave_lengths(records))


def records_block(body: EntryBody, metadata: bytes | memoryview) -> memoryview | None:
    """The records of a coalesced Records body as ``u32 len, bytes`` pairs -- exactly
    RFC 0001's uncompressed record block -- as a view (None if not coalesced)."""
    if body.entry_type != ENTRY_RECORDS or len(body.parts) != 1:
        return None
    return memoryview(body.parts[0])[8 + len(metadata) :]


def encode_bundle_entry(
    sequence: int, ingestion_ts_nanos: int, bundle: Mapping[int, pa.RecordBatch]
) -> list[bytes | memoryview]:
    """A RecordBundle entry as a list of buffers (for os.writev); join for bytes.
    ``payload_type_id`` is the slot id."""
    return frame_bundle_entry(sequence, ingestion_ts_nanos, bundle_body(bundle))


def bundle_body(bundle: Mapping[int, pa.RecordBatch]) -> list[bytes | pa.Buffer]:
    """The sequence-independent part of a RecordBundle entry (bitmap, slot metadata,
    IPC payloads): encode it before taking a lock, frame it under the lock."""
    bitmap = 0
    for slot in bundle:
        if not 0 <= slot < MAX_SLOTS:
            raise ValueError(f"slot id {slot} outside 0..{MAX_SLOTS - 1}")
        bitmap |= 1 << slot
    parts: list[bytes | pa.Buffer] = [_U64.pack(bitmap)]
    for slot in sorted(bundle):
        batch = bundle[slot]
        payload = encode_ipc_stream(batch)
        parts.append(
            _SLOT_META.pack(slot, schema_fingerprint(batch.schema), batch.num_rows, payload.size)
        )
        parts.append(payload)
    return parts


def frame_bundle_entry(
    sequence: int, ingestion_ts_nanos: int, body: Sequence[bytes | pa.Buffer]
) -> list[bytes | memoryview]:
    return frame_entry(sequence, ingestion_ts_nanos, entry_body(ENTRY_RECORD_BUNDLE, body))


def encode_records_entry(
    sequence: int,
    ingestion_ts_nanos: int,
    records: Sequence[bytes | memoryview],
    metadata: bytes | memoryview,
) -> list[bytes | memoryview]:
    """A Records entry (type 2) as a list of buffers."""
    return frame_entry(sequence, ingestion_ts_nanos, records_body(records, metadata))


def decode_entry(view: memoryview, offset: int, obj: str | None = None) -> WalEntry:
    """Decode the complete frame at ``offset`` (raises CorruptError on any defect)."""
    r = Reader(view, WHAT, obj, offset)
    n = r.u32("entry_len")
    if n < ENTRY_HEAD_SIZE:
        raise CorruptError(WHAT, obj, offset, f"entry_len {n} < {ENTRY_HEAD_SIZE}")
    body_at = r.pos
    body = r.take(n, "entry body")
    stored = r.u32("entry crc32")
    actual = crc32(body, 0)
    if stored != actual:
        raise CorruptError(
            WHAT, obj, offset, f"entry CRC mismatch: stored {stored:#010x}, computed {actual:#010x}"
        )
    size = r.pos - offset
    b = Reader(view, WHAT, obj, body_at, body_at + n)
    etype = b.u8("entry_type")
    ts = b.i64("ingestion_ts_nanos")
    seq = b.u64("per_core_sequence")
    if etype == ENTRY_RECORD_BUNDLE:
        slots = _decode_bundle_body(b)
        return BundleEntry(etype, ts, seq, offset, size, slots)
    if etype == ENTRY_RECORDS:
        records, metadata = _decode_records_body(b)
        return RecordsEntry(etype, ts, seq, offset, size, records, metadata)
    return UnknownEntry(etype, ts, seq, offset, size)


def _decode_bundle_body(b: Reader) -> tuple[SlotPayload, ...]:
    bitmap = b.u64("slot_bitmap")
    out: list[SlotPayload] = []
    for slot in range(MAX_SLOTS):
        if not bitmap >> slot & 1:
            continue
        b.need(_SLOT_META.size, f"slot {slot} metadata")
        ptype, fp, rows, plen = _SLOT_META.unpack_from(b.buf, b.pos)
        b.pos += _SLOT_META.size
        payload = b.take(plen, f"slot {slot} payload")
        out.append(SlotPayload(slot, ptype, bytes(fp), rows, payload))
    if b.remaining():
        raise b.fail(f"{b.remaining()} trailing bytes after the last slot")
    return tuple(out)


def _decode_records_body(b: Reader) -> tuple[tuple[bytes, ...], bytes]:
    mlen = b.u32("metadata_len")
    metadata = bytes(b.take(mlen, "metadata"))
    count = b.u32("record_count")
    if count * _U32.size > b.remaining():
        raise b.fail(f"record_count {count} cannot fit in {b.remaining()} bytes")
    # Reader.u32/take inlined: field names are formatted only on failure (the per-record
    # f-strings and method calls were most of a records replay's time)
    buf, pos, end = b.buf, b.pos, b.end
    # slicing the bytes under a whole-object view copies once (a view slice, then bytes())
    src = buf.obj if type(buf.obj) is bytes and buf.nbytes == len(buf.obj) else None
    unpack = _U32.unpack_from
    records = []
    for i in range(count):
        if end - pos < 4:
            b.pos = pos
            b.need(4, f"record {i} length")
        (n,) = unpack(buf, pos)
        pos += 4
        if n > end - pos:
            b.pos = pos
            b.need(n, f"record {i}")
        records.append(src[pos : pos + n] if src is not None else bytes(buf[pos : pos + n]))
        pos += n
    b.pos = pos
    if b.remaining():
        raise b.fail(f"{b.remaining()} trailing bytes after {count} records")
    return tuple(records), metadata


# --- CRC32 of a concatenation -----------------------------------------------------
# crc32(a + b) from crc32(a), crc32(b) and len(b) (zlib's crc32_combine): the head of
# an entry (type, timestamp, sequence) comes *before* the body in the CRC, so without
# this the body could only be CRC'd once its sequence was known, under the stage lock.

_POLY = 0xEDB88320  # IEEE, bit-reflected


def _multmodp(a: int, b: int) -> int:
    """a(x) * b(x) modulo the CRC polynomial (reflected bit order), as zlib does it."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                break
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


def _x2n_table() -> tuple[int, ...]:
    t = [1 << 30]  # x^1
    for _ in range(31):
        t.append(_multmodp(t[-1], t[-1]))
    return tuple(t)


_X2N = _x2n_table()


def crc32_combine_py(crc1: int, crc2: int, len2: int) -> int:
    """Pure-Python crc32_combine (zlib 1.2.12's x^(8*len2) mod p method)."""
    p = 1 << 31  # x^0
    k = 3
    n = len2
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc1) ^ crc2


def _zlib_combine() -> Callable[[int, int, int], int] | None:
    """libz's crc32_combine through ctypes (~1 us a call vs ~30 us in Python)."""
    try:
        import ctypes
        import ctypes.util

        lib = ctypes.CDLL(ctypes.util.find_library("z") or "libz.so.1")
        fn = getattr(lib, "crc32_combine64", None)
        if fn is None:
            fn = lib.crc32_combine
            fn.argtypes = [ctypes.c_ulong, ctypes.c_ulong, ctypes.c_long]
        else:
            fn.argtypes = [ctypes.c_ulong, ctypes.c_ulong, ctypes.c_int64]
        fn.restype = ctypes.c_ulong
    except (OSError, AttributeError):
        return None
    for a, b in ((b"head", b"body"), (b"\x00" * 17, b"\xff" * 70_001)):
        if fn(zlib.crc32(a), zlib.crc32(b), len(b)) & 0xFFFF_FFFF != zlib.crc32(a + b):
            return None
    return cast("Callable[[int, int, int], int]", fn)


crc32_combine: Callable[[int, int, int], int] = _zlib_combine() or crc32_combine_py
"""crc32(a + b) == crc32_combine(crc32(a), crc32(b), len(b))."""

# --- scanning -------------------------------------------------------------------

ScanStatus = Literal["clean", "torn", "corrupt"]


@dataclass(frozen=True, slots=True)
class ScanResult:
    """``entries`` decoded up to ``good_end`` (a file offset).

    * ``clean``   -- every byte decoded.
    * ``torn``    -- the bytes from ``good_end`` to EOF are an incomplete or damaged
      last frame (a crash mid-append): truncate the file to ``good_end``.
    * ``corrupt`` -- a damaged frame is followed by more bytes: this is not a torn
      write, and truncating would silently drop later (acknowledged) entries.
    """

    header: WalHeader
    entries: tuple[WalEntry, ...]
    good_end: int
    status: ScanStatus
    error: CorruptError | None


def scan(
    data: bytes | memoryview, obj: str | None = None, expected_cfg_hash: bytes | None = None
) -> ScanResult:
    """Decode a whole WAL file, classifying any damage.  A bad header always raises."""
    view = memoryview(data)
    header = decode_header(view, obj, expected_cfg_hash)
    entries: list[WalEntry] = []
    off = header.header_size
    end = len(view)
    while off < end:
        try:
            entries.append(decode_entry(view, off, obj))
        except CorruptError as e:
            status: ScanStatus = "torn" if _reaches_eof(view, off) else "corrupt"
            return ScanResult(header, tuple(entries), off, status, e)
        off += entries[-1].size
    return ScanResult(header, tuple(entries), off, "clean", None)


def _reaches_eof(view: memoryview, off: int) -> bool:
    """Does the damaged frame at ``off`` run to the end of the file?"""
    remaining = len(view) - off
    if remaining < _PREFIX.size:
        return True
    n = int(_PREFIX.unpack_from(view, off)[0])
    if n == 0:  # zero-filled tail (blocks allocated, data never written)
        return view[off:].tobytes().count(0) == remaining
    return off + _PREFIX.size + n + 4 >= len(view)


def decode_wal(
    data: bytes | memoryview, obj: str | None = None, expected_cfg_hash: bytes | None = None
) -> tuple[WalHeader, tuple[WalEntry, ...]]:
    """Strict decode: any damage, torn or not, raises CorruptError."""
    res = scan(data, obj, expected_cfg_hash)
    if res.error is not None:
        raise res.error
    return res.header, res.entries


def iter_positions(header: WalHeader, entries: Iterable[WalEntry]) -> Iterable[tuple[int, int]]:
    """(start, end) logical WAL positions of ``entries``."""
    base = header.wal_position_start - header.header_size
    for e in entries:
        yield base + e.offset, base + e.offset + e.size
