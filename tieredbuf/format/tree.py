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

import array
import struct
import sys
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


def first_kept_may_hide(first_kept: fm.ManifestEntry | None, time_ms: int) -> bool:
    """Whether history dropped before ``first_kept`` (the first entry a queue still
    keeps) may hold records ingested at or after ``time_ms``: when that entry is not
    older than ``time_ms`` (the same millisecond included), or has no time at all.  The
    root keeps no time of what it dropped, so a possible loss is reported, never ruled
    out (``buf.lookup_time`` and Spark's ``startingTimestamp``)."""
    return first_kept is not None and entry_time(first_kept.metadata, time_ms) >= time_ms


# --- refs and stats ----------------------------------------------------------
#
# A root write that changes no ref (a plain append, a dequeue inside the root's
# entries) copies the refs and stats as raw bytes: only the accessors below that a
# rebalance, an unlink or a reader needs decode them (I6: append cost independent of
# the backlog; docs/format.md).


def pack_ref(r: Ref) -> bytes:
    return _REF.pack(
        r.level, r.first, r.last, r.count, r.min_time_ms, r.max_time_ms, r.total_bytes, r.ulid
    )


def encode_refs(refs: tuple[Ref, ...] | list[Ref]) -> bytes:
    return b"".join(pack_ref(r) for r in refs)


def ref_at(raw: bytes, i: int) -> Ref:
    """Ref ``i`` (negative counts from the end) of a raw REF array, unvalidated."""
    n = len(raw) // REF_SIZE
    if not -n <= i < n:
        raise IndexError(f"ref {i} of {n}")
    return Ref(*_REF.unpack_from(raw, (i % n) * REF_SIZE))


def ref_levels(raw: bytes) -> bytes:
    """The level byte of every ref of a raw REF array (one byte per ref)."""
    return raw[0::REF_SIZE]


def refs_total_bytes(raw: bytes) -> int:
    return sum(t[6] for t in _REF.iter_unpack(raw))


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


# One-entry memo: readers (and the rare writer that rebalances or unlinks) decode the
# same refs again and again; they change only on a rebalance or an unlink.
_last_decoded: tuple[bytes, tuple[Ref, ...]] = (b"", ())


def decode_root_refs(raw: bytes, obj: str | None = None) -> tuple[Ref, ...]:
    """Decode and check the raw REF array of a root's tree section (I7)."""
    global _last_decoded
    memo_raw, memo_refs = _last_decoded
    if memo_raw == raw:
        return memo_refs
    at = _TREE_HEAD.size
    refs = _decode_refs(memoryview(raw), len(raw) // REF_SIZE, WHAT_ROOT, obj, at)
    for i in range(1, len(refs)):
        if refs[i].level > refs[i - 1].level:
            raise CorruptError(WHAT_ROOT, obj, at + i * REF_SIZE, "ref levels must not rise")
    _last_decoded = (raw, refs)
    return refs


def pack_stats(stats: list[Stat] | tuple[Stat, ...]) -> bytes:
    """A raw stats array (no count)."""
    return b"".join(_STAT.pack(s.size, s.time_ms) for s in stats)


def stat_at(raw: bytes, i: int) -> Stat:
    return Stat(*_STAT.unpack_from(raw, i * STAT_SIZE))


def stats_from_raw(raw: bytes | memoryview) -> tuple[Stat, ...]:
    return tuple(Stat(a, b) for a, b in _STAT.iter_unpack(raw))


def stats_total_bytes(raw: bytes) -> int:
    a = array.array("Q", raw)
    if sys.byteorder != "little":
        a.byteswap()
    return sum(a[0::2])


def split_stats(body: bytes, obj: str | None = None) -> bytes:
    """Check section 4's lengths; returns its raw stats array (count x 16 bytes)."""
    r = Reader(body, WHAT_ROOT, obj)
    n = r.u32("stats count")
    r.need(n * STAT_SIZE, "stats")
    if r.remaining() != n * STAT_SIZE:
        raise r.fail("stats section has trailing bytes")
    return body[r.pos :]


def encode_stats_raw(raw: bytes) -> bytes:
    """Section 4 from a raw stats array."""
    return struct.pack("<I", len(raw) // STAT_SIZE) + raw


def encode_stats(stats: list[Stat] | tuple[Stat, ...]) -> bytes:
    return encode_stats_raw(pack_stats(stats))


def decode_stats(body: bytes, obj: str | None = None) -> tuple[Stat, ...]:
    return stats_from_raw(split_stats(body, obj))


def split_tree(body: bytes, obj: str | None = None) -> tuple[int, int, bytes]:
    """Check section 3's lengths and bounds; returns (low, head, raw REF array).

    The refs are not decoded here: :func:`decode_root_refs` does that (and checks
    them) when a reader or a rebalance needs them.
    """
    r = Reader(body, WHAT_ROOT, obj)
    low, head = r.u64("low_seq"), r.u64("head_seq")
    n = r.u32("ref count")
    r.need(n * REF_SIZE, "refs")
    if r.remaining() != n * REF_SIZE:
        raise r.fail("tree section has trailing bytes")
    if low > head:
        raise CorruptError(WHAT_ROOT, obj, 0, f"low_seq {low} > head_seq {head}")
    return low, head, body[r.pos :]


def encode_tree_raw(low: int, head: int, refs_raw: bytes) -> bytes:
    return _TREE_HEAD.pack(low, head, len(refs_raw) // REF_SIZE) + refs_raw


def encode_tree(state: TreeState) -> bytes:
    return encode_tree_raw(state.low, state.head, encode_refs(state.refs))


def decode_tree(body: bytes, obj: str | None = None) -> TreeState:
    low, head, raw = split_tree(body, obj)
    return TreeState(low, head, decode_root_refs(raw, obj))


# --- nodes -------------------------------------------------------------------


def encode_node(
    level: int,
    first: int,
    *,
    entries_region: bytes | memoryview = b"",
    stats: list[Stat] | tuple[Stat, ...] = (),
    refs: list[Ref] | tuple[Ref, ...] = (),
    stats_raw: bytes | None = None,
) -> bytes:
    """A node object: level 0 holds ``entries_region`` + ``stats`` (or ``stats_raw``, packed);
    others hold ``refs``."""
    if level == 0:
        raw = pack_stats(stats) if stats_raw is None else stats_raw
        count = len(raw) // STAT_SIZE
        body = b"".join((entries_region, raw))
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
        view = fm.ManifestView(
            region, fm.Footer(count, first + count, 0, fm.V2), region_len, obj=obj
        )
        stats = stats_from_raw(body[region_len:])
        return Node(0, first, count, view, stats, ())
    if count * REF_SIZE != body_len:
        raise CorruptError(WHAT_NODE, obj, 7, f"count {count} does not match body length")
    refs = _decode_refs(body, count, WHAT_NODE, obj, _NODE_HEAD.size)
    if refs and (refs[0].first != first or any(x.level != level - 1 for x in refs)):
        raise CorruptError(WHAT_NODE, obj, _NODE_HEAD.size, "children do not match the node")
    span = refs[-1].last - first + 1 if refs else 0
    return Node(level, first, span, None, (), refs)


def ref_for(
    level: int,
    first: int,
    stats: list[Stat] | tuple[Stat, ...] | None,
    refs: list[Ref] | tuple[Ref, ...] | None,
    ulid: bytes,
) -> Ref:
    """The reference summarising a node built from ``stats`` (level 0) or ``refs``."""
    if level == 0:
        assert stats is not None and stats
        times = [s.time_ms for s in stats]
        return Ref(
            0,
            first,
            first + len(stats) - 1,
            len(stats),
            min(times),
            max(times),
            sum(s.size for s in stats),
            ulid,
        )
    assert refs
    last = refs[-1].last
    return Ref(
        level,
        first,
        last,
        last - first + 1,
        min(r.min_time_ms for r in refs),
        max(r.max_time_ms for r in refs),
        sum(r.total_bytes for r in refs),
        ulid,
    )
