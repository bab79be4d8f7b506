"""What one worker holds between its CASes (bookkeeping only: no I/O, no clock).

* ``held``: each sequence leased to it -- the lease token and expiry, whether its
  history is unknown (SUSPECT: marked before it is returned), whether claim() returned
  it, whether the progress object has (or will get, with the next CAS) the word that it
  did (``said``), and whether a mark is still on its way (``marking``);
* ``ready``: the line of entries to hand out, as (sequence, token): an item whose
  token is no longer the one held (released, re-leased, resolved) is stale and skipped,
  so a sequence released and leased again is never handed out twice;
* ``ops``: the operations buffered for the next CAS, with the lease expiry of each
  (``op_due``: when it must be applied at the latest).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Sequence

from tieredbuf.format.progress import SUSPECT, Lease
from tieredbuf.queue import shared


@dataclasses.dataclass(slots=True)
class Held:
    token: bytes
    expires_ms: int
    suspect: bool = False
    """Its history is unknown: mark it (a CAS) before claim() returns it."""
    handed_out: bool = False
    said: bool = False
    """An ``out`` or ``mark`` op for it is buffered or applied."""
    marking: bool = False
    """Its mark is buffered and has not landed yet: claim() must not return it."""


class Holdings:
    """One worker's leases, hand-out line and buffered operations."""

    def __init__(self) -> None:
        self.held: dict[int, Held] = {}
        self.ready: deque[tuple[int, bytes]] = deque()
        self.ops: list[shared.Op] = []
        self.op_due: dict[int, int] = {}
        self.lapsed: set[int] = set()
        """Sequences re-leased by this worker while the caller still had them: their
        late ack is refused (LeaseExpiredError)."""

    def current(self, seq: int, token: bytes) -> bool:
        """``(seq, token)`` is a ready item still to hand out."""
        h = self.held.get(seq)
        return h is not None and h.token == token and not h.handed_out

    def ready_n(self) -> int:
        return sum(1 for s, t in self.ready if self.current(s, t))

    def has_ready(self) -> bool:
        return any(self.current(s, t) for s, t in self.ready)

    def front(self) -> tuple[int, Held] | None:
        """The next entry to hand out (stale items before it are dropped)."""
        while self.ready:
            seq, token = self.ready[0]
            if self.current(seq, token):
                return seq, self.held[seq]
            self.ready.popleft()
        return None

    def buffer(self, op: shared.Op, due_ms: int) -> None:
        self.ops.append(op)
        self.op_due[op.seq] = due_ms

    def soonest_due(self) -> int | None:
        return min((self.op_due.get(op.seq, 1 << 62) for op in self.ops), default=None)

    def applied(self, n: int) -> list[shared.Op]:
        """The first ``n`` buffered ops were applied by a CAS: taken off the buffer."""
        done = self.ops[:n]
        del self.ops[:n]
        waiting = {op.seq for op in self.ops}
        self.op_due = {s: d for s, d in self.op_due.items() if s in waiting}
        return done

    def lapsing(self, now_ms: int, margin_ms: int) -> list[int]:
        """Leased entries still in line, never said to be handed out, whose lease is
        within ``margin_ms`` of lapsing: to hand back uncharged."""
        return [
            s
            for s, t in self.ready
            if self.current(s, t)
            and not self.held[s].said
            and self.held[s].expires_ms - margin_ms <= now_ms
        ]

    def lease(self, leases: Sequence[Lease]) -> None:
        """Take in leases a CAS took for this worker (queued to hand out, in order)."""
        for x in leases:
            h = self.held.get(x.seq)
            if h is not None and h.handed_out:
                # its lease lapsed while the caller still had it, and this worker's own
                # refill took it again: redelivered (to the caller too); the late ack of
                # the first hand-out is refused
                self.lapsed.add(x.seq)
            self.held[x.seq] = Held(x.token, x.expires_ms, suspect=bool(x.flags & SUSPECT))
            self.ready.append((x.seq, x.token))

    def renewed(self, ops: Sequence[shared.Op], applied: shared.Applied) -> list[tuple[int, str]]:
        """Marks and extends a CAS applied renew the holder's lease (its expiry as
        written); refused ones mean the entry is another worker's now: dropped, and
        returned as (sequence, why) for the caller to clean up after."""
        refused = set(applied.expired) | set(applied.refused_marks)
        now_held = {x.seq: x for x in applied.progress.leases}
        gone: list[tuple[int, str]] = []
        for op in ops:
            if op.action not in ("mark", "extend"):
                continue
            h = self.held.get(op.seq)
            if h is None or h.token != op.token:
                continue
            x = now_held.get(op.seq)
            if op.seq in refused or x is None or x.token != op.token:
                del self.held[op.seq]
                gone.append(
                    (op.seq, "lost_lease_before_use" if op.action == "mark" else "lost_lease")
                )
                continue
            h.expires_ms = x.expires_ms
            if op.action == "mark":
                h.marking = False
        return gone
