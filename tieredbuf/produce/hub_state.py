"""What the parts of one commit hub share (:mod:`tieredbuf.produce.fanin`): its writers'
waiting groups, the root as last seen, and the times its turns are planned by.  One
condition guards it all; the parts -- the commit turn, the watch turn, the lease, the
settlement -- each hold this state and nothing of each other's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

from tieredbuf.config import DEFAULT_GC_GRACE_PERIOD
from tieredbuf.format import announce as fa
from tieredbuf.produce.rhythm import Rhythm
from tieredbuf.queue.commit import Pending
from tieredbuf.queue.manifest_queue import ManifestQueue, Snapshot
from tieredbuf.runtime.stats import Stats
from tieredbuf.store.base import Store

MIN_INTERVAL_S = 0.02
"""Unpaced writers (``manifest_writes_per_s=0``) still LIST at most this often."""
REANNOUNCE_AFTER = 3
"""A watcher announces a group again once the holder has committed this many times after
its announcement landed without carrying it (a damaged or deleted announcement, one held
back behind another), then after twice as many each time (:meth:`Group.missed`)."""

Done = Callable[[list[tuple[int, str]] | None, BaseException | None], None]
"""Called once per submitted group: each entry's (sequence, location) as found in a
manifest (I10), or the error."""
Refresh = Callable[[Sequence[fa.Announced]], list[fa.Announced]]
"""Upload the group's data objects again under fresh keys (the GC grace rule)."""


@dataclass(eq=False)
class Group:
    """One writer's uploaded appends, handed to the hub together (producer-sequence order)."""

    producer_id: str
    entries: tuple[fa.Announced, ...]
    done: Done
    refresh: Refresh | None
    floor: int
    """No entry of this group can have a sequence below this (the root's next sequence
    when it was submitted or announced)."""
    announced: bool = False
    submitted: float = field(default_factory=time.monotonic)
    listed_from: float = 0.0
    """When its announcement landed: a holder's LIST finds it from then on."""
    uploads: dict[int, tuple[str, ...]] = field(default_factory=dict)
    """Producer seq -> every data object its records were uploaded to (a refresh adds
    one; the queue may hold any one of them)."""
    missed: int = 0
    """The holder's commits seen since its announcement landed, none carrying it."""
    patience: int = REANNOUNCE_AFTER

    def __post_init__(self) -> None:
        for e in self.entries:
            self.uploads.setdefault(e.producer_seq, (e.location,))

    @property
    def last_seq(self) -> int:
        return self.entries[-1].producer_seq

    def refreshed(self, fresh: Sequence[fa.Announced]) -> None:
        """Its data objects were uploaded again: announce the fresh ones (under the lock)."""
        self.entries = tuple(fresh)
        for e in self.entries:
            had = self.uploads.get(e.producer_seq, ())
            if e.location not in had:
                self.uploads[e.producer_seq] = (*had, e.location)
        self.announced = False
        self.missed = 0

    def missed_commit(self) -> bool:
        """The holder committed without it (after its announcement could be listed):
        True when it is time to announce it again (and then wait twice as long)."""
        self.missed += 1
        if self.missed < self.patience:
            return False
        self.patience *= 2
        self.missed = 0
        self.announced = False
        return True


class HubState:
    """The state of one hub, under :attr:`cond`."""

    def __init__(
        self,
        store: Store,
        queue: ManifestQueue,
        holder: str,
        wall_ms: Callable[[], int],
        stats: Stats,
    ) -> None:
        self.store = store
        self.queue = queue
        self.holder = holder
        self.wall_ms = wall_ms
        self.stats = stats
        self.cond = threading.Condition()
        self.waiting: dict[str, list[Group]] = {}
        """Per writer, its groups not done yet, in producer-sequence order."""
        self.budgets: dict[int, float] = {}
        self.graces: dict[int, int] = {}
        self.last_interval = MIN_INTERVAL_S
        self.view: Snapshot | None = None
        """The root as this hub last read or wrote it."""
        self.last_commit = 0.0
        """When (monotonic) this hub's last commit turn sent its CAS."""
        self.rhythm = Rhythm()
        """When the root changed, and when a watcher looks next."""
        self.announce_s = 0.0
        """An announcement's PUT (EWMA)."""

    # --- reads (callers hold :attr:`cond` where they need a consistent view) ------------

    def groups(self) -> Iterator[Group]:
        for gs in self.waiting.values():
            yield from gs

    def interval(self) -> float:
        """Seconds between commits: the lowest budget of the writers attached (the last
        one used while none is)."""
        if self.budgets:
            budgets = [b for b in self.budgets.values() if b > 0]
            paced = 1.0 / min(budgets) if len(budgets) == len(self.budgets) else 0.0
            self.last_interval = max(paced, MIN_INTERVAL_S)
        return self.last_interval

    def max_age_ms(self, snap: Snapshot) -> int:
        """Half the buffer's GC grace period (the root's; the default before it has one):
        an older data object may be GC's already (I5)."""
        grace = snap.gc_grace_ms
        if grace is None:
            grace = min(
                self.graces.values(), default=DEFAULT_GC_GRACE_PERIOD // timedelta(milliseconds=1)
            )
        return grace // 2

    def pending(self, include: Callable[[Group], bool]) -> list[Pending]:
        """The groups ``include`` picks, as a commit takes them: each naming the append it
        follows -- the writer's group before it while that one waits too, else nothing
        (every earlier append of the writer was confirmed; the chain rule,
        :mod:`tieredbuf.queue.commit`).  Under :attr:`cond`."""
        out = []
        for pid, gs in self.waiting.items():
            for i, g in enumerate(gs):
                if include(g):
                    out.append(Pending(pid, g.entries, after=gs[i - 1].last_seq if i else 0))
        return out

    def to_announce(self, created_ms: int) -> tuple[list[fa.Announcement], list[Group]]:
        """What an announcement carries now: per writer, its groups from the first one not
        announced yet to its last (a run's appends follow each other, so one announced
        already between two that are not goes again), following the group before them
        while that one waits; and those groups.  Under :attr:`cond`."""
        runs, carried = [], []
        for pid, gs in self.waiting.items():
            first = next((i for i, g in enumerate(gs) if not g.announced), None)
            if first is None:
                continue
            entries = [e for g in gs[first:] for e in g.entries]
            after = gs[first - 1].last_seq if first else 0
            runs.append(fa.make(pid, created_ms, entries, after))
            carried.extend(gs[first:])
        return runs, carried
