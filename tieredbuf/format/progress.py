"""A named subscriber's progress object ``queue/subscribers/<name>.<reg ULID>`` (pure codec).

One object per registration, CAS-written by that subscriber only (Quiver keeps one
progress file per subscriber).  Layout (docs/format.md), little-endian::

    magic "TBS1", version u16 (1: a stream subscriber's; 2: a shared work queue's;
                               version 1 shared objects are still read)
    flags u8 (bit 0: shared work queue; others 0)
    name_len u8, name, reg_id 16 bytes (binary ULID of the registration)
    epoch u64, owner_len u16, owner (UTF-8: the initialize() call that set the epoch)
    position u64      first sequence neither acked nor rejected (what the subscriber still needs)
    claim_cursor u64  shared: first sequence never claimed (= position for a stream subscriber)
    created_ms i64, updated_ms i64, lost u64 (sequences skipped after retention unlinked them)
    done_count u32,     done_count x (first u64, last u64)        acked/rejected above position
    lease_count u32,    lease_count x (seq u64, deliveries u16, [v2: lease_flags u8,]
                                       expires_ms i64, token 16 bytes)
    rejected_total u64, rejected_count u32,
                        rejected_count x (seq u64, time_ms i64, deliveries u16,
                                          [v2: rejected_flags u8,] reason_len u16, reason)
                        the most recent ones
    worker_count u32,   worker_count x (worker_id 16, last_op 16, seen_ms i64)
    crc32 u32         zlib.crc32 of every byte before it

``lease_flags`` (version 2; :mod:`tieredbuf.queue.shared` is the state machine):

* bit 0 ``OUT``: the hand-out under ``token`` is counted in ``deliveries`` (a claim()
  returned it, said by the worker that returned it);
* bit 1 ``BACK``: handed back (defer, release, or settled after its holder's lease
  lapsed): claimable from ``expires_ms`` on (0: now); without it the record is a lease
  held under ``token`` until ``expires_ms``;
* bit 2 ``SUSPECT``: a holder once went silent without saying whether it handed the
  entry out: every later hand-out is recorded (a CAS) before claim() returns it.

A version 1 record reads as flags 0, or ``BACK`` when its ``expires_ms`` is 0 (handed
back).  ``rejected_flags`` bit 0 ``KEPT``: the dead letter holds its entry in the buffer
(the subscriber's needed position, :func:`needed`, stays at it) until it is redriven or
dropped; version 1 records read as 0.

A shared queue's state is complete: every sequence in ``[position, claim_cursor)`` is
either inside a done range or has exactly one lease record.  The decoder checks that,
every count against the bytes that remain before it allocates, the order of every list,
every flag, and the CRC (I7).
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

from tieredbuf.errors import CorruptError, UnsupportedVersionError
from tieredbuf.format import registry as freg
from tieredbuf.format._reader import Reader

MAGIC = b"TBS1"
VERSION = 1
"""A stream subscriber's objects (no work-queue state)."""
VERSION_SHARED = 2
"""A shared work queue's objects (lease and rejected flags)."""
FLAG_SHARED = 0x01
WHAT = "subscriber progress"
MAX_SPAN = 1 << 16
"""Hard cap on lease records (a work queue's [position, claim_cursor) span)."""
REJECTED_CAP = 256
"""Rejected entries kept in the list (older ones only counted in ``rejected_total``)."""
MAX_REASON = 1024
WORKERS_CAP = 256
"""Worker marks kept (most recently seen first)."""
_HEAD = struct.Struct("<4sHB")
_NUMS = struct.Struct("<QQqqQ")
_RANGE = struct.Struct("<QQ")
_LEASE_V1 = struct.Struct("<QHq16s")
_LEASE = struct.Struct("<QHBq16s")
_REJ_V1 = struct.Struct("<QqHH")
_REJ = struct.Struct("<QqHBH")
OUT = 0x01
"""Lease flag: the hand-out under its token is counted in ``deliveries``."""
BACK = 0x02
"""Lease flag: handed back, claimable from ``expires_ms`` on (0: now)."""
SUSPECT = 0x04
"""Lease flag: a holder went silent without saying whether it handed the entry out."""
LEASE_FLAGS = OUT | BACK | SUSPECT
KEPT = 0x01
"""Rejected flag: the dead letter holds its entry in the buffer (redrivable)."""
_WORKER = struct.Struct("<16s16sq")


@dataclass(frozen=True, slots=True)
class Lease:
    """One claimed (or handed back) sequence of a shared queue."""

    seq: int
    deliveries: int
    expires_ms: int
    """Held: the claimer's wall clock + lease.  Handed back (``BACK``): claimable from
    then on (0: at once)."""
    token: bytes
    """The claim operation that leased it (16 bytes): only an ack under it counts."""
    flags: int = 0
    """``OUT``, ``BACK``, ``SUSPECT`` (module docstring)."""

    @property
    def back(self) -> bool:
        return bool(self.flags & BACK)


@dataclass(frozen=True, slots=True)
class Rejected:
    seq: int
    time_ms: int
    deliveries: int
    reason: bytes
    flags: int = 0
    """``KEPT``: its entry is held in the buffer until redriven or dropped."""


@dataclass(frozen=True, slots=True)
class WorkerMark:
    """A worker's last applied operation: how its retry after an unknown outcome knows."""

    worker_id: bytes
    last_op: bytes
    seen_ms: int


@dataclass(frozen=True, slots=True)
class Progress:
    name: str
    reg_id: bytes
    shared: bool
    epoch: int
    owner: str
    position: int
    claim_cursor: int
    created_ms: int
    updated_ms: int
    lost: int = 0
    done: tuple[tuple[int, int], ...] = ()
    leases: tuple[Lease, ...] = ()
    rejected_total: int = 0
    rejected: tuple[Rejected, ...] = ()
    workers: tuple[WorkerMark, ...] = ()


def encode(p: Progress) -> bytes:
    name = freg.check_name(p.name).encode("ascii")
    owner = p.owner.encode("utf-8")
    if len(p.reg_id) != 16 or len(owner) > 0xFFFF:
        raise ValueError("bad registration id or owner")
    out = [
        _HEAD.pack(MAGIC, VERSION_SHARED if p.shared else VERSION, FLAG_SHARED if p.shared else 0),
        bytes([len(name)]),
        name,
        p.reg_id,
        struct.pack("<QH", p.epoch, len(owner)),
        owner,
        _NUMS.pack(p.position, p.claim_cursor, p.created_ms, p.updated_ms, p.lost),
        struct.pack("<I", len(p.done)),
    ]
    out += [_RANGE.pack(a, b) for a, b in p.done]
    out.append(struct.pack("<I", len(p.leases)))
    out += [_LEASE.pack(x.seq, x.deliveries, x.flags, x.expires_ms, x.token) for x in p.leases]
    out.append(struct.pack("<QI", p.rejected_total, len(p.rejected)))
    for r in p.rejected:
        if len(r.reason) > MAX_REASON:
            raise ValueError(f"reject reason of {len(r.reason)} bytes (max {MAX_REASON})")
        out.append(_REJ.pack(r.seq, r.time_ms, r.deliveries, r.flags, len(r.reason)) + r.reason)
    out.append(struct.pack("<I", len(p.workers)))
    out += [_WORKER.pack(w.worker_id, w.last_op, w.seen_ms) for w in p.workers]
    data = b"".join(out)
    check(p)
    return data + struct.pack("<I", zlib.crc32(data))


def _count(r: Reader, field: str, each: int, cap: int) -> int:
    at = r.pos
    n = r.u32(field)
    if n > cap or n * each > r.remaining():
        raise r.fail(f"{field} {n} cannot fit (or exceeds {cap})", at)
    return n


def decode(raw: bytes, obj: str | None = None) -> Progress:
    """Decode and check a progress object (I7)."""
    r = Reader(raw, WHAT, obj)
    r.need(_HEAD.size + 4, "header and crc")
    magic, version, flags = _HEAD.unpack_from(raw, 0)
    if magic != MAGIC:
        raise CorruptError(WHAT, obj, 0, "bad magic")
    if version not in (VERSION, VERSION_SHARED):
        raise UnsupportedVersionError(WHAT, obj, 4, f"unknown version {version}")
    if flags & ~FLAG_SHARED:
        raise CorruptError(WHAT, obj, 6, f"unknown flags 0x{flags:02x}")
    if version == VERSION_SHARED and not flags & FLAG_SHARED:
        raise CorruptError(WHAT, obj, 4, "version 2 is a shared work queue's")
    v2 = version == VERSION_SHARED
    lease_s, rej_s = (_LEASE, _REJ) if v2 else (_LEASE_V1, _REJ_V1)
    crc_at = len(raw) - 4
    (crc,) = struct.unpack_from("<I", raw, crc_at)
    if zlib.crc32(memoryview(raw)[:crc_at]) != crc:
        raise CorruptError(WHAT, obj, crc_at, "crc mismatch")
    r = Reader(raw, WHAT, obj, _HEAD.size, crc_at)
    at = r.pos
    name_b = bytes(r.take(r.u8("name length"), "name"))
    name = name_b.decode("ascii", "replace")
    try:
        freg.check_name(name)
    except ValueError:
        raise r.fail(f"bad subscriber name {name_b!r}", at) from None
    reg_id = bytes(r.take(16, "reg_id"))
    epoch = r.u64("epoch")
    at = r.pos
    try:
        owner = bytes(r.take(r.u16("owner length"), "owner")).decode("utf-8")
    except UnicodeDecodeError:
        raise r.fail("owner is not UTF-8", at) from None
    r.need(_NUMS.size, "positions")
    position, cursor, created, updated, lost = _NUMS.unpack_from(raw, r.pos)
    r.pos += _NUMS.size
    done = []
    for _ in range(_count(r, "done range count", _RANGE.size, MAX_SPAN)):
        done.append(_RANGE.unpack_from(raw, r.pos))
        r.pos += _RANGE.size
    leases = []
    for i in range(_count(r, "lease count", lease_s.size, MAX_SPAN)):
        at = r.pos
        if v2:
            seq, deliveries, lflags, expires, token = _LEASE.unpack_from(raw, at)
            if lflags & ~LEASE_FLAGS:
                raise r.fail(f"lease {i}: bad flags 0x{lflags:02x}", at)
        else:
            seq, deliveries, expires, token = _LEASE_V1.unpack_from(raw, at)
            lflags = BACK if expires == 0 else 0
        leases.append(Lease(seq, deliveries, expires, token, lflags))
        r.pos += lease_s.size
    rejected_total = r.u64("rejected total")
    rejected = []
    for i in range(_count(r, "rejected count", rej_s.size, REJECTED_CAP)):
        r.need(rej_s.size, f"rejected {i}")
        at = r.pos
        if v2:
            seq, t, deliveries, rflags, n = _REJ.unpack_from(raw, at)
            if rflags & ~KEPT:
                raise r.fail(f"rejected {i}: bad flags 0x{rflags:02x}", at)
        else:
            seq, t, deliveries, n = _REJ_V1.unpack_from(raw, at)
            rflags = 0
        r.pos += rej_s.size
        if n > MAX_REASON:
            raise r.fail(f"rejected {i}: reason of {n} bytes")
        reason = bytes(r.take(n, f"rejected {i} reason"))
        rejected.append(Rejected(seq, t, deliveries, reason, rflags))
    workers = []
    for _ in range(_count(r, "worker count", _WORKER.size, WORKERS_CAP)):
        workers.append(WorkerMark(*_WORKER.unpack_from(raw, r.pos)))
        r.pos += _WORKER.size
    if r.remaining():
        raise r.fail(f"{r.remaining()} trailing bytes before the crc")
    p = Progress(
        name,
        reg_id,
        bool(flags & FLAG_SHARED),
        epoch,
        owner,
        position,
        cursor,
        created,
        updated,
        lost,
        tuple((a, b) for a, b in done),
        tuple(leases),
        rejected_total,
        tuple(rejected),
        tuple(workers),
    )
    try:
        check(p)
    except ValueError as e:
        raise CorruptError(WHAT, obj, 0, str(e)) from None
    return p


def check(p: Progress) -> None:
    """The state's own consistency (ValueError): what :func:`decode` and :func:`encode` hold."""
    if p.reg_id == freg.ZERO_REG or len(p.reg_id) != 16:
        raise ValueError("a named subscriber needs a non-zero 16-byte registration id")
    if p.claim_cursor < p.position:
        raise ValueError(f"claim_cursor {p.claim_cursor} < position {p.position}")
    if len(p.rejected) > REJECTED_CAP or len(p.workers) > WORKERS_CAP:
        raise ValueError("rejected list or worker marks over their cap")
    if len(p.rejected) > p.rejected_total:
        raise ValueError("more rejected entries listed than counted")
    if any(r.flags & ~KEPT for r in p.rejected):
        raise ValueError("unknown rejected flags")
    if not p.shared:
        if p.claim_cursor != p.position or p.done or p.leases or p.rejected or p.workers:
            raise ValueError("a stream subscriber keeps no work-queue state")
        return
    prev = p.position
    covered = 0
    for a, b in p.done:
        if not prev < a <= b < p.claim_cursor:
            raise ValueError(
                f"done range {a}..{b} out of order or outside ({p.position}, {p.claim_cursor})"
            )
        prev = b + 1
        covered += b - a + 1
    done_iter = iter(p.done)
    rng = next(done_iter, None)
    last = -1
    for x in p.leases:
        if x.flags & ~LEASE_FLAGS:
            raise ValueError(f"lease {x.seq}: unknown flags 0x{x.flags:02x}")
        if x.seq <= last or not p.position <= x.seq < p.claim_cursor:
            raise ValueError(f"lease {x.seq} out of order or outside the span")
        while rng is not None and rng[1] < x.seq:
            rng = next(done_iter, None)
        if rng is not None and rng[0] <= x.seq:
            raise ValueError(f"lease {x.seq} is inside a done range")
        last = x.seq
    if covered + len(p.leases) != p.claim_cursor - p.position:
        raise ValueError(
            f"{covered} done + {len(p.leases)} leased do not cover "
            f"{p.position}..{p.claim_cursor - 1}"
        )


def needed(p: Progress) -> int:
    """The first sequence this subscriber needs the buffer to hold: its position, or a
    dead letter below it that is kept for redrive (``KEPT``).  What it publishes."""
    kept = [r.seq for r in p.rejected if r.flags & KEPT and r.seq < p.position]
    return min([p.position, *kept])
