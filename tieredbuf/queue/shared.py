"""Shared work queues: the pure decisions on one subscriber's progress (no I/O, no clock).

Quiver's bundle lifecycle on a queue: a sequence is *claimable* (never claimed,
handed back by defer, or its lease lapsed), *leased* (claimed by one worker until
its lease expires), or *done* (acked or rejected: terminal).  The subscriber's
position is the oldest sequence not done (Quiver's high-water mark), with done
ranges kept above it for out-of-order acks.  A worker applies its buffered acks,
rejects and defers and leases its next batch in **one** CAS of the progress
object; :func:`apply` is that CAS's pure step.

An ack (or reject) counts only under the lease it was handed out with (the claim
operation's token): once another claim has re-leased a lapsed sequence, the old
holder's ack is refused (``expired``) and changes nothing.  A lapsed lease nobody
re-claimed may still be acked.

**Deliveries.** A delivery is a ``claim()`` that returned the entry, not a lease: a
refill leases a batch of which the worker may return only some.  A lease's
``deliveries`` counts the deliveries *before* it; it is charged when the holder says
so -- a ``defer`` (or a reject) of an entry it returned -- and a ``release`` (an entry
leased but never returned: handed back on close, or dropped locally when its lease
was about to lapse) charges nothing.  A holder that goes silent (killed, or stalled
past its lease) says nothing: when its lease has lapsed, the next CAS charges one
delivery to the lowest sequence it still held -- the one a worker returning entries in
order was on -- and hands the rest back uncharged.  ``max_deliveries`` refuses to
lease an entry already delivered that many times.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from tieredbuf.format.progress import (
    REJECTED_CAP,
    WORKERS_CAP,
    Lease,
    Progress,
    Rejected,
    WorkerMark,
)

Action = Literal["ack", "reject", "defer", "release"]
MAX_DELIVERIES_REASON = b"max_deliveries reached"


@dataclass(frozen=True, slots=True)
class Op:
    """A worker's resolution of one sequence it leased under ``token``: ``ack``,
    ``reject`` and ``defer`` of an entry claim() returned, ``release`` of one it never
    returned (no delivery is charged)."""

    action: Action
    seq: int
    token: bytes
    reason: bytes = b""


@dataclass(frozen=True, slots=True)
class Limits:
    lease_ms: int
    claim_n: int
    max_span: int
    max_deliveries: int | None = None


@dataclass(slots=True)
class Applied:
    progress: Progress
    claimed: list[Lease] = dataclasses.field(default_factory=list)
    expired: list[int] = dataclasses.field(default_factory=list)
    """Acks / rejects refused: another claim re-leased the sequence (LeaseExpiredError)."""
    ignored_defers: list[int] = dataclasses.field(default_factory=list)
    auto_rejected: list[int] = dataclasses.field(default_factory=list)
    lost: tuple[int, int] | None = None
    """(first, last) of sequences below ``low`` (unlinked by retention) not under a live
    lease: with ``skip`` they were resolved and counted in ``lost``; else nothing was
    claimed and the caller raises DataLossError."""


def _done_set(p: Progress) -> set[int]:
    out: set[int] = set()
    for a, b in p.done:
        out.update(range(a, b + 1))
    return out


def _ranges(done: Iterable[int]) -> tuple[tuple[int, int], ...]:
    out: list[list[int]] = []
    for s in sorted(done):
        if out and out[-1][1] + 1 == s:
            out[-1][1] = s
        else:
            out.append([s, s])
    return tuple((a, b) for a, b in out)


def live(lease: Lease, now_ms: int) -> bool:
    """Held by its claimer (not handed back, not lapsed by ``now_ms``: the caller's clock)."""
    return lease.expires_ms != 0 and lease.expires_ms > now_ms


def apply(
    p: Progress,
    ops: Sequence[Op],
    *,
    worker_id: bytes,
    op_token: bytes,
    now_ms: int,
    limits: Limits,
    next_seq: int,
    low: int,
    skip_lost: bool,
) -> Applied:
    """One worker CAS: resolve ``ops``, handle sequences lost to retention, lease the next
    ``limits.claim_n`` claimable sequences (lowest first) under ``op_token``."""
    done = _done_set(p)
    leases = {x.seq: x for x in p.leases}
    rejected = list(p.rejected)
    rejected_total = p.rejected_total
    out = Applied(p)
    for op in ops:
        x = leases.get(op.seq)
        if op.seq >= p.claim_cursor:
            raise ValueError(f"sequence {op.seq} was never claimed")
        if x is None or x.token != op.token:
            if op.action in ("defer", "release"):
                out.ignored_defers.append(op.seq)
            else:
                out.expired.append(op.seq)
            continue
        if op.action == "release":
            leases[op.seq] = dataclasses.replace(x, expires_ms=0)
            continue
        if op.action == "defer":
            leases[op.seq] = dataclasses.replace(x, expires_ms=0, deliveries=_plus1(x))
            continue
        del leases[op.seq]
        done.add(op.seq)
        if op.action == "reject":
            rejected.append(Rejected(op.seq, now_ms, _plus1(x), op.reason))
            rejected_total += 1
    _settle_lapsed(leases, now_ms)
    position, cursor, lost = p.position, p.claim_cursor, p.lost
    lost_seqs = [
        s
        for s in range(position, min(low, cursor))
        if s not in done and not (s in leases and live(leases[s], now_ms))
    ]
    if low > cursor:
        lost_seqs.extend(range(cursor, low))
    if lost_seqs:
        out.lost = (lost_seqs[0], lost_seqs[-1])
        if skip_lost:
            for s in lost_seqs:
                leases.pop(s, None)
                done.add(s)
            lost += len(lost_seqs)
            cursor = max(cursor, low)
    while position in done:
        done.discard(position)
        position += 1
    if out.lost is None or skip_lost:
        for s in sorted(leases):
            if len(out.claimed) >= limits.claim_n:
                break
            x = leases[s]
            if live(x, now_ms) or s < low:
                continue
            if limits.max_deliveries is not None and x.deliveries >= limits.max_deliveries:
                del leases[s]
                done.add(s)
                rejected.append(Rejected(s, now_ms, x.deliveries, MAX_DELIVERIES_REASON))
                rejected_total += 1
                out.auto_rejected.append(s)
                continue
            leases[s] = Lease(s, x.deliveries, now_ms + limits.lease_ms, op_token)
            out.claimed.append(leases[s])
        while position in done:
            done.discard(position)
            position += 1
        while (
            len(out.claimed) < limits.claim_n
            and cursor < next_seq
            and cursor < position + limits.max_span
        ):
            leases[cursor] = Lease(cursor, 0, now_ms + limits.lease_ms, op_token)
            out.claimed.append(leases[cursor])
            cursor += 1
    if len(rejected) > REJECTED_CAP:
        rejected = rejected[-REJECTED_CAP:]
    marks = {w.worker_id: w for w in p.workers}
    marks[worker_id] = WorkerMark(worker_id, op_token, now_ms)
    workers = sorted(marks.values(), key=lambda w: w.seen_ms, reverse=True)[:WORKERS_CAP]
    out.claimed.sort(key=lambda x: x.seq)
    out.progress = dataclasses.replace(
        p,
        position=position,
        claim_cursor=cursor,
        updated_ms=now_ms,
        lost=lost,
        done=_ranges(s for s in done if s > position),
        leases=tuple(leases[s] for s in sorted(leases)),
        rejected=tuple(rejected),
        rejected_total=rejected_total,
        workers=tuple(workers),
    )
    return out


def _plus1(x: Lease) -> int:
    return min(x.deliveries + 1, 0xFFFF)


def _settle_lapsed(leases: dict[int, Lease], now_ms: int) -> None:
    """Leases whose holder went silent past their lapse: charge one delivery to the lowest
    sequence of each such claim (the entry its worker was on) and hand all of them back
    (``expires_ms = 0``), so the rest are never charged later.  The token stays: the old
    holder may still ack what nobody re-claimed."""
    charged: set[bytes] = set()
    for s in sorted(leases):
        x = leases[s]
        if x.expires_ms == 0 or live(x, now_ms):
            continue
        first = x.token not in charged
        charged.add(x.token)
        leases[s] = dataclasses.replace(
            x, expires_ms=0, deliveries=_plus1(x) if first else x.deliveries
        )


def landed_op(p: Progress, worker_id: bytes, tokens: Iterable[bytes]) -> bytes | None:
    """Which of this worker's operations ``tokens`` is the last it applied, if any (a retry
    after an unknown outcome finds its own write, and so that write's decisions)."""
    mark = next((w.last_op for w in p.workers if w.worker_id == worker_id), None)
    return mark if mark is not None and mark in tokens else None


def mine(p: Progress, op_token: bytes) -> list[Lease]:
    """The leases an operation took (found again after its outcome was unknown)."""
    return [x for x in p.leases if x.token == op_token]


def summary(p: Progress, now_ms: int) -> dict[str, int]:
    """Counts for listings: live leases, handed back or lapsed, done above the position."""
    live_n = sum(1 for x in p.leases if live(x, now_ms))
    return {
        "claim_cursor": p.claim_cursor,
        "leased": live_n,
        "claimable_again": len(p.leases) - live_n,
        "done_above_position": sum(b - a + 1 for a, b in p.done),
        "workers": len(p.workers),
        "rejected_total": p.rejected_total,
    }
