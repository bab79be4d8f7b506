"""Cross-writer group commit: one root CAS appends what every writer announced.

Writers upload their data objects and *announce* them (:mod:`tieredbuf.format.announce`)
instead of appending them; the writer holding the root's **commit lease** (section 8)
appends every pending announcement in one CAS (:func:`commit`), at most once per lease
interval, and renews its lease in the same write.  Exactly-once is the watermark's, as
for an append of one's own (I2): each writer's appends above its watermark are appended
in producer-sequence order, its watermark moves to the last of them, and a retry (or a
second committer) skips what a watermark already covers.  The lease is only a schedule:
two committers at once cost a conflict, never a duplicate or a loss.

**The chain rule (I10).**  A watermark must never move past an append that is not in
the queue: its writer would take the watermark for its own append's, and a later append
would "cover" a lost one.  So each announced run names the append it follows (``after``:
the writer's earlier append not yet confirmed when it announced, 0 when none is), and a
commit appends a writer's entries only while each one's ``after`` is covered by the
watermark as the commit moves it; it stops at the first whose predecessor is not in
(a *gap*: that append was held back, lost with a damaged announcement, or not listed
yet) or whose data object is older than half the GC grace period (*stale*: GC may judge
it garbage, I5), and reports where it stopped (``Committed.held``).  The writer uploads
the stale one again, or announces the missing one again; nothing after it goes in first.

This module is the decision and the CAS; :mod:`tieredbuf.produce.fanin` runs the
announcements, the committer's turns and the waiting writers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ulid import ULID

from tieredbuf.format import manifest as fm
from tieredbuf.format.announce import Announced
from tieredbuf.keys import parse_data_key
from tieredbuf.queue import cas, tree
from tieredbuf.queue.manifest_queue import WATERMARK_CAP, ManifestQueue, Snapshot


@dataclass(frozen=True, slots=True)
class Pending:
    """One writer's announced appends (increasing producer sequence), as the committer
    has them: read from the store (``key`` names the announcement) or handed over in
    memory by a writer of the committer's own process (``key`` None); ``after``: the
    append they follow (0: every earlier one of the writer was confirmed)."""

    producer_id: str
    entries: tuple[Announced, ...]
    key: str | None = None
    after: int = 0


@dataclass(frozen=True, slots=True)
class HeldBack:
    """Where a commit stopped appending a writer's entries, and why."""

    producer_seq: int
    """The first of the writer's appends not appended (every later one waits for it)."""
    reason: str
    """``"stale"``: its data object is older than half the grace period (``age_ms``);
    ``"gap"``: the append it follows is not in the queue."""
    age_ms: int = 0
    """A stale one's age by the committer's clock."""


@dataclass(frozen=True, slots=True)
class Committed:
    """What one commit did."""

    placed: dict[str, dict[int, tuple[int, str]]]
    """producer id -> {producer seq: (sequence, location)} of every entry this commit
    appended."""
    snapshot: Snapshot | None
    """The root as this commit wrote it (None when nothing was written)."""
    lease: fm.CommitLease | None
    """The lease as the root has it now (ours, released, or another writer's)."""
    held: dict[str, HeldBack] = field(default_factory=dict)
    """Writers whose appends stopped before their end (the chain rule, the module doc)."""
    read: Snapshot | None = None
    """Nothing written: the root this was decided on (``first``, or a fresh read)."""

    @property
    def stale(self) -> frozenset[str]:
        """Writers held back at a data object older than half the grace period."""
        return frozenset(pid for pid, h in self.held.items() if h.reason == STALE)


STALE = "stale"
GAP = "gap"


@dataclass(frozen=True, slots=True)
class _Plan:
    placed: dict[str, dict[int, tuple[int, str]]]
    marks: dict[str, tuple[int, int]]
    lease: fm.CommitLease
    held: dict[str, HeldBack]


def lease_free(lease: fm.CommitLease | None, holder: str, now_ms: int) -> bool:
    """True when ``holder`` may commit: no lease, its own, or one that lapsed by ``now_ms``
    (the caller's clock: a skewed clock only moves a takeover earlier or later)."""
    return lease is None or lease.holder == holder or lease.expires_ms <= now_ms


def commit(
    queue: ManifestQueue,
    pending: Sequence[Pending],
    *,
    holder: str,
    lease_ms: int,
    interval_ms: int,
    release: bool = False,
    successor: str | None = None,
    force: bool = False,
    max_age_ms: Callable[[Snapshot], int | None] = lambda snap: None,
    first: cas.Read[Snapshot] | None = None,
) -> Committed:
    """Append every writer's pending appends its watermark does not cover, in one CAS that
    also renews (``release``: gives up) this holder's lease.  A release with a
    ``successor`` hands the lease to that holder for ``lease_ms`` (a writer elsewhere
    that announced lately: it commits next, instead of every waiting writer racing for a
    free lease).

    Each writer's appends go in producer-sequence order, contiguous, writers in the order
    of ``pending``.  While another writer holds a live lease nothing is appended (the
    caller waits for that writer's commit), unless ``force`` (a close that cannot wait):
    then the appends go in and the other writer keeps its lease.  A lapsed lease is
    taken over.  ``max_age_ms(snap)``: appends naming a data object older than
    it are held back (listed in ``Committed.stale``) with every later one of their writer.
    ``first``: a root to try the first CAS against without reading (the holder's own last
    write).  Nothing to append and nothing to change in the lease: no write.  A writer's
    appends stop at the first that breaks the chain rule (the module doc): what is held
    back, and why, is in ``Committed.held``.
    """

    def decide(read: cas.Read[Snapshot], attempt: int) -> cas.Write[_Plan] | cas.Skip[Committed]:
        snap = read.state
        now = queue.clock_ms()
        cur = snap.root.lease
        held_elsewhere = not lease_free(cur, holder, now)
        if held_elsewhere and not force:
            return cas.Skip(Committed({}, None, cur, read=snap))
        limit = max_age_ms(snap)
        draft = queue.draft(snap)
        wms = fm.prune_watermarks(snap.view.watermarks, now, queue.watermark_ttl_ms, WATERMARK_CAP)
        placed: dict[str, dict[int, tuple[int, str]]] = {}
        marks: dict[str, tuple[int, int]] = {}
        held: dict[str, HeldBack] = {}
        for pid, chain in _by_writer(pending, snap).items():
            wm = snap.view.watermarks.get(pid)
            upto = 0 if wm is None else wm.producer_seq
            todo: list[Announced] = []
            for e, after in chain:
                if after > upto:  # its predecessor is not in: nothing of it goes past
                    held[pid] = HeldBack(e.producer_seq, GAP)
                    break
                age = age_ms(e.location, now)
                if limit is not None and age > limit:
                    held[pid] = HeldBack(e.producer_seq, STALE, age)
                    break
                todo.append(e)
                upto = e.producer_seq
            if not todo:
                continue
            first_seq = tree.append_entries(
                draft, [fm.NewEntry(e.location, e.metadata, e.size) for e in todo], now
            )
            placed[pid] = {e.producer_seq: (first_seq + i, e.location) for i, e in enumerate(todo)}
            last = first_seq + len(todo) - 1
            wms[pid] = fm.Watermark(pid, todo[-1].producer_seq, last, now)
            marks[pid] = (last, now)
        if held_elsewhere:
            assert cur is not None
            lease = cur
        else:
            lease = fm.CommitLease(holder, now + lease_ms, interval_ms)
            if release:
                lease = (
                    fm.CommitLease(successor, now + lease_ms, interval_ms)
                    if successor is not None and successor != holder
                    else fm.CommitLease(holder, 0, interval_ms)
                )
        releasing = release and cur is not None and cur.holder == holder and cur.expires_ms > now
        if not placed and not releasing:
            return cas.Skip(Committed({}, None, cur, held, read=snap))
        draft.watermarks = wms
        draft.lease = lease
        return cas.Write(queue.build(draft, now), _Plan(placed, marks, lease, held))

    def done(plan: _Plan, etag: str) -> Committed:
        queue.stats.incr("commits")
        queue.stats.incr("entries_appended", sum(len(v) for v in plan.placed.values()))
        queue.stats.incr("writers_committed", len(plan.placed))
        return Committed(plan.placed, queue.latest_snapshot(), plan.lease, plan.held)

    def landed(read: cas.Read[Snapshot], tried: Sequence[_Plan]) -> Committed | None:
        snap = read.state
        for plan in tried:
            if plan.marks:
                pid, mark = next(iter(plan.marks.items()))
                wm = snap.view.watermarks.get(pid)
                if wm is None or (wm.last_sequence, wm.updated_ms) != mark:
                    continue
            elif snap.root.lease != plan.lease:
                continue
            queue.stats.incr("deduplicated_appends")
            return Committed(plan.placed, snap, snap.root.lease, plan.held)
        return None

    return queue.run_cas(decide, done, landed=landed, first=first)


def _by_writer(
    pending: Sequence[Pending], snap: Snapshot
) -> dict[str, list[tuple[Announced, int]]]:
    """Per writer (in the order first seen), its appends above its watermark, each with
    the append it follows: each producer seq once, ascending.  A re-announcement (after
    a restart, or of data uploaded again past half the grace period) may repeat some,
    naming the same records in another object: the freshest object wins (the older may
    be GC's soon), and the lowest ``after`` (each was true when announced, and appends
    are only ever confirmed, never unconfirmed)."""
    out: dict[str, dict[int, tuple[Announced, int]]] = {}
    for p in pending:
        wm = snap.view.watermarks.get(p.producer_id)
        floor = 0 if wm is None else wm.producer_seq
        mine = out.setdefault(p.producer_id, {})
        after = p.after
        for e in p.entries:
            if e.producer_seq > floor:
                had = mine.get(e.producer_seq)
                if had is None:
                    mine[e.producer_seq] = (e, after)
                else:
                    fresh = _uploaded_ms(e.location) > _uploaded_ms(had[0].location)
                    mine[e.producer_seq] = (e if fresh else had[0], min(after, had[1]))
            after = e.producer_seq
    return {pid: [m[k] for k in sorted(m)] for pid, m in out.items() if m}


def _uploaded_ms(location: str) -> int:
    u = parse_data_key(location)
    return -1 if u is None else u.milliseconds


def age_ms(location: str, now_ms: int) -> int:
    """How old the data object at ``location`` is by ``now_ms`` (its ULID's time; 0 for
    a location that is not a data key)."""
    u = parse_data_key(location)
    return 0 if u is None else now_ms - u.milliseconds


def locate(snap: Snapshot, want: set[str], writers: set[str], floor: int) -> dict[str, int]:
    """Sequences of the data objects at ``want``, appended by ``writers``, found by location
    in ``snap`` (each a unique ULID key); one absent (already dequeued) stays unknown.  A
    commit puts each writer's appends together, ending at its watermark, so the few entries
    before the watermarks are looked at first; only what is not there is looked for from
    ``floor`` on (none can lie below it: the root's next sequence when they were handed
    over), for a writer's appends split over commits not seen one by one."""
    marks = [wm.last_sequence for w in writers if (wm := snap.view.watermarks.get(w)) is not None]
    last = max(marks, default=-1)
    found: dict[str, int] = {}

    def scan(start: int) -> None:
        for e in snap.iter_from(start):
            if e.sequence > last:
                return
            if e.location in want:
                found[e.location] = e.sequence
                if len(found) == len(want):
                    return

    near = min(marks, default=0) - len(want) + 1
    scan(max(near, 0))
    if len(found) < len(want) and floor < near:
        scan(floor)
    return found


def new_holder_id() -> str:
    """A fresh committer identity (one per process and buffer)."""
    return f"h-{ULID()}"
