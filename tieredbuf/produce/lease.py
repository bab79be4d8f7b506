"""One hub's view of the root's commit lease (section 8): whether it holds it, how long a
lease it asks for, and which hub inherits it when its last writer leaves.

The lease says which hub commits for every writer of a buffer (fan-in,
:mod:`tieredbuf.produce.fanin`).  It is a schedule, not a lock: two holders at once (a
clock a few seconds off judging a lease lapsed) cost a CAS conflict, never a duplicate
or a loss (the watermarks and the chain rule keep the appends exactly-once, I2, I10).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from tieredbuf import keys
from tieredbuf.queue.commit import lease_free
from tieredbuf.queue.manifest_queue import Snapshot

LEASE_MIN_S = 5.0
"""A lease lasts at least this long (and four intervals): a holder that dies delays
commits by at most this much, and clocks a second or two apart do not flap it."""
FIRST_TURN_S = 0.5
"""A commit turn not measured yet counts this long in a lease: the first lease was two
intervals (0.4 s), shorter than its own conditional PUT under load (0.3-0.7 s on
``file://`` with 16 processes writing and fsyncing), so it had lapsed when it landed and
every waiting writer raced for it."""


class Lease:
    """What one hub knows and decides about the commit lease."""

    def __init__(self, holder: str, wall_ms: Callable[[], int]) -> None:
        self.holder = holder
        self.wall_ms = wall_ms
        self.met_at = -LEASE_MIN_S
        """When (monotonic) this hub last met another hub's lease."""
        self.turn_s = 0.0
        """A commit turn (LIST to CAS): the slowest lately, decaying."""
        self.announcers: dict[str, float] = {}
        """Hub -> when (monotonic) its last announcement was listed."""

    def holding(self, view: Snapshot | None) -> bool:
        """Our lease is live (as far as ``view``, our last view of the root, says)."""
        lease = None if view is None else view.root.lease
        return (
            lease is not None and lease.holder == self.holder and lease.expires_ms > self.wall_ms()
        )

    def free(self, view: Snapshot) -> bool:
        """We may commit: no lease, ours, or a lapsed one (our clock)."""
        return lease_free(view.root.lease, self.holder, self.wall_ms())

    def met(self, at: float | None = None) -> None:
        """Another hub's lease was met (now, or at ``at``)."""
        self.met_at = time.monotonic() if at is None else at

    def length_ms(self, interval: float, others: bool) -> int:
        """Long while others announce, or were met lately (a lapse would make them race
        for it: a writer that took a lapsed lease over commits its own groups first, and
        its short lease lapsed again before its next turn on a busy machine, herd after
        herd); with only our own writers two periods: the holder takes its turns (a LIST
        each) while its lease lives, and a quiet one sends nothing once it lapsed.  A
        period is an interval plus a turn (:data:`FIRST_TURN_S` before one was measured):
        a lease that lapsed between two commits of a busy holder let a writer elsewhere
        race it, lose, and starve."""
        turn = self.turn_s or FIRST_TURN_S
        if others:
            return int(max(LEASE_MIN_S, 4 * interval, 4 * (interval + turn)) * 1000)
        return int(2 * (interval + turn) * 1000)

    def handover_ms(self, interval: float) -> int:
        """The lease a leaving holder hands over: long enough for its heir to see it and
        commit, short if the heir is gone meanwhile."""
        return int(4 * (interval + self.turn_s) * 1000)

    def turn_took(self, seconds: float) -> None:
        self.turn_s = max(seconds, self.turn_s * 0.9)

    def alone(self, interval: float) -> bool:
        """No hub announced to this one, and it met no other hub's lease, lately."""
        return time.monotonic() - self.met_at > LEASE_MIN_S and self.heir(interval) is None

    def heard(self, announcement_keys: Iterable[str]) -> None:
        """The hubs whose announcements a turn listed, when (our clock) last: the one heard
        from last inherits the lease (:meth:`heir`)."""
        now = time.monotonic()
        for k in announcement_keys:
            parsed = keys.parse_pending_key(k)
            if parsed is not None and parsed[0] != self.holder:
                self.announcers[parsed[0]] = now

    def heir(self, interval: float) -> str | None:
        """The hub heard from last, within a long lease's time (after that it may be gone:
        a gone heir delays the others by its lease, four periods)."""
        recent = time.monotonic() - self.length_ms(interval, True) / 1000
        self.announcers = {h: t for h, t in self.announcers.items() if t > recent}
        return max(self.announcers, key=lambda h: self.announcers[h], default=None)
