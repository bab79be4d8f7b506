"""Queue manifest codec: RFC 0001 v1 byte for byte, and tieredbuf's v2 extension.

v1 (RFC 0001)::

    entry i: [entry_len: u32][sequence: u64][location_len: u16][location]
             [metadata_count: u32]
             metadata j: [start_index: u32][ingestion_time_ms: i64][payload_len: u32][payload]
    footer (22 bytes): entry_count u32, next_sequence u64, epoch u64, version u16 (= 1)

v2 (tieredbuf) keeps the entries and the 22-byte footer exactly (version = 2) and
puts an extension block between them::

    entries ... (as v1)
    extension sections, each: [tag: u16][body_len: u32][body]
    [sections_len: u32][ext_magic: 4 bytes = b"TBX2"]
    footer (22 bytes, version = 2)

Section tags: 1 = producer watermarks (exactly-once append, I2), 2 = epoch owner,
3 = tree (head, first retained sequence, group references; see format/tree.py),
4 = entry stats (object size and ingestion time per root entry), 5 = retention policy
(authoritative for every writer; absent = never set, i.e. no retention), 6 = buffer
(identity, creation time and GC grace period; added by the first write that finds it
missing, then kept as found by every writer), 7 = subscriber registry
(format/registry.py; absent = implied by the epoch), 8 = commit lease (which writer
commits announced appends for everyone, until when, at what interval; fan-in).
Unknown tags are refused (they carry semantics a writer would drop).  Appending
never decodes existing entries: the entry region is copied as bytes.
See docs/format.md.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from tieredbuf.errors import CorruptError, UnsupportedVersionError
from tieredbuf.format import registry as freg
from tieredbuf.format._reader import Reader, pack_u32

V1 = 1
V2 = 2
FOOTER_SIZE = 22
EXT_MAGIC = b"TBX2"
EXT_TRAILER_SIZE = 8
TAG_WATERMARKS = 1
TAG_OWNER = 2
TAG_TREE = 3
TAG_STATS = 4
TAG_RETENTION = 5
TAG_BUFFER = 6
TAG_SUBSCRIBERS = 7
TAG_LEASE = 8
KNOWN_TAGS = (
    TAG_WATERMARKS,
    TAG_OWNER,
    TAG_TREE,
    TAG_STATS,
    TAG_RETENTION,
    TAG_BUFFER,
    TAG_SUBSCRIBERS,
    TAG_LEASE,
)
_FOOTER = struct.Struct("<IQQH")
_ENTRY_HEAD = struct.Struct("<IQH")
_META_HEAD = struct.Struct("<IqI")
_SECTION = struct.Struct("<HI")
_WATERMARK = struct.Struct("<QQq")
_RETENTION = struct.Struct("<BQQ")
_BUFFER = struct.Struct("<16sqQ")
_U32 = struct.Struct("<I")
_LEASE = struct.Struct("<qI")
RETAIN_AGE = 0x01
RETAIN_BYTES = 0x02
MAX_LOCATION = 0xFFFF
WHAT = "queue manifest"


@dataclass(frozen=True, slots=True)
class MetadataItem:
    """Metadata of one range of records in a data object (one produce() call)."""

    start_index: int
    ingestion_time_ms: int
    payload: bytes


@dataclass(frozen=True, slots=True)
class ManifestEntry:
    sequence: int
    location: str
    metadata: tuple[MetadataItem, ...]


@dataclass(frozen=True, slots=True)
class NewEntry:
    """An entry to append; the manifest assigns its sequence.

    ``size`` is the data object's size in bytes (kept beside the entry for
    retention by bytes; 0 when unknown).
    """

    location: str
    metadata: tuple[MetadataItem, ...]
    size: int = 0


@dataclass(frozen=True, slots=True)
class Watermark:
    """The last append of one producer that landed (I2).

    ``producer_seq`` counts the producer's append calls; ``last_sequence`` is the
    manifest sequence of that call's last entry; ``updated_ms`` drives expiry.
    """

    producer_id: str
    producer_seq: int
    last_sequence: int
    updated_ms: int


@dataclass(frozen=True, slots=True)
class RetentionPolicy:
    """Section 5: how long acked history stays linked; ``None`` fields are rules not set.

    Both ``None`` is an explicit "no retention" (it still stops a writer's TreeConfig
    from seeding a policy; see :mod:`tieredbuf.queue.manifest_queue`).
    """

    max_age_ms: int | None = None
    max_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_age_ms", "max_bytes"):
            v = getattr(self, name)
            if v is not None and not 0 <= v < 1 << 63:
                raise ValueError(f"retention {name} must be in [0, 2**63), got {v}")

    @property
    def retains(self) -> bool:
        return self.max_age_ms is not None or self.max_bytes is not None


def encode_retention(p: RetentionPolicy) -> bytes:
    flags = (RETAIN_AGE if p.max_age_ms is not None else 0) | (
        RETAIN_BYTES if p.max_bytes is not None else 0
    )
    return _RETENTION.pack(flags, p.max_age_ms or 0, p.max_bytes or 0)


def decode_retention(body: Reader) -> RetentionPolicy:
    at = body.pos
    body.need(_RETENTION.size, "retention policy")
    flags, age, nbytes = _RETENTION.unpack_from(body.buf, body.pos)
    body.pos += _RETENTION.size
    if flags & ~(RETAIN_AGE | RETAIN_BYTES):
        raise body.fail(f"unknown retention flags 0x{flags:02x}", at)
    for bit, v, name in ((RETAIN_AGE, age, "max_age_ms"), (RETAIN_BYTES, nbytes, "max_bytes")):
        if (not flags & bit and v) or v >= 1 << 63:
            raise body.fail(f"bad retention {name} {v} (flags 0x{flags:02x})", at)
    return RetentionPolicy(
        age if flags & RETAIN_AGE else None, nbytes if flags & RETAIN_BYTES else None
    )


@dataclass(frozen=True, slots=True)
class BufferInfo:
    """Section 6: who this buffer is and the grace period GC and every writer use.

    ``buffer_id`` (a binary ULID) is made once, by the write that creates the root or
    first finds the section missing; a buffer deleted and created again gets a new
    one, so a reader holding an old position can tell (a Spark checkpoint, a stage).
    ``gc_grace_ms`` is the buffer's GC grace period: GC never deletes an unreferenced
    object younger than it, and writers re-upload (copy) any object older than half of
    it before enqueueing it, so the two can never disagree.
    """

    buffer_id: bytes
    created_ms: int
    gc_grace_ms: int

    def __post_init__(self) -> None:
        if len(self.buffer_id) != 16:
            raise ValueError(f"buffer id must be 16 bytes, got {len(self.buffer_id)}")
        if not -(1 << 63) <= self.created_ms < 1 << 63:
            raise ValueError(f"created_ms out of range: {self.created_ms}")
        if not 0 <= self.gc_grace_ms < 1 << 63:
            raise ValueError(f"gc_grace_ms must be in [0, 2**63), got {self.gc_grace_ms}")


def encode_buffer(b: BufferInfo) -> bytes:
    return _BUFFER.pack(b.buffer_id, b.created_ms, b.gc_grace_ms)


def decode_buffer(body: Reader) -> BufferInfo:
    at = body.pos
    body.need(_BUFFER.size, "buffer section")
    bid, created, grace = _BUFFER.unpack_from(body.buf, body.pos)
    body.pos += _BUFFER.size
    if grace >= 1 << 63:
        raise body.fail(f"bad gc_grace_ms {grace}", at)
    return BufferInfo(bytes(bid), created, grace)


@dataclass(frozen=True, slots=True)
class CommitLease:
    """Section 8: the writer that commits every announced append (fan-in), until
    ``expires_ms`` (its clock), one commit per ``interval_ms`` at most."""

    holder: str
    expires_ms: int
    interval_ms: int

    def __post_init__(self) -> None:
        if not 0 < len(self.holder.encode("utf-8")) <= 0xFF:
            raise ValueError("a lease holder is 1..255 bytes of UTF-8")
        if not 0 <= self.interval_ms <= 0xFFFFFFFF:
            raise ValueError(f"lease interval {self.interval_ms} ms out of range")


def encode_lease(lease: CommitLease) -> bytes:
    h = lease.holder.encode("utf-8")
    return bytes([len(h)]) + h + _LEASE.pack(lease.expires_ms, lease.interval_ms)


def decode_lease(body: Reader) -> CommitLease:
    at = body.pos
    holder = _utf8(body, body.u8("lease holder length"), "lease holder")
    expires = body.i64("lease expiry")
    interval = body.u32("lease interval")
    if not holder:
        raise body.fail("empty lease holder", at)
    return CommitLease(holder, expires, interval)


@dataclass(frozen=True, slots=True)
class Footer:
    entry_count: int
    next_sequence: int
    epoch: int
    version: int

    @property
    def first_sequence(self) -> int:
        return self.next_sequence - self.entry_count


@dataclass(frozen=True, slots=True)
class ManifestView:
    """A decoded footer and extension over the raw bytes; entries stay undecoded."""

    raw: bytes
    footer: Footer
    entries_end: int
    watermarks: dict[str, Watermark] = field(default_factory=dict)
    owner: str | None = None
    obj: str | None = None
    tree: bytes | None = None
    """Raw body of section 3 (decoded by :mod:`tieredbuf.format.tree`)."""
    stats: bytes | None = None
    """Raw body of section 4 (decoded by :mod:`tieredbuf.format.tree`)."""
    retention: RetentionPolicy | None = None
    """Section 5; None when the root has never had a retention policy."""
    buffer: BufferInfo | None = None
    """Section 6; None in a root no writer of this version has written yet."""
    subscribers: dict[str, freg.Registration] | None = None
    """Section 7; None when absent (the registry is then implied: format/registry.py)."""
    lease: CommitLease | None = None
    """Section 8; None when no writer has taken the commit lease yet."""

    @property
    def entries_bytes(self) -> memoryview:
        return memoryview(self.raw)[: self.entries_end]


def encode_entry(sequence: int, location: str, metadata: Sequence[MetadataItem]) -> bytes:
    loc = location.encode("utf-8")
    if len(loc) > MAX_LOCATION:
        raise ValueError(f"location of {len(loc)} bytes exceeds the u16 length field")
    body = [struct.pack("<QH", sequence, len(loc)), loc, pack_u32(len(metadata))]
    for m in metadata:
        body.append(_META_HEAD.pack(m.start_index, m.ingestion_time_ms, len(m.payload)))
        body.append(m.payload)
    joined = b"".join(body)
    return pack_u32(len(joined)) + joined


def encode_footer(f: Footer) -> bytes:
    return _FOOTER.pack(f.entry_count, f.next_sequence, f.epoch, f.version)


def parse_footer(tail: bytes | memoryview, obj: str | None = None) -> Footer:
    """Decode the last 22 bytes (``tail`` may be longer; its end is used)."""
    if len(tail) < FOOTER_SIZE:
        raise CorruptError(WHAT, obj, 0, f"truncated: {len(tail)} bytes, footer is 22")
    at = len(tail) - FOOTER_SIZE
    count, nxt, epoch, version = _FOOTER.unpack_from(tail, at)
    if version not in (V1, V2):
        raise UnsupportedVersionError(WHAT, obj, at + 20, f"unknown version {version}")
    if count > nxt:
        raise CorruptError(WHAT, obj, at, f"entry_count {count} > next_sequence {nxt}")
    return Footer(count, nxt, epoch, version)


def _encode_ext(
    watermarks: dict[str, Watermark],
    owner: str | None,
    tree: bytes | None = None,
    stats: bytes | None = None,
    retention: RetentionPolicy | None = None,
    buffer: BufferInfo | None = None,
    subscribers: dict[str, freg.Registration] | None = None,
    lease: CommitLease | None = None,
) -> bytes:
    sections: list[bytes] = []
    if watermarks:
        body = [pack_u32(len(watermarks))]
        for w in sorted(watermarks.values(), key=lambda w: w.producer_id):
            pid = w.producer_id.encode("utf-8")
            if len(pid) > 0xFF:
                raise ValueError("producer id longer than 255 bytes")
            body.append(bytes([len(pid)]) + pid)
            body.append(_WATERMARK.pack(w.producer_seq, w.last_sequence, w.updated_ms))
        joined = b"".join(body)
        sections.append(_SECTION.pack(TAG_WATERMARKS, len(joined)) + joined)
    if owner is not None:
        o = owner.encode("utf-8")
        sections.append(_SECTION.pack(TAG_OWNER, len(o)) + o)
    ret = None if retention is None else encode_retention(retention)
    buf = None if buffer is None else encode_buffer(buffer)
    subs = None if subscribers is None else freg.encode(subscribers)
    lse = None if lease is None else encode_lease(lease)
    for tag, body_ in (
        (TAG_TREE, tree),
        (TAG_STATS, stats),
        (TAG_RETENTION, ret),
        (TAG_BUFFER, buf),
        (TAG_SUBSCRIBERS, subs),
        (TAG_LEASE, lse),
    ):
        if body_ is not None:
            sections.append(_SECTION.pack(tag, len(body_)) + body_)
    blob = b"".join(sections)
    return blob + pack_u32(len(blob)) + EXT_MAGIC


@dataclass(slots=True)
class _Ext:
    entries_end: int
    watermarks: dict[str, Watermark]
    owner: str | None = None
    tree: bytes | None = None
    stats: bytes | None = None
    retention: RetentionPolicy | None = None
    buffer: BufferInfo | None = None
    subscribers: dict[str, freg.Registration] | None = None
    lease: CommitLease | None = None


def _parse_ext(raw: memoryview, ext_end: int, obj: str | None) -> _Ext:
    """Parse the v2 extension ending at ``ext_end``."""
    if ext_end < EXT_TRAILER_SIZE:
        raise CorruptError(WHAT, obj, 0, "truncated: no room for the v2 extension trailer")
    t = Reader(raw, WHAT, obj, ext_end - EXT_TRAILER_SIZE, ext_end)
    sections_len = t.u32("extension length")
    if bytes(t.take(4, "extension magic")) != EXT_MAGIC:
        raise CorruptError(WHAT, obj, ext_end - 4, "bad extension magic")
    start = ext_end - EXT_TRAILER_SIZE - sections_len
    if start < 0:
        raise CorruptError(
            WHAT, obj, ext_end - EXT_TRAILER_SIZE, f"extension length {sections_len} too large"
        )
    r = Reader(raw, WHAT, obj, start, ext_end - EXT_TRAILER_SIZE)
    ext = _Ext(start, {})
    watermarks = ext.watermarks
    last_tag = 0
    while r.remaining():
        at = r.pos - start
        tag = r.u16("section tag")
        if tag <= last_tag and tag in KNOWN_TAGS:
            raise CorruptError(WHAT, obj, start + at, f"section {tag} out of order or repeated")
        last_tag = tag
        n = r.u32("section length")
        body_at = r.pos
        r.take(n, "section body")
        body = Reader(raw, WHAT, obj, body_at, body_at + n)  # offsets stay absolute
        if tag == TAG_WATERMARKS:
            count = body.u32("watermark count")
            if count * (1 + _WATERMARK.size) > body.remaining():
                raise CorruptError(WHAT, obj, start + at, f"watermark count {count} cannot fit")
            last_pid: str | None = None
            for _ in range(count):
                pid_at = body.pos
                pid = _utf8(body, body.u8("producer id length"), "producer id")
                if last_pid is not None and pid <= last_pid:
                    # the writer sorts them: a repeat or a swap is damage, and reading
                    # it would drop or reorder a producer's exactly-once watermark (I2)
                    raise CorruptError(
                        WHAT, obj, pid_at, f"producer id {pid!r} out of order or repeated"
                    )
                last_pid = pid
                body.need(_WATERMARK.size, "watermark")
                pseq, last, upd = _WATERMARK.unpack_from(body.buf, body.pos)
                body.pos += _WATERMARK.size
                watermarks[pid] = Watermark(pid, pseq, last, upd)
        elif tag == TAG_OWNER:
            ext.owner = _utf8(body, n, "owner")
        elif tag == TAG_TREE:
            ext.tree = bytes(body.take(n, "tree section"))
        elif tag == TAG_STATS:
            ext.stats = bytes(body.take(n, "stats section"))
        elif tag == TAG_RETENTION:
            ext.retention = decode_retention(body)
        elif tag == TAG_BUFFER:
            ext.buffer = decode_buffer(body)
        elif tag == TAG_SUBSCRIBERS:
            ext.subscribers = freg.decode(body)
        elif tag == TAG_LEASE:
            ext.lease = decode_lease(body)
        else:
            raise CorruptError(WHAT, obj, start + at, f"unknown extension section tag {tag}")
        if body.remaining():
            raise CorruptError(WHAT, obj, start + at, f"section {tag} has trailing bytes")
    return ext


def _utf8(r: Reader, n: int, field_name: str) -> str:
    at = r.pos
    b = r.take(n, field_name)
    try:
        return bytes(b).decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorruptError(WHAT, r.obj, at, f"{field_name} is not UTF-8") from e


def open_manifest(raw: bytes, obj: str | None = None) -> ManifestView:
    """Decode the footer and extension of a manifest; entries are left as bytes."""
    footer = parse_footer(raw, obj)
    ext_end = len(raw) - FOOTER_SIZE
    if footer.version == V1:
        return ManifestView(raw, footer, ext_end, obj=obj)
    x = _parse_ext(memoryview(raw), ext_end, obj)
    return ManifestView(
        raw,
        footer,
        x.entries_end,
        x.watermarks,
        x.owner,
        obj,
        x.tree,
        x.stats,
        x.retention,
        x.buffer,
        x.subscribers,
        x.lease,
    )


def empty_manifest() -> ManifestView:
    raw = _encode_ext({}, None) + encode_footer(Footer(0, 0, 0, V2))
    return open_manifest(raw)


def iter_entries(view: ManifestView) -> Iterator[ManifestEntry]:
    """Decode every entry, checking lengths, contiguity and the footer's count."""
    r = Reader(view.raw, WHAT, view.obj, 0, view.entries_end)
    expected = view.footer.first_sequence
    for i in range(view.footer.entry_count):
        at = r.pos
        n = r.u32(f"entry {i} length")
        r.take(n, f"entry {i}")
        e = Reader(view.raw, WHAT, view.obj, at + 4, at + 4 + n)  # offsets stay absolute
        seq = e.u64("sequence")
        if seq != expected:
            raise CorruptError(WHAT, view.obj, at + 4, f"sequence {seq}, expected {expected}")
        loc = _utf8(e, e.u16("location length"), "location")
        mcount = e.u32("metadata count")
        if mcount * _META_HEAD.size > e.remaining():
            raise CorruptError(WHAT, view.obj, at, f"metadata count {mcount} cannot fit")
        items = []
        for j in range(mcount):
            start = e.u32(f"metadata {j} start_index")
            ts = e.i64(f"metadata {j} ingestion_time_ms")
            payload = bytes(e.take(e.u32(f"metadata {j} payload length"), "payload"))
            items.append(MetadataItem(start, ts, payload))
        if e.remaining():
            raise CorruptError(WHAT, view.obj, at, f"entry {i} has {e.remaining()} extra bytes")
        expected += 1
        yield ManifestEntry(seq, loc, tuple(items))
    if r.remaining():
        raise r.fail(f"{r.remaining()} bytes after {view.footer.entry_count} entries")


def skip_entries(view: ManifestView, k: int, start: int = 0) -> int:
    """Byte offset of the entry ``k`` entries after the one at byte ``start`` (0: the
    first), walking lengths only.  The walk unpacks lengths unchecked (a reader skips up
    to M entries of a group to reach its position); one that runs past the region is
    walked again checked, which names the byte that is wrong (I7)."""
    raw, pos, end = view.raw, start, view.entries_end
    unpack = _U32.unpack_from
    try:
        for _ in range(k):
            pos += 4 + unpack(raw, pos)[0]
    except struct.error:
        pos = end + 1
    if pos <= end:
        return pos
    r = Reader(view.raw, WHAT, view.obj, start, view.entries_end)
    for i in range(k):
        r.take(r.u32(f"entry {i} length"), f"entry {i}")
    return r.pos


def prune_watermarks(
    watermarks: dict[str, Watermark], now_ms: int, ttl_ms: int, cap: int
) -> dict[str, Watermark]:
    """Drop watermarks idle past ``ttl_ms``, then the oldest beyond ``cap``."""
    live = [w for w in watermarks.values() if now_ms - w.updated_ms <= ttl_ms]
    live.sort(key=lambda w: w.updated_ms, reverse=True)
    return {w.producer_id: w for w in live[:cap]}


def encode_manifest(
    entries_region: bytes | memoryview,
    footer: Footer,
    watermarks: dict[str, Watermark],
    owner: str | None,
    tree: bytes | None = None,
    stats: bytes | None = None,
    retention: RetentionPolicy | None = None,
    buffer: BufferInfo | None = None,
    subscribers: dict[str, freg.Registration] | None = None,
    lease: CommitLease | None = None,
) -> bytes:
    """Assemble a v2 manifest from an entry region and its metadata."""
    f = Footer(footer.entry_count, footer.next_sequence, footer.epoch, V2)
    ext = _encode_ext(watermarks, owner, tree, stats, retention, buffer, subscribers, lease)
    return b"".join((entries_region, ext, encode_footer(f)))


def _flat_only(view: ManifestView) -> None:
    if (
        view.tree is not None
        or view.stats is not None
        or view.retention is not None
        or view.buffer is not None
        or view.subscribers is not None
        or view.lease is not None
    ):
        raise ValueError("a tree root: use tieredbuf.queue.tree, not the flat helpers")


def append(
    view: ManifestView,
    new: Sequence[NewEntry],
    watermarks: dict[str, Watermark],
) -> tuple[bytes, int]:
    """Append ``new`` without decoding existing entries. Returns (bytes, first new sequence).

    Flat (RFC-style) manifests only; tree roots are written by :mod:`tieredbuf.queue.tree`.
    """
    _flat_only(view)
    first = view.footer.next_sequence
    encoded = [encode_entry(first + i, n.location, n.metadata) for i, n in enumerate(new)]
    f = view.footer
    footer = Footer(f.entry_count + len(new), f.next_sequence + len(new), f.epoch, V2)
    region = b"".join((view.entries_bytes, *encoded))
    return encode_manifest(region, footer, watermarks, view.owner), first


def with_epoch(view: ManifestView, epoch: int, owner: str) -> bytes:
    f = view.footer
    return encode_manifest(
        view.entries_bytes,
        Footer(f.entry_count, f.next_sequence, epoch, V2),
        view.watermarks,
        owner,
        view.tree,
        view.stats,
        view.retention,
        view.buffer,
        view.subscribers,
        view.lease,
    )


def dequeue(view: ManifestView, through_sequence: int) -> bytes:
    """Remove every entry with sequence <= ``through_sequence`` (RFC ``dequeue(n)``; flat only)."""
    _flat_only(view)
    f = view.footer
    k = min(max(through_sequence - f.first_sequence + 1, 0), f.entry_count)
    cut = skip_entries(view, k)
    footer = Footer(f.entry_count - k, f.next_sequence, f.epoch, V2)
    return encode_manifest(view.entries_bytes[cut:], footer, view.watermarks, view.owner)
