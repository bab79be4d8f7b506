"""Shared work queues: the pure decisions on one subscriber's progress (no I/O, no clock).

Quiver's bundle lifecycle on a queue: a sequence is *claimable*, *leased* to one worker
until its lease lapses, or *done* (acked or rejected: terminal).  The subscriber's
position is the oldest sequence not done (Quiver's high-water mark), with done ranges
kept above it for out-of-order acks.  A worker applies its buffered operations and
leases its next batch in **one** CAS of the progress object; :func:`apply` is that
CAS's pure step, and the only place that decides a delivery charge.

**A delivery is a claim() that returned the entry** -- never a lease: a refill leases
a batch of which the worker may return only some, and a worker may die or stall at any
point.  So the progress object counts a delivery only on the word of the worker that
returned the entry, and each lease record says what is known (``format.progress``
lease flags)::

                 claim (a CAS leases it under the claim's token)
    claimable ----------------------------------------------> held
      ^  ^   (BACK,                                           |  |  |
      |  |    expires <= now)   out: claim() returned it  ----+  |  |  (+1 delivery, OUT;
      |  |                      (sent with the next CAS)         |  |   once per token)
      |  |                      mark: out + a fresh lease,       |  |
      |  |                      *before* claim() returns it -----+  |
      |  |                      extend: held until now + by --------+
      |  +-- defer (BACK, claimable after the backoff) / release (never returned:
      |      BACK now, and a mark it made is taken back) ------------+
      +----- lapse: held past expires_ms, its holder silent.  Settled by the next CAS
             of any worker: BACK, claimable now, **no charge**; if no hand-out was
             counted under that token it is marked SUSPECT.
    held --ack / reject (under its token; also once lapsed if nobody re-leased it)--> done

* ``out`` and ``mark`` are the only charges, each at most once per token, and only
  while the record still carries that token: a worker that stalled past its lease and
  was re-leased has its late word ignored (an under-count, never an over-count).
* A worker killed after claim() returned an entry but before its next CAS leaves no
  word: the lapse charges nothing and marks the entry SUSPECT.  A suspect entry is
  then always ``mark``-ed -- the charge made durable -- *before* claim() returns it, so
  an entry that kills every worker it reaches is still dead-lettered: after at most
  ``max_deliveries + 1`` real deliveries (the first one unrecorded).  A worker killed
  between its mark's CAS and claim()'s return is charged for a delivery it did not
  complete: the one gap, as SQS counts a receive whose response was lost.
* ``max_deliveries`` rejects an entry instead of leasing it again once ``deliveries``
  reached it; ``defer`` makes it claimable after :func:`backoff` (growing with its
  deliveries); a rejected entry is ``KEPT`` (its data held) until :func:`redrive`
  makes it claimable again with its count reset, or drops it.

An ack (or reject, extend) counts only under the lease it was handed out with (the
claim operation's token): once another claim has re-leased a lapsed sequence, the old
holder's ack is refused (``expired``) and changes nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from tieredbuf.format.progress import (
    BACK,
    KEPT,
    MAX_SPAN,
    OUT,
    REJECTED_CAP,
    SUSPECT,
    WORKERS_CAP,
    Lease,
    Progress,
    Rejected,
    WorkerMark,
)

Action = Literal["out", "mark", "ack", "reject", "defer", "release", "extend"]
MAX_DELIVERIES_REASON = b"max_deliveries reached"


@dataclass(frozen=True, slots=True)
class Op:
    """A worker's word on one sequence it leased under ``token`` (module docstring):
    ``out`` (claim() returned it), ``mark`` (claim() is about to return it: charged now,
    under a fresh lease of ``ms``), ``ack``, ``reject`` (with ``reason``), ``defer``
    (claimable again after ``ms``, or the backoff when None), ``release`` (never
    returned: no charge; claimable again at once, or after ``ms``: a damaged data object
    that would fail the next worker too), ``extend`` (held for ``ms`` from now)."""

    action: Action
    seq: int
    token: bytes
    reason: bytes = b""
    ms: int | None = None


@dataclass(frozen=True, slots=True)
class Limits:
    lease_ms: int
    claim_n: int
    max_span: int
    max_deliveries: int | None = None
    backoff_ms: int = 1000
    """A deferred entry's delay after its first delivery; doubling with each further one."""
    backoff_max_ms: int = 300_000


@dataclass(slots=True)
class Applied:
    progress: Progress
    claimed: list[Lease] = dataclasses.field(default_factory=list)
    expired: list[int] = dataclasses.field(default_factory=list)
    """Acks / rejects / extends refused: another claim re-leased the sequence, or it is
    done (LeaseExpiredError)."""
    ignored_defers: list[int] = dataclasses.field(default_factory=list)
    """Defers, releases and outs of a lease no longer this token's (nothing to do)."""
    refused_marks: list[int] = dataclasses.field(default_factory=list)
    """Marks of a lease no longer this token's: claim() must not return the entry."""
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
    """Held by its claimer: not handed back, not lapsed by ``now_ms`` (the caller's clock)."""
    return not lease.back and lease.expires_ms > now_ms


def claimable(lease: Lease, now_ms: int) -> bool:
    """Not held, and past any redelivery delay (a lapsed lease is claimable)."""
    return not live(lease, now_ms) and (not lease.back or lease.expires_ms <= now_ms)


def backoff(deliveries: int, limits: Limits) -> int:
    """Milliseconds a deferred entry waits before it is claimable again: ``backoff_ms``
    after its first delivery, doubling with each further one, at most ``backoff_max_ms``."""
    if limits.backoff_ms <= 0:
        return 0
    step = max(1, deliveries) - 1
    return min(limits.backoff_max_ms, limits.backoff_ms << min(step, 32))


def _plus1(x: Lease) -> int:
    return min(x.deliveries + 1, 0xFFFF)


def _resolve(
    leases: dict[int, Lease], op: Op, now_ms: int, limits: Limits, out: Applied
) -> Lease | None:
    """Apply one op to its lease record; the record an ack / reject removes (else None)."""
    x = leases.get(op.seq)
    mine = x is not None and x.token == op.token
    if x is None or not mine:
        if op.action in ("defer", "release", "out"):
            out.ignored_defers.append(op.seq)
        elif op.action == "mark":
            out.refused_marks.append(op.seq)
        else:
            out.expired.append(op.seq)
        return None
    counted = bool(x.flags & OUT)
    if op.action == "out":
        if not counted:
            leases[op.seq] = dataclasses.replace(x, deliveries=_plus1(x), flags=x.flags | OUT)
    elif op.action in ("mark", "extend"):
        ms = limits.lease_ms if op.ms is None else op.ms
        flags = x.flags & ~BACK
        deliveries = x.deliveries
        if op.action == "mark" and not counted:
            flags, deliveries = flags | OUT, _plus1(x)
        leases[op.seq] = dataclasses.replace(
            x, expires_ms=now_ms + ms, flags=flags, deliveries=deliveries
        )
    elif op.action == "release":
        # never returned: a mark it made (whose claim() then failed) is taken back
        deliveries = x.deliveries - 1 if counted and x.deliveries else x.deliveries
        flags = (x.flags | BACK) & ~OUT
        expires = now_ms + op.ms if op.ms else 0
        leases[op.seq] = dataclasses.replace(
            x, expires_ms=expires, flags=flags, deliveries=deliveries
        )
    elif op.action == "defer":
        delay = backoff(x.deliveries, limits) if op.ms is None else op.ms
        leases[op.seq] = dataclasses.replace(
            x, expires_ms=now_ms + delay if delay > 0 else 0, flags=x.flags | BACK
        )
    else:  # ack, reject
        del leases[op.seq]
        return x
    return None


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
    """One worker CAS: apply ``ops`` in order, settle lapsed leases, handle sequences lost
    to retention, lease the next ``limits.claim_n`` claimable sequences (lowest first)
    under ``op_token``."""
    done = _done_set(p)
    leases = {x.seq: x for x in p.leases}
    rejected = list(p.rejected)
    rejected_total = p.rejected_total
    out = Applied(p)
    for op in ops:
        if op.seq >= p.claim_cursor:
            raise ValueError(f"sequence {op.seq} was never claimed")
        x = _resolve(leases, op, now_ms, limits, out)
        if x is not None:
            done.add(op.seq)
            if op.action == "reject":
                rejected.append(Rejected(op.seq, now_ms, x.deliveries, op.reason, KEPT))
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
            if not claimable(x, now_ms) or s < low:
                continue
            if limits.max_deliveries is not None and x.deliveries >= limits.max_deliveries:
                del leases[s]
                done.add(s)
                rejected.append(Rejected(s, now_ms, x.deliveries, MAX_DELIVERIES_REASON, KEPT))
                rejected_total += 1
                out.auto_rejected.append(s)
                continue
            leases[s] = Lease(
                s, x.deliveries, now_ms + limits.lease_ms, op_token, x.flags & SUSPECT
            )
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


def _settle_lapsed(leases: dict[int, Lease], now_ms: int) -> None:
    """Leases whose holder went silent past their lapse are handed back, claimable at
    once, and **charged nothing**: only the holder's own word (``out``, ``mark``) counts
    a delivery.  One whose hand-out nobody counted may have been returned all the same
    (the holder died before its next CAS): SUSPECT from then on.  The token stays: the
    old holder may still ack what nobody re-claimed."""
    for s, x in leases.items():
        if x.back or x.expires_ms > now_ms:
            continue
        flags = x.flags | BACK | (0 if x.flags & OUT else SUSPECT)
        leases[s] = dataclasses.replace(x, expires_ms=0, flags=flags)


@dataclass(slots=True)
class Redriven:
    progress: Progress
    redriven: list[int] = dataclasses.field(default_factory=list)
    dropped: list[int] = dataclasses.field(default_factory=list)
    unlinked: list[int] = dataclasses.field(default_factory=list)
    """Kept dead letters below ``low``: retention unlinked their entries."""
    not_found: list[int] = dataclasses.field(default_factory=list)
    """Asked for, but not a kept dead letter (never rejected, redriven or dropped already,
    or older than the rejected list keeps)."""


def redrive(
    p: Progress,
    sequences: Collection[int] | None,
    *,
    token: bytes,
    now_ms: int,
    low: int,
    drop: bool = False,
) -> Redriven:
    """Make kept dead letters (``sequences``, or all) claimable again with their delivery
    count reset -- or, with ``drop``, let the buffer unlink them (they stay listed).  A
    redriven entry's lease record carries ``token`` (a retry finds its own write)."""
    kept = {r.seq: r for r in p.rejected if r.flags & KEPT}
    want = sorted(kept) if sequences is None else sorted(set(sequences))
    out = Redriven(p)
    out.not_found = [s for s in want if s not in kept]
    targets = [s for s in want if s in kept]
    if drop:
        out.dropped = targets
        rejected = tuple(
            dataclasses.replace(r, flags=r.flags & ~KEPT) if r.seq in targets else r
            for r in p.rejected
        )
        out.progress = dataclasses.replace(p, rejected=rejected, updated_ms=now_ms)
        return out
    out.unlinked = [s for s in targets if s < low]
    again = [s for s in targets if s >= low]
    if not again:
        return out
    position = min(p.position, again[0])
    if p.claim_cursor - position > MAX_SPAN:
        raise ValueError(
            f"sequence {again[0]} is {p.claim_cursor - position} sequences behind the claim "
            f"cursor (at most {MAX_SPAN}): redrive newer dead letters"
        )
    done = _done_set(p) | set(range(position, p.position))
    done.difference_update(again)
    leases = {x.seq: x for x in p.leases}
    for s in again:
        leases[s] = Lease(s, 0, 0, token, BACK)
    out.redriven = again
    while position in done:
        done.discard(position)
        position += 1
    out.progress = dataclasses.replace(
        p,
        position=position,
        updated_ms=now_ms,
        done=_ranges(s for s in done if s > position),
        leases=tuple(leases[s] for s in sorted(leases)),
        rejected=tuple(r for r in p.rejected if r.seq not in set(again)),
    )
    return out


def landed_op(p: Progress, worker_id: bytes, tokens: Iterable[bytes]) -> bytes | None:
    """Which of this worker's operations ``tokens`` is the last it applied, if any (a retry
    after an unknown outcome finds its own write, and so that write's decisions)."""
    mark = next((w.last_op for w in p.workers if w.worker_id == worker_id), None)
    return mark if mark is not None and mark in tokens else None


def mine(p: Progress, op_token: bytes) -> list[Lease]:
    """The leases an operation took (found again after its outcome was unknown)."""
    return [x for x in p.leases if x.token == op_token and not x.back]


def next_due(p: Progress, after_ms: int) -> int | None:
    """The first time after ``after_ms`` (the caller's clock) at which an entry becomes
    claimable by time alone: a held lease lapsing, a deferred entry's delay ending.
    None: no such entry."""
    times = [x.expires_ms for x in p.leases if x.expires_ms > after_ms]
    return min(times) if times else None


def summary(p: Progress, now_ms: int) -> dict[str, int]:
    """Counts for listings: live leases, claimable again (handed back or lapsed), waiting
    (deferred, in their redelivery delay), done above the position, dead letters kept."""
    live_n = sum(1 for x in p.leases if live(x, now_ms))
    waiting = sum(1 for x in p.leases if x.back and x.expires_ms > now_ms)
    return {
        "claim_cursor": p.claim_cursor,
        "leased": live_n,
        "claimable_again": len(p.leases) - live_n - waiting,
        "waiting": waiting,
        "done_above_position": sum(b - a + 1 for a, b in p.done),
        "workers": len(p.workers),
        "rejected_total": p.rejected_total,
        "rejected_kept": sum(1 for r in p.rejected if r.flags & KEPT),
    }
