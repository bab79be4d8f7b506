"""Fan-in: one commit per interval carries what every writer has uploaded.

Every writer (a stateless producer, one stream of an exporter) hands its uploaded
appends to the :class:`CommitHub` of its buffer in this process (:func:`hub_for`).
The hub plays one of two parts at a time, decided by the root's commit lease
(section 8; :mod:`tieredbuf.queue.commit`):

* **committer** (the lease is its own, or free, or lapsed): once per interval
  (``1 / manifest_writes_per_s``) it LISTs ``queue/pending/``, reads the
  announcements it has not read yet, and appends them together with its own
  process's appends (handed over in memory) in one root CAS that renews its lease;
  the announcements the watermarks now cover it deletes together, at most once a
  second, and all of them before it gives the lease up.  While it holds a live lease
  and nothing is pending it only LISTs; once the lease lapses it stops.
* **watcher** (another writer holds a live lease): it announces its process's
  appends (one create-if-absent PUT a turn, carrying every writer's), then reads the
  root when the holder's next commit is due (:mod:`tieredbuf.produce.rhythm`), by a
  conditional GET that costs a 304 while it is unchanged; what a watermark now covers
  is done.

Either way a waiting write is done when its writer's watermark covers it; its sequence
is read from the root (the committer knows it from its own write).  A writer's REMOTE
latency is its upload, an announcement and about one interval -- whatever the number
of writers -- and the root takes one write per interval (docs/architecture.md,
"Fan-in").  Exactly-once is the watermark's (I2); a holder that dies only delays
commits until its lease lapses; two holders at once (clock skew) cost conflicts, not
duplicates.  An idle hub makes no request.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

from tieredbuf import errors, keys
from tieredbuf.config import DEFAULT_GC_GRACE_PERIOD, RetryConfig
from tieredbuf.format import announce as fa
from tieredbuf.format.spelled import key_form
from tieredbuf.produce.announcements import AnnouncementReader, Runs
from tieredbuf.produce.rhythm import Rhythm, gap
from tieredbuf.queue import cas
from tieredbuf.queue.commit import (
    Committed,
    Pending,
    commit,
    lease_free,
    locate,
    new_holder_id,
)
from tieredbuf.queue.manifest_queue import ManifestQueue, Snapshot
from tieredbuf.runtime.retry import RetryLog, background, backoff_delay
from tieredbuf.runtime.stats import Stats, ewma
from tieredbuf.store.base import ObjectMeta, Store

log = logging.getLogger(__name__)

MIN_INTERVAL_S = 0.02
"""Unpaced writers (``manifest_writes_per_s=0``) still LIST at most this often."""
LEASE_MIN_S = 5.0
"""A lease lasts at least this long (and four intervals): a holder that dies delays
commits by at most this much, and clocks a second or two apart do not flap it."""
FIRST_TURN_S = 0.5
"""A commit turn not measured yet counts this long in a lease: the first lease was two
intervals (0.4 s), shorter than its own conditional PUT under load (0.3-0.7 s on
``file://`` with 16 processes writing and fsyncing), so it had lapsed when it landed and
every waiting writer raced for it."""


Done = Callable[[list[int | None] | None, BaseException | None], None]
"""Called once per submitted group: its sequences (None where unknown), or the error."""
Refresh = Callable[[Sequence[fa.Announced]], list[fa.Announced]]
"""Upload the group's data objects again under fresh keys (the GC grace rule)."""


@dataclass(eq=False)
class _Group:
    producer_id: str
    entries: tuple[fa.Announced, ...]
    done: Done
    refresh: Refresh | None
    floor: int
    """No entry of this group can have a sequence below this (the root's next sequence
    when it was submitted)."""
    announced: bool = False
    submitted: float = field(default_factory=time.monotonic)
    listed_from: float = 0.0
    """When its announcement landed: a holder's LIST finds it from then on."""

    @property
    def last_seq(self) -> int:
        return self.entries[-1].producer_seq


class CommitHub:
    """The fan-in of one buffer in this process; writers :meth:`attach`, :meth:`submit`
    their uploaded appends in producer-sequence order, and :meth:`detach`."""

    def __init__(self, store: Store, queue: ManifestQueue, *, retry: RetryConfig | None = None,
                 wall_ms: Callable[[], int] | None = None) -> None:
        self.store = store
        self.queue = queue
        self.retry = retry or RetryConfig()
        self.wall_ms = wall_ms or queue.clock_ms
        self.holder = new_holder_id()
        self.stats = Stats()
        self._log = RetryLog(log)
        self._cond = threading.Condition()
        self._waiting: dict[str, list[_Group]] = {}
        self._budgets: dict[int, float] = {}
        self._graces: dict[int, int] = {}
        self._last_interval = MIN_INTERVAL_S
        self._met_at = -LEASE_MIN_S  # when (monotonic) it last met another hub's lease
        self._next_token = 0
        self._view: Snapshot | None = None
        self._reader = AnnouncementReader(store, self.stats)
        self._announced_n = 0  # this hub's announcements so far (it numbers their keys)
        self._announce_s = 0.0  # an announcement's PUT (EWMA)
        self._announcers: dict[str, float] = {}  # hub -> when (monotonic) its last was listed
        self._last_commit = 0.0
        self._rhythm = Rhythm()  # when the root changed, and when a watcher looks next
        self._turn_s = 0.0  # a commit turn (LIST to CAS): the slowest lately, decaying
        self._prep_s = 0.0  # a turn's LIST and reads (EWMA, at most an interval)
        self._yield = False  # a commit met another's lease: announce before trying again
        self._error_attempt = 0
        self._thread: threading.Thread | None = None

    # --- writers -----------------------------------------------------------------------

    def attach(
        self, manifest_writes_per_s: float, gc_grace_period: timedelta = DEFAULT_GC_GRACE_PERIOD
    ) -> int:
        """A writer joins; its budget counts (the hub commits at the lowest budget of its
        writers, ``0``: unpaced), and so does its grace period where the root records
        none yet (the shortest).  Returns the token to :meth:`detach` with."""
        with self._cond:
            self._next_token += 1
            self._budgets[self._next_token] = manifest_writes_per_s
            self._graces[self._next_token] = gc_grace_period // timedelta(milliseconds=1)
            return self._next_token

    def detach(self, token: int, timeout: float = 10.0) -> None:
        """A writer leaves (its groups were all done or failed).  The last one to leave
        waits (up to ``timeout``) for the hub to give its lease up, so writers elsewhere
        take over at once and the process may exit."""
        with self._cond:
            self._budgets.pop(token, None)
            self._graces.pop(token, None)
            self._cond.notify_all()
            if not self._budgets and self._thread is not None:
                self._cond.wait_for(lambda: self._thread is None or bool(self._budgets), timeout)

    def withdraw(self, producer_id: str) -> None:
        """Stop waiting for a writer's groups (it gave up on them and failed them itself);
        an announcement of them already out may still be committed."""
        with self._cond:
            self._waiting.pop(producer_id, None)
            self._cond.notify_all()

    def submit(
        self,
        producer_id: str,
        entries: Sequence[fa.Announced],
        done: Done,
        refresh: Refresh | None = None,
    ) -> None:
        """Queue one group of a writer's uploaded appends (after every earlier group of the
        same writer); ``done`` is called once from the hub's thread."""
        if not entries:
            raise ValueError("an empty group")
        with self._cond:
            mine = self._waiting.setdefault(producer_id, [])
            if mine and mine[-1].last_seq >= entries[0].producer_seq:
                raise ValueError(f"{producer_id}: groups must come in producer-sequence order")
            floor = 0 if self._view is None else self._view.root.next_seq
            mine.append(_Group(producer_id, tuple(entries), done, refresh, floor))
            self.stats.incr("groups_submitted")
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="tb-fanin-hub", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def next_commit_in(self) -> float:
        """Seconds until a group must be submitted to go in the next commit (0: now).  A
        watcher's must be announced before the holder's LIST, which comes before its
        commit by a time the watcher does not know, and it sees commits late: it aims an
        announcement and a quarter interval (at most 75 ms: its late polls and the
        holder's LIST) early."""
        with self._cond:
            interval = self._interval()
            if self._holding() or self._view is None:
                return max(0.0, self._last_commit + interval - time.monotonic())
            early = min(interval / 4, 0.075) + self._announce_s
            return max(0.0, self._rhythm.changed_at + interval - early - time.monotonic())

    def cutoff_in(self) -> tuple[float, float] | None:
        """Holding the lease: seconds until its next turn takes its own process's groups
        (0: one submitted now goes at once), and that turn's identity (it changes once
        the turn's commit is sent); None otherwise (a group is announced)."""
        with self._cond:
            if not self._holding():
                return None
            left = self._last_commit + gap(self._interval()) - time.monotonic()
            return max(0.0, left), self._last_commit

    def pending(self) -> int:
        """Groups submitted and not done yet."""
        with self._cond:
            return sum(len(g) for g in self._waiting.values())

    # --- the loop ----------------------------------------------------------------------

    def _interval(self) -> float:
        """Seconds between commits: the lowest budget of the writers attached (the last
        one used while none is)."""
        if self._budgets:
            budgets = [b for b in self._budgets.values() if b > 0]
            paced = 1.0 / min(budgets) if len(budgets) == len(self._budgets) else 0.0
            self._last_interval = max(paced, MIN_INTERVAL_S)
        return self._last_interval

    def _lease_ms(self, interval: float, others: bool) -> int:
        """Long while others announce, or were met lately (a lapse would make them race
        for it: a writer that took a lapsed lease over commits its own groups first, and
        its short lease lapsed again before its next turn on a busy machine, herd after
        herd); with only our own writers two periods: the holder takes its turns (a LIST
        each) while its lease lives, and a quiet one sends nothing once it lapsed.  A
        period is an interval plus a turn (:data:`FIRST_TURN_S` before one was measured):
        a lease that lapsed between two commits of a busy holder let a writer elsewhere
        race it, lose, and starve."""
        turn = self._turn_s or FIRST_TURN_S
        if others:
            return int(max(LEASE_MIN_S, 4 * interval, 4 * (interval + turn)) * 1000)
        return int(2 * (interval + turn) * 1000)

    def _holding(self) -> bool:
        """Our lease is live (as far as our last view of the root says)."""
        lease = None if self._view is None else self._view.root.lease
        return (
            lease is not None and lease.holder == self.holder and lease.expires_ms > self.wall_ms()
        )

    def _loop(self) -> None:
        with background():  # its store retries go on until the writers leave
            self._serve()

    def _serve(self) -> None:
        while True:
            # no lease (lost, lapsed, never had one): delete what we committed while we
            # held it before going idle (no request when there is nothing to delete)
            if not self._holding():
                self._reader.sweep(force=True)
            with self._cond:
                while not self._waiting and not self._holding():
                    if not self._budgets:
                        self._thread = None
                        self._cond.notify_all()
                        return  # no writer left and nothing held: the hub is idle
                    self._cond.wait(1.0)
                leaving = not self._budgets and not self._waiting
                if leaving and self._alone():  # nobody announced or held the lease lately:
                    self._thread = None  # it lapses on its own (a release is a LIST and a
                    self._cond.notify_all()  # root write for nobody: a lone producer's
                    return  # close paid it)
            try:
                if leaving:
                    self._release()
                elif self._may_commit():
                    self._commit_turn()
                else:
                    self._watch_turn()
                if self._error_attempt:
                    self._log.recovered("fan-in commit")
                self._error_attempt = 0
            except errors.PermanentStoreError as e:
                self._fail_all(e)
            except (errors.StoreError, errors.CorruptError) as e:
                delay = backoff_delay(self.retry, self._error_attempt)
                self._error_attempt += 1
                self.stats.incr("hub_retries")
                self._log.failed("fan-in commit", e, delay)
                with self._cond:
                    self._cond.wait(delay)
            except Exception as e:  # a bug: fail the writers loudly, never hang them
                log.exception("fan-in hub failed")
                self._fail_all(e)

    def _alone(self) -> bool:
        """No hub announced to this one, and it met no other hub's lease, lately."""
        return time.monotonic() - self._met_at > LEASE_MIN_S and self._heir() is None

    def _may_commit(self) -> bool:
        if self._yield:  # a commit just found another holder's lease: hand it our groups
            self._yield = False  # (announce) rather than race it again; if its lease
            return False  # lapses meanwhile, the next turn commits them
        if self._view is None:  # the first turn: try; the commit's own read decides (a
            return True  # live lease elsewhere: nothing written, and we announce next)
        return lease_free(self._view.root.lease, self.holder, self.wall_ms())

    # --- committer ---------------------------------------------------------------------

    def _commit_turn(self) -> None:
        """LIST and read the announcements, then one CAS, the CASes an interval apart: the
        reads start early by what they took lately (at S3's round trips a period of
        interval + turn gave 3.6 commits/s at a budget of 5)."""
        interval = self._interval()
        with self._cond:  # the budget: a new group waits for the next turn, it never
            due = self._last_commit + interval - self._prep_s  # brings one forward (the
            while self._budgets and (left := due - time.monotonic()) > 0:  # last writer
                self._cond.wait(left)  # leaving does)
        started = time.monotonic()
        # a free or lapsed lease: take it with our own groups, announced or not, and LIST
        # once it is ours (hubs racing for it each LISTed and read every announcement)
        taking = bool(self._waiting) and not self._holding()
        lease = None if self._view is None else self._view.root.lease
        if taking and lease is not None and lease.holder != self.holder:
            self._met_at = started  # another's lapsed lease: its announcements may linger
        anns: dict[str, Runs] = {}
        if not taking:
            anns = self._retire(self._view, self._reader.read(self._list()))
            self.stats.incr("lists")
            self._prep_s = 0.8 * self._prep_s + 0.2 * min(time.monotonic() - started, interval)
        at = self._last_commit + gap(interval)  # the CASes an interval apart as sent
        with self._cond:
            while self._budgets and (left := at - time.monotonic()) > 0:
                self._cond.wait(left)
            local = [Pending(g.producer_id, g.entries) for groups in self._waiting.values()
                     for g in groups if taking or not g.announced]
        remote = [Pending(a.producer_id, a.entries, k) for k, runs in anns.items() for a in runs]
        self._note_announcers(anns)
        if not local and not remote:
            self._reader.sweep()  # holding, nothing to commit: what is due (the loop
            # deletes the rest at once when the lease is gone)
            if any(gs for gs in self._waiting.values()):  # announced, gone from the LIST:
                self._view = self.queue.read()  # another holder committed them (we LISTed
                self._rhythm.changed(time.monotonic(), interval)  # forever);
                self._resolve(self._view)
                with self._cond:  # the rest (their announcement expired): ours to commit
                    for g in (g for gs in self._waiting.values() for g in gs):
                        g.announced = False
            elif not self._holding():
                with self._cond:  # nothing to do, and no lease to keep: look again later
                    self._cond.wait(interval)
            self._last_commit = time.monotonic()
            return
        view = self._view
        first = None
        if view is not None and self._holding() and self.queue.knows_root:
            latest = self.queue.latest_snapshot()
            first = cas.Read(latest, latest.etag)
        self._last_commit = time.monotonic()
        res = commit(self.queue, local + remote, holder=self.holder,
                     lease_ms=self._lease_ms(interval, bool(remote) or not self._alone()),
                     interval_ms=int(interval * 1000), max_age_ms=self.max_age_ms, first=first)
        self._turn_s = max(time.monotonic() - started, self._turn_s * 0.9)
        if res.snapshot is None:  # nothing written: all covered already (a restart), held
            read = res.read if first is None else None  # elsewhere (another's live lease),
            self._view = read if read is not None else self.queue.read()  # or stale (a read
            # the decision was made on is fresh; the optimistic first one may not be)
            if res.lease is not None and res.lease.holder != self.holder:
                self._yield = True  # another holder: announce before trying again, and
                self._met_at = time.monotonic()
                self._rhythm.polled(self._last_commit, True, interval)  # look for its next
            self._resolve(self._view)
            self._refresh_stale(res)
            return
        self._view = res.snapshot
        self._rhythm.changed(time.monotonic(), interval)
        self.stats.incr("commits")
        self._resolve(res.snapshot, res)
        self._refresh_stale(res)
        self._retire(res.snapshot, anns)

    def _release(self) -> None:
        """The last writer left while this hub holds the lease: one commit of whatever is
        announced that hands the lease to the hub that announced last (alive a moment
        ago: it commits next, while the others go on announcing -- a free lease had every
        waiting hub LIST and read every announcement in a race for it), or gives it up
        when nobody announced."""
        interval = self._interval()
        with self._cond:  # a release is a root write too: it keeps to the budget
            due = self._last_commit + interval
            while not self._budgets and (left := due - time.monotonic()) > 0:
                self._cond.wait(left)
            if self._budgets:
                return  # a writer came back meanwhile: it keeps the lease
        anns = self._retire(self._view, self._reader.read(self._list()))
        remote = [Pending(a.producer_id, a.entries, k) for k, runs in anns.items() for a in runs]
        self._note_announcers(anns)
        heir = self._heir()
        res = commit(self.queue, remote, holder=self.holder, successor=heir,  # its lease: long
                     lease_ms=int(4 * (interval + self._turn_s) * 1000),  # enough to see it
                     interval_ms=int(interval * 1000), release=True,  # and commit, short if
                     max_age_ms=self.max_age_ms)  # it is gone meanwhile
        self._view = res.snapshot if res.snapshot is not None else self.queue.read()
        self.stats.incr("releases")
        self.stats.incr("handovers", int(heir is not None and res.snapshot is not None))
        self._retire(self._view, anns)
        self._reader.sweep(force=True)  # the next holder never reads them again

    def _note_announcers(self, anns: dict[str, Runs]) -> None:
        """The hubs whose announcements this turn listed, when (our clock) last: the one
        heard from last inherits the lease (:meth:`_heir`)."""
        now = time.monotonic()
        for k in anns:
            parsed = keys.parse_pending_key(k)
            if parsed is not None and parsed[0] != self.holder:
                self._announcers[parsed[0]] = now

    def _heir(self) -> str | None:
        """The hub heard from last, within a long lease's time (after that it may be gone:
        a gone heir delays the others by its lease, four periods)."""
        recent = time.monotonic() - self._lease_ms(self._interval(), True) / 1000
        self._announcers = {h: t for h, t in self._announcers.items() if t > recent}
        return max(self._announcers, key=lambda h: self._announcers[h], default=None)

    def max_age_ms(self, snap: Snapshot) -> int:
        """Half the buffer's GC grace period (the root's; the default before it has one):
        an older data object may be GC's already (I5)."""
        grace = snap.gc_grace_ms
        if grace is None:
            grace = min(
                self._graces.values(), default=DEFAULT_GC_GRACE_PERIOD // timedelta(milliseconds=1)
            )
        return grace // 2

    def _list(self) -> list[ObjectMeta]:
        return list(self.store.list(keys.PENDING_PREFIX))

    def _retire(self, snap: Snapshot | None, anns: dict[str, Runs]) -> dict[str, Runs]:
        """Of ``anns``, those ``snap``'s watermarks cover (or that a gone writer left past
        the grace period) are deleted with the others of the last second; the rest are
        returned.  Before a commit, with the root as last seen: what a holder that died
        (or lost its lease before its delete) left is never committed again, nor its
        announcer taken for a live hub."""
        if snap is None:
            return anns
        return self._reader.retire(anns, snap.view.watermarks, self.wall_ms(),
                                   2 * self.max_age_ms(snap))

    # --- watcher -----------------------------------------------------------------------

    def _watch_turn(self) -> None:
        self._met_at = time.monotonic()  # another hub holds the lease
        self._announce()
        assert self._view is not None
        lease = self._view.root.lease
        interval = (
            lease.interval_ms / 1000
            if lease is not None and lease.interval_ms
            else self._interval()
        )
        with self._cond:  # a commit whose LIST came before every announcement still
            since = min(  # waiting on it landed cannot carry one: the poll skips it
                (g.listed_from for gs in self._waiting.values() for g in gs), default=0.0
            )
            due = self._rhythm.due(interval, since)  # the holder's next commit, or a retry
            # a new group before the poll is due: announce it first (the holder lists it
            # next); once the poll is due it goes first, however busy the writers are
            while (left := due - time.monotonic()) > 0:
                if any(not g.announced for gs in self._waiting.values() for g in gs):
                    return
                self._cond.wait(left)
        seen = time.monotonic()
        snap = self.queue.read_if_changed(self._view.etag)  # a 304 while unchanged (a lease
        self.stats.incr("root_polls")  # that lapsed meanwhile: the next turn takes it over)
        old = (self._view.root.next_seq, self._view.footer.epoch)
        moved = snap is not None and (snap.root.next_seq, snap.footer.epoch) != old
        was, lease = self._view.root.lease, None if snap is None else snap.root.lease
        same = lease is not None and was is not None and lease.holder == was.holder
        stamp = lease.expires_ms if same and lease is not None else None  # one holder's
        self._rhythm.polled(seen, moved, interval, stamp)  # a commit, not any write (a dequeue)
        if snap is None:
            return
        self._view = snap
        if snap.root.lease is not None and snap.root.lease.holder == self.holder:
            self._last_commit = seen  # handed to us: our first turn comes an interval
            # after the hand-over's write, at least
        self._resolve(snap)

    def _announce(self) -> None:
        """One PUT of every local group not announced yet: a run per writer, its groups
        in order (the next turn's announcement lists after this one)."""
        with self._cond:
            todo = [g for gs in self._waiting.values() for g in gs if not g.announced]
        if not todo:
            return
        # nothing announced now can land below the root as this hub last saw it
        floor = 0 if self._view is None else self._view.root.next_seq
        runs: dict[str, list[fa.Announced]] = {}
        for g in todo:
            g.floor = max(g.floor, floor)
            runs.setdefault(g.producer_id, []).extend(g.entries)
        self._announced_n += 1
        started = time.monotonic()
        made = [fa.make(pid, 0, es) for pid, es in runs.items()]
        created = self.wall_ms()
        body = fa.encode(made, created)  # spelled out in its key too where it fits: no GET
        room = keys.pending_room(self.holder, self._announced_n)
        spelled = key_form(made, created, body, room) or ""
        key = keys.pending_key(self.holder, self._announced_n, spelled)
        with contextlib.suppress(errors.AlreadyExistsError):  # our own earlier attempt, its answer
            self.store.put(key, body, mode="create")  # lost: only this hub writes its keys
        landed = time.monotonic()
        with self._cond:
            self._announce_s = ewma(self._announce_s, landed - started)
            for g in todo:
                g.announced = True
                g.listed_from = landed
        self.stats.incr("announcements")
        self.stats.incr("announced_groups", len(todo))

    # --- done ----------------------------------------------------------------------------

    def _resolve(self, snap: Snapshot, res: Committed | None = None) -> None:
        """Every local group its writer's watermark covers in ``snap`` is done."""
        placed = {} if res is None else res.placed
        with self._cond:
            finished: list[_Group] = []
            for pid, groups in list(self._waiting.items()):
                wm = snap.view.watermarks.get(pid)
                while groups and wm is not None and groups[0].last_seq <= wm.producer_seq:
                    finished.append(groups.pop(0))
                if not groups:
                    del self._waiting[pid]
            self._cond.notify_all()
        if not finished:
            return
        found: dict[str, int] = {}
        unplaced = [
            g
            for g in finished
            if any(e.producer_seq not in placed.get(g.producer_id, {}) for e in g.entries)
        ]
        if unplaced:
            found = locate(snap, {e.location for g in unplaced for e in g.entries},
                           {g.producer_id for g in unplaced}, min(g.floor for g in unplaced))
        for g in finished:
            mine = placed.get(g.producer_id, {})
            seqs: list[int | None] = [
                mine.get(e.producer_seq, found.get(e.location)) for e in g.entries
            ]
            self._call(g, seqs, None)

    def _refresh_stale(self, res: Committed) -> None:
        """Local groups whose oldest data object is past half the grace period: upload
        them again and announce the fresh keys (in a new announcement: keys are never
        written twice, so a committed one can be deleted by its key alone)."""
        if not res.stale:
            return
        with self._cond:
            stale = [g for pid in res.stale for g in self._waiting.get(pid, [])]
        for g in stale:
            if g.refresh is None:
                continue
            fresh = tuple(g.refresh(g.entries))
            self.stats.incr("reannounced_for_grace")
            log.warning(
                "%s: appends waited past half the GC grace period; uploaded again", g.producer_id
            )
            with self._cond:  # committed or announced again with the fresh keys (a commit
                g.entries = fresh  # takes the freshest of two entries of one producer seq)
                g.announced = False

    def _fail_all(self, error: BaseException) -> None:
        with self._cond:
            groups = [g for gs in self._waiting.values() for g in gs]
            self._waiting.clear()
            self._cond.notify_all()
        for g in groups:
            self._call(g, None, error)

    def _call(self, g: _Group, seqs: list[int | None] | None, err: BaseException | None) -> None:
        try:
            g.done(seqs, err)
        except Exception:
            log.exception("a fan-in completion callback failed")


_hubs: weakref.WeakKeyDictionary[ManifestQueue, CommitHub] = weakref.WeakKeyDictionary()
_hubs_lock = threading.Lock()


def hub_for(store: Store, queue: ManifestQueue) -> CommitHub:
    """The one hub of ``queue`` (one buffer) in this process."""
    with _hubs_lock:
        hub = _hubs.get(queue)
        if hub is None:
            hub = _hubs[queue] = CommitHub(store, queue)
        return hub
