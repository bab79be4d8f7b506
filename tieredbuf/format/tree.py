"""Manifest tree codecs: the root's tree and stats sections, and immutable group nodes.

Pure: bytes in, values out, typed errors (I7).  Layouts (docs/format.md)::

    root section 3 (tree):  low_seq u64, head_seq u64, ref_count u32, ref_count x REF
    root section 4 (stats): count u32, count x (size u64, time_ms i64)   parallel to root entries
    REF (65 bytes):         level u8, first_seq u64, last_seq u64, count u64,
                            min_time_ms i64, max_time_ms i64, total_bytes u64, ulid 16 bytes

    node object queue/groups/<first_seq:020>.<ULID>.<group|kgroup|mgroup>:
      magic "TBG1", version u16 = 1, level u8, count u32, first_seq u64, body_len u32
      body: level 0 -- entries (RFC v1 entry bytes) then count x (size u64, time_ms i64)
            level n -- count x REF of level n - 1
      crc32 u32 (zlib.crc32 of every byte before it)

A REF's object key is rebuilt from (first_seq, ulid, level) by :func:`tieredbuf.keys.group_key`.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

from tieredbuf.errors import CorruptError, UnsupportedVersionError
from tieredbuf.format import manifest as fm
from tieredbuf.format._reader import Reader

KINDS = ("group", "kgroup", "mgroup")
MAX_LEVEL = len(KINDS) - 1
NODE_MAGIC = b"TBG1"
NODE_VERSION = 1
_REF = struct.Struct("<BQQQqqQ16s")
_STAT = struct.Struct("<Qq")
_TREE_HEAD = struct.Struct("<QQI")
_NODE_HEAD = struct.Struct("<4sHBIQI")
REF_SIZE = _REF.size
STAT_SIZE = _STAT.size
WHAT_NODE = "manifest tree node"
WHAT_ROOT = "queue manifest"


@dataclass(frozen=True, slots=True)
class Stat:
    """Object size and ingestion time (max over the entry's metadata) of one entry."""

    size: int
    time_ms: int


@dataclass(frozen=True, slots=True)
class Ref:
    """A reference to an immutable node covering sequences ``first..last``."""

    level: int
    first: int
    last: int
    count: int
    min_time_ms: int
    max_time_ms: int
    total_bytes: int
    ulid: bytes

    @property
    def kind(self) -> str:
        return KINDS[self.level]


@dataclass(frozen=True, slots=True)
class TreeState:
    """Section 3: the first readable sequence, the queue head, and the root's refs."""

    low: int
    head: int
    refs: tuple[Ref, ...] = ()


@dataclass(frozen=True, slots=True)
class Node:
    """A decoded group node. Level 0 keeps entries as a flat view (undecoded bytes)."""

    level: int
    first: int
    count: int
    entries: fm.ManifestView | None
    stats: tuple[Stat, ...]
    refs: tuple[Ref, ...]

    @property
    def last(self) -> int:
        return self.first + self.count - 1


def entry_time(metadata: tuple[fm.MetadataItem, ...], default_ms: int) -> int:
    """An entry's ingestion time: the latest of its metadata items, else ``default_ms``."""
    return max((m.ingestion_time_ms for m in metadata), default=default_ms)


# --- refs and stats ----------------------------------------------------------


# One-entry memos: consecutive root writes carry the same refs (only a rebalance or an
# unlink changes them), so the ~M refs are decoded and encoded once, not per append.
_last_decoded: tuple[bytes, tuple[Ref, ...]] = (b"", ())
_last_encoded: tuple[tuple[Ref, ...], bytes] = ((), b"")


def encode_refs(refs: tuple[Ref, ...] | list[Ref]) -> bytes:
    global _last_encoded
    memo_refs, memo_raw = _last_encoded
    if len(memo_refs) == len(refs) and all(a is b for a, b in zip(memo_refs, refs, strict=True)):
        return memo_raw
    raw = b"".join(
        _REF.pack(r.level, r.first, r.last, r.count, r.min_time_ms, r.max_time_ms,
                  r.total_bytes, r.ulid)
        for r in refs
    )
    _last_encoded = (tuple(refs), raw)
    return raw


def _decode_refs(buf: memoryview, n: int, what: str, obj: str | None, at: int) -> tuple[Ref, ...]:
    out: list[Ref] = []
    for i, t in enumerate(_REF.iter_unpack(buf[: n * REF_SIZE])):
        r = Ref(*t)
        off = at + i * REF_SIZE
        if r.level > MAX_LEVEL:
            raise CorruptError(what, obj, off, f"ref {i}: unknown level {r.level}")
        if r.last < r.first or r.count != r.last - r.first + 1:
            raise CorruptError(what, obj, off, f"ref {i}: count {r.count} != {r.first}..{r.last}")
        if out and out[-1].last + 1 != r.first:
            raise CorruptError(what, obj, off, f"ref {i}: starts at {r.first}, not contiguous")
        out.append(r)
    return tuple(out)


def encode_stats(stats: list[Stat] | tuple[Stat, ...]) -> bytes:
    return struct.pack("<I", len(stats)) + b"".join(_STAT.pack(s.size, s.time_ms) for s in stats)


def _decode_stat_array(buf: memoryview, n: int) -> tuple[Stat, ...]:
    return tuple(Stat(a, b) for a, b in _STAT.iter_unpack(buf[: n * STAT_SIZE]))


def decode_stats(body: bytes, obj: str | None = None) -> tuple[Stat, ...]:
    r = Reader(body, WHAT_ROOT, obj)
    n = r.u32("stats count")
    r.need(n * STAT_SIZE, "stats")
    if r.remaining() != n * STAT_SIZE:
        raise r.fail("stats section has trailing bytes")
    return _decode_stat_array(r.buf[r.pos :], n)


def encode_tree(state: TreeState) -> bytes:
    return _TREE_HEAD.pack(state.low, state.head, len(state.refs)) + encode_refs(state.refs)


def decode_tree(body: bytes, obj: str | None = None) -> TreeState:
    r = Reader(body, WHAT_ROOT, obj)
    low, head = r.u64("low_seq"), r.u64("head_seq")
    n = r.u32("ref count")
    r.need(n * REF_SIZE, "refs")
    if r.remaining() != n * REF_SIZE:
        raise r.fail("tree section has trailing bytes")
    if low > head:
        raise CorruptError(WHAT_ROOT, obj, 0, f"low_seq {low} > head_seq {head}")
    global _last_decoded
    raw_refs = bytes(r.buf[r.pos :])
    memo_raw, memo_refs = _last_decoded
    if memo_raw == raw_refs:
        return TreeState(low, head, memo_refs)
    refs = _decode_refs(memoryview(raw_refs), n, WHAT_ROOT, obj, r.pos)
    for i in range(1, len(refs)):
        if refs[i].level > refs[i - 1].level:
            raise CorruptError(WHAT_ROOT, obj, r.pos + i * REF_SIZE, "ref levels must not rise")
    _last_decoded = (raw_refs, refs)
    return TreeState(low, head, refs)


# --- nodes -------------------------------------------------------------------


def encode_node(
    level: int,
    first: int,
    *,
    entries_region: bytes | memoryview = b"",
    stats: list[Stat] | tuple[Stat, ...] = (),
    refs: list[Ref] | tuple[Ref, ...] = (),
) -> bytes:
    """A node object: level 0 holds ``entries_region`` + ``stats``; others hold ``refs``."""
    if level == 0:
        count = len(stats)
        body = b"".join((entries_region, *(_STAT.pack(s.size, s.time_ms) for s in stats)))
    else:
        count = len(refs)
        body = encode_refs(refs)
    head = _NODE_HEAD.pack(NODE_MAGIC, NODE_VERSION, level, count, first, len(body))
    data = head + body
    return data + struct.pack("<I", zlib.crc32(data))


def decode_node(raw: bytes, obj: str | None = None) -> Node:
    """Decode a node, checking magic, version, CRC, lengths and contiguity (I7)."""
    r = Reader(raw, WHAT_NODE, obj)
    r.need(_NODE_HEAD.size + 4, "node header and crc")
    magic, version, level, count, first, body_len = _NODE_HEAD.unpack_from(raw, 0)
    if magic != NODE_MAGIC:
        raise CorruptError(WHAT_NODE, obj, 0, "bad node magic")
    if version != NODE_VERSION:
        raise UnsupportedVersionError(WHAT_NODE, obj, 4, f"unknown node version {version}")
    if level > MAX_LEVEL:
        raise CorruptError(WHAT_NODE, obj, 6, f"unknown level {level}")
    r.pos = _NODE_HEAD.size
    body = r.take(body_len, "node body")
    crc_at = r.pos
    (crc,) = struct.unpack_from("<I", r.take(4, "crc"))
    if r.remaining():
        raise r.fail("trailing bytes after the crc")
    if zlib.crc32(memoryview(raw)[:crc_at]) != crc:
        raise CorruptError(WHAT_NODE, obj, crc_at, "crc mismatch")
    if level == 0:
        if count * STAT_SIZE > body_len:
            raise CorruptError(WHAT_NODE, obj, 7, f"count {count} cannot fit")
        region_len = body_len - count * STAT_SIZE
        region = bytes(body[:region_len])
        view = fm.ManifestView(region, fm.Footer(count, first + count, 0, fm.V2), region_len,
                               obj=obj)
        stats = _decode_stat_array(body[region_len:], count)
        return Node(0, first, count, view, stats, ())
    if count * REF_SIZE != body_len:
        raise CorruptError(WHAT_NODE, obj, 7, f"count {count} does not match body length")
    refs = _decode_refs(body, count, WHAT_NODE, obj, _NODE_HEAD.size)
    if refs and (refs[0].first != first or any(x.level != level - 1 for x in refs)):
        raise CorruptError(WHAT_NODE, obj, _NODE_HEAD.size, "children do not match the node")
    span = refs[-1].last - first + 1 if refs else 0
    return Node(level, first, span, None, (), refs)


def ref_for(level: int, first: int, stats: list[Stat] | tuple[Stat, ...] | None,
            refs: list[Ref] | tuple[Ref, ...] | None, ulid: bytes) -> Ref:
    """The reference summarising a node built from ``stats`` (level 0) or ``refs``."""
    if level == 0:
        assert stats is not None and stats
        times = [s.time_ms for s in stats]
        return Ref(0, first, first + len(stats) - 1, len(stats), min(times), max(times),
                   sum(s.size for s in stats), ulid)
    assert refs
    last = refs[-1].last
    return Ref(level, first, last, last - first + 1, min(r.min_time_ms for r in refs),
               max(r.max_time_ms for r in refs), sum(r.total_bytes for r in refs), ulid)
