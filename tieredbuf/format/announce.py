"""An announcement ``queue/pending/<hub id>.<n>.<form>`` (pure codec; the form, which
spells a small one out in its key: format/spelled.py).

A writer whose data objects are uploaded announces them here instead of appending them
itself; whoever holds the commit lease appends every pending announcement in one CAS of
the root (cross-writer group commit, docs/architecture.md "Fan-in").  An announcement
holds *runs*: one writer's consecutive appends each, in producer-sequence order, and the
append the run follows (``after``: the writer's earlier append not yet confirmed in the
queue, 0 when every earlier one is).  The committer appends a run only once its writer's
watermark covers ``after`` (I10: a watermark never moves past an append that is not in).
Version 3 (what tieredbuf writes: one object per process and turn, however many writers
it carries) holds one or more runs of distinct writers; versions 2 (no ``after``: read
as 0) and 1 (one run; written before announcements were batched) are still read.
Layout (docs/format.md), little-endian::

    magic "TBA1", version u16 = 3
    created_ms i64                      the announcer's clock when it announced
    run_count u16 (1-65535), run_count x run:
        producer_id_len u8, producer_id (UTF-8; distinct within the announcement)
        after u64                       the append this run follows (0: none pending);
                                        below the run's first producer_seq
        count u32, count x entry:
            producer_seq u64            strictly increasing within the run
            location_len u16, location  the data object's key (data/<ULID>.batch|.qseg)
            size u64                    its length in bytes
            metadata_count u32, metadata_count x
                (start_index u32, ingestion_time_ms i64, payload_len u32, payload)
    crc32 u32                           zlib.crc32 of every byte before it

Version 2 is the same without ``after``.  Version 1 is ``magic, version u16 = 1,
producer_id_len u8, producer_id, created_ms i64, count u32, entries, crc32``: one run,
its producer id before the clock.

The decoder checks the magic, the version, every length against the bytes that remain
before it allocates, the order of producer sequences (``after`` below the first), and
the CRC (I7).
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
VERSION = 3
VERSION_NO_AFTER = 2
VERSION_ONE_RUN = 1
WHAT = "announcement"
MAX_ENTRIES = 1 << 16
"""At most this many appends in one run."""
MAX_RUNS = 0xFFFF
"""At most this many writers' runs in one announcement."""
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
    after: int = 0
    """The writer's append this run follows, not yet confirmed in the queue when it was
    announced (0: every earlier append of the writer was)."""

    @property
    def first_seq(self) -> int:
        return self.entries[0].producer_seq

    @property
    def last_seq(self) -> int:
        return self.entries[-1].producer_seq


def encode(runs: Sequence[Announcement], created_ms: int) -> bytes:
    """A version-3 announcement of ``runs`` (distinct writers), stamped ``created_ms``."""
    return _encode_runs(runs, created_ms, VERSION)


def encode_without_after(runs: Sequence[Announcement], created_ms: int) -> bytes:
    """A version-2 announcement (no ``after``): what tieredbuf wrote before version 3;
    kept to show that it is still read."""
    return _encode_runs(runs, created_ms, VERSION_NO_AFTER)


def _encode_runs(runs: Sequence[Announcement], created_ms: int, version: int) -> bytes:
    if not runs or len(runs) > MAX_RUNS:
        raise ValueError(f"an announcement holds 1..{MAX_RUNS} runs")
    if len({a.producer_id for a in runs}) != len(runs):
        raise ValueError("one run per writer in an announcement")
    out = [_HEAD.pack(MAGIC, version), struct.pack("<qH", created_ms, len(runs))]
    for a in runs:
        out.append(_pid(a.producer_id))
        if version == VERSION:
            if a.entries and not 0 <= a.after < a.entries[0].producer_seq:
                raise ValueError("a run follows an append below its first (after)")
            out.append(struct.pack("<Q", a.after))
        _encode_entries(out, a.entries)
    return _sealed(out)


def encode_one_run(a: Announcement) -> bytes:
    """A version-1 announcement (one run): what tieredbuf wrote before version 2; kept
    to show that it is still read."""
    out = [_HEAD.pack(MAGIC, VERSION_ONE_RUN), _pid(a.producer_id), struct.pack("<q", a.created_ms)]
    _encode_entries(out, a.entries)
    return _sealed(out)


def _pid(producer_id: str) -> bytes:
    pid = producer_id.encode("utf-8")
    if not pid or len(pid) > 0xFF:
        raise ValueError("producer id must be 1..255 bytes")
    return bytes([len(pid)]) + pid


def _encode_entries(out: list[bytes], entries: Sequence[Announced]) -> None:
    if not entries or len(entries) > MAX_ENTRIES:
        raise ValueError(f"a run holds 1..{MAX_ENTRIES} appends")
    out.append(struct.pack("<I", len(entries)))
    last = 0
    for e in entries:
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


def _sealed(out: list[bytes]) -> bytes:
    body = b"".join(out)
    return body + struct.pack("<I", zlib.crc32(body))


def decode(raw: bytes | memoryview, obj: str | None = None) -> tuple[Announcement, ...]:
    """The runs of an announcement (either version); CorruptError (naming ``obj`` and the
    offset) on bad bytes."""
    view = memoryview(raw)
    n = len(view)
    if n < _HEAD.size + 4:
        raise CorruptError(WHAT, obj, 0, f"truncated: {n} bytes")
    magic, version = _HEAD.unpack_from(view, 0)
    if magic != MAGIC:
        raise CorruptError(WHAT, obj, 0, f"bad magic {bytes(magic)!r}")
    if version not in (VERSION, VERSION_NO_AFTER, VERSION_ONE_RUN):
        raise UnsupportedVersionError(WHAT, obj, 4, f"unknown version {version}")
    (crc,) = struct.unpack_from("<I", view, n - 4)
    if zlib.crc32(view[: n - 4]) != crc:
        raise CorruptError(WHAT, obj, n - 4, "CRC mismatch")
    r = Reader(view, WHAT, obj, _HEAD.size, n - 4)
    runs: list[Announcement] = []
    if version == VERSION_ONE_RUN:
        pid = _read_pid(r)
        runs.append(Announcement(pid, r.i64("created_ms"), _decode_entries(r, "")))
    else:
        created = r.i64("created_ms")
        count = r.u16("run count")
        # each run takes at least 1 + 1 (+ 8) + 4 + 22 bytes: a count that cannot fit is
        # refused
        least = 28 if version == VERSION_NO_AFTER else 36
        if count == 0 or count * least > r.remaining():
            raise r.fail(f"run count {count} cannot fit")
        seen: set[str] = set()
        for i in range(count):
            at = r.pos
            pid = _read_pid(r)
            if pid in seen:
                raise CorruptError(WHAT, obj, at, f"a second run of {pid!r}")
            seen.add(pid)
            after, after_at = (r.u64(f"run {i} after"), r.pos) if version == VERSION else (0, 0)
            entries = _decode_entries(r, f"run {i} ")
            if after >= entries[0].producer_seq:
                raise CorruptError(
                    WHAT,
                    obj,
                    after_at - 8,
                    f"run {i} follows {after}, not below its first {entries[0].producer_seq}",
                )
            runs.append(Announcement(pid, created, entries, after))
    if r.remaining():
        raise r.fail(f"{r.remaining()} bytes after {len(runs)} run(s)")
    return tuple(runs)


def version_of(raw: bytes | memoryview) -> int:
    """The version an announcement that decoded says it is."""
    (version,) = struct.unpack_from("<H", raw, 4)
    return int(version)


def _read_pid(r: Reader) -> str:
    pid = _utf8(r, r.u8("producer id length"), "producer id")
    if not pid:
        raise r.fail("empty producer id")
    return pid


def _decode_entries(r: Reader, run: str) -> tuple[Announced, ...]:
    obj = r.obj
    count = r.u32(f"{run}entry count")
    # each entry takes at least 8 + 2 + 8 + 4 bytes: a count that cannot fit is refused
    if count == 0 or count > MAX_ENTRIES or count * 22 > r.remaining():
        raise r.fail(f"{run}entry count {count} cannot fit")
    entries: list[Announced] = []
    last = 0
    for i in range(count):
        at = r.pos
        pseq = r.u64(f"{run}entry {i} producer_seq")
        if pseq <= last:
            raise CorruptError(WHAT, obj, at, f"{run}producer_seq {pseq} out of order")
        last = pseq
        loc = _utf8(r, r.u16(f"{run}entry {i} location length"), f"{run}entry {i} location")
        size = r.u64(f"{run}entry {i} size")
        k = r.u32(f"{run}entry {i} metadata count")
        if k * _ITEM.size > r.remaining():
            raise CorruptError(WHAT, obj, r.pos, f"{run}metadata count {k} cannot fit")
        items: list[MetadataItem] = []
        for j in range(k):
            start = r.u32(f"{run}entry {i} metadata {j} start index")
            when = r.i64(f"{run}entry {i} metadata {j} ingestion time")
            payload = bytes(r.take(r.u32(f"{run}entry {i} metadata {j} length"), "payload"))
            items.append(MetadataItem(start, when, payload))
        entries.append(Announced(pseq, loc, size, tuple(items)))
    return tuple(entries)


def make(
    producer_id: str, created_ms: int, entries: Sequence[Announced], after: int = 0
) -> Announcement:
    return Announcement(producer_id, created_ms, tuple(entries), after)


def _utf8(r: Reader, n: int, field: str) -> str:
    at = r.pos
    b = r.take(n, field)
    try:
        return bytes(b).decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorruptError(WHAT, r.obj, at, f"{field} is not UTF-8") from e
