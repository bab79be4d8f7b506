"""An announcement ``queue/pending/<producer id>.<first producer seq:020>`` (pure codec).

A writer whose data objects are uploaded announces them here instead of appending them
itself; whoever holds the commit lease appends every pending announcement in one CAS of
the root (cross-writer group commit, docs/architecture.md "Fan-in").  One announcement
holds one writer's consecutive appends, in producer-sequence order.  Layout
(docs/format.md), little-endian::

    magic "TBA1", version u16 = 1
    producer_id_len u8, producer_id (UTF-8)
    created_ms i64                      the writer's clock when it announced
    count u32, count x entry:
        producer_seq u64                strictly increasing within the announcement
        location_len u16, location      the data object's key (data/<ULID>.batch|.qseg)
        size u64                        its length in bytes
        metadata_count u32, metadata_count x
            (start_index u32, ingestion_time_ms i64, payload_len u32, payload)
    crc32 u32                           zlib.crc32 of every byte before it

The decoder checks the magic, the version, every length against the bytes that remain
before it allocates, the order of producer sequences, and the CRC (I7).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from tieredbuf.errors import CorruptError, UnsupportedVersionError
from tieredbuf.format._reader import Reader
from tieredbuf.format.manifest import MetadataItem

MAGIC = b"TBA1"
VERSION = 1
WHAT = "announcement"
MAX_ENTRIES = 1 << 16
"""At most this many appends in one announcement."""
_HEAD = struct.Struct("<4sH")
_ITEM = struct.Struct("<IqI")


@dataclass(frozen=True, slots=True)
class Announced:
    """One announced append: what the committer writes as a queue entry."""

    producer_seq: int
    location: str
    size: int
    metadata: tuple[MetadataItem, ...]


@dataclass(frozen=True, slots=True)
class Announcement:
    producer_id: str
    created_ms: int
    entries: tuple[Announced, ...]

    @property
    def first_seq(self) -> int:
        return self.entries[0].producer_seq

    @property
    def last_seq(self) -> int:
        return self.entries[-1].producer_seq


def encode(a: Announcement) -> bytes:
    pid = a.producer_id.encode("utf-8")
    if not pid or len(pid) > 0xFF:
        raise ValueError("producer id must be 1..255 bytes")
    if not a.entries or len(a.entries) > MAX_ENTRIES:
        raise ValueError(f"an announcement holds 1..{MAX_ENTRIES} appends")
    out = [
        _HEAD.pack(MAGIC, VERSION),
        bytes([len(pid)]),
        pid,
        struct.pack("<qI", a.created_ms, len(a.entries)),
    ]
    last = 0
    for e in a.entries:
        if e.producer_seq <= last:
            raise ValueError("producer sequences must start at 1 and strictly increase")
        last = e.producer_seq
        loc = e.location.encode("utf-8")
        if len(loc) > 0xFFFF:
            raise ValueError("location longer than 65535 bytes")
        out.append(struct.pack("<QH", e.producer_seq, len(loc)) + loc)
        out.append(struct.pack("<QI", e.size, len(e.metadata)))
        for m in e.metadata:
            out.append(_ITEM.pack(m.start_index, m.ingestion_time_ms, len(m.payload)) + m.payload)
    body = b"".join(out)
    return body + struct.pack("<I", zlib.crc32(body))


def decode(raw: bytes | memoryview, obj: str | None = None) -> Announcement:
    """Decode an announcement; CorruptError (naming ``obj`` and the offset) on bad bytes."""
    view = memoryview(raw)
    n = len(view)
    if n < _HEAD.size + 4:
        raise CorruptError(WHAT, obj, 0, f"truncated: {n} bytes")
    magic, version = _HEAD.unpack_from(view, 0)
    if magic != MAGIC:
        raise CorruptError(WHAT, obj, 0, f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise UnsupportedVersionError(WHAT, obj, 4, f"unknown version {version}")
    (crc,) = struct.unpack_from("<I", view, n - 4)
    if zlib.crc32(view[: n - 4]) != crc:
        raise CorruptError(WHAT, obj, n - 4, "CRC mismatch")
    r = Reader(view, WHAT, obj, _HEAD.size, n - 4)
    pid = _utf8(r, r.u8("producer id length"), "producer id")
    if not pid:
        raise r.fail("empty producer id")
    created = r.i64("created_ms")
    count = r.u32("entry count")
    # each entry takes at least 8 + 2 + 8 + 4 bytes: a count that cannot fit is refused
    if count == 0 or count > MAX_ENTRIES or count * 22 > r.remaining():
        raise r.fail(f"entry count {count} cannot fit")
    entries: list[Announced] = []
    last = 0
    for i in range(count):
        at = r.pos
        pseq = r.u64(f"entry {i} producer_seq")
        if pseq <= last:
            raise CorruptError(WHAT, obj, at, f"producer_seq {pseq} out of order")
        last = pseq
        loc = _utf8(r, r.u16(f"entry {i} location length"), f"entry {i} location")
        size = r.u64(f"entry {i} size")
        k = r.u32(f"entry {i} metadata count")
        if k * _ITEM.size > r.remaining():
            raise CorruptError(WHAT, obj, r.pos, f"metadata count {k} cannot fit")
        items: list[MetadataItem] = []
        for j in range(k):
            start = r.u32(f"entry {i} metadata {j} start index")
            when = r.i64(f"entry {i} metadata {j} ingestion time")
            payload = bytes(
                r.take(r.u32(f"entry {i} metadata {j} length"), f"entry {i} metadata {j} payload")
            )
            items.append(MetadataItem(start, when, payload))
        entries.append(Announced(pseq, loc, size, tuple(items)))
    if r.remaining():
        raise r.fail(f"{r.remaining()} bytes after {count} entries")
    return Announcement(pid, created, tuple(entries))


def make(producer_id: str, created_ms: int, entries: Sequence[Announced]) -> Announcement:
    return Announcement(producer_id, created_ms, tuple(entries))


def _utf8(r: Reader, n: int, field: str) -> str:
    at = r.pos
    b = r.take(n, field)
    try:
        return bytes(b).decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorruptError(WHAT, r.obj, at, f"{field} is not UTF-8") from e
