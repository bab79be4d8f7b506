"""The watcher's turn of a commit hub (:mod:`tieredbuf.produce.fanin`): another hub holds
a live lease, so this one announces its process's appends (one create-if-absent PUT a
turn, a run per writer) and reads the root when the holder's next commit is due
(:mod:`tieredbuf.produce.rhythm`), by a conditional GET that costs a 304 while it is
unchanged; each root it reads settles what it shows (:mod:`tieredbuf.produce.settle`).

A watcher also keeps its writers from waiting in silence:

* a group the holder has committed around three times without (its announcement damaged,
  deleted, or behind another one's gap) is announced again, then after twice as many
  commits each time (:meth:`~tieredbuf.produce.hub_state.Group.missed_commit`);
* each commit read tells how far the holder's clock is from this one's: the root names
  the commit's time by the holder's clock (its watermarks' ``updated_ms``), and the
  commit came between this hub's last two polls.  A holder ahead by more than
  :data:`SKEW_BOUND` of half the grace period sees this hub's fresh uploads as too old to
  append, however often they are uploaded again: that is reported (a WARNING naming the
  holder, the ``clock_skew_ms`` gauge, :meth:`CommitHub.health`), never a silent stall
  (docs/architecture.md, "Clocks").
"""

from __future__ import annotations

import contextlib
import logging
import time

from tieredbuf import errors, keys
from tieredbuf.format import announce as fa
from tieredbuf.format.spelled import key_form
from tieredbuf.produce.hub_state import HubState
from tieredbuf.produce.lease import Lease
from tieredbuf.produce.settle import Settler
from tieredbuf.queue.manifest_queue import Snapshot
from tieredbuf.runtime.stats import ewma

log = logging.getLogger(__name__)

SKEW_BOUND = 0.8
"""Clocks further apart than this part of half the grace period are reported: past it a
committer ahead of a writer may take the writer's fresh uploads for stale ones."""
SKEW_REPORT_EVERY_S = 60.0
"""A skew past the bound is logged at most this often while it lasts."""


class Watcher:
    """The watch turns of one hub."""

    def __init__(self, state: HubState, lease: Lease, settler: Settler) -> None:
        self.state = state
        self.lease = lease
        self.settler = settler
        self.announced_n = 0
        """This hub's announcements so far (it numbers their keys)."""
        self.skew_ms: int | None = None
        """The holder's clock less ours as the last commit seen bounds it (None: not
        measured yet; 0: inside the bounds)."""
        self.skew_holder = ""
        self.skew_at = 0.0
        """When (monotonic) :attr:`skew_ms` was measured."""
        self._reported = -SKEW_REPORT_EVERY_S
        self._stamp: int | None = None
        self._polled_wall = 0

    def turn(self) -> None:
        st = self.state
        self.lease.met()  # another hub holds the lease
        self.announce()
        assert st.view is not None
        lease = st.view.root.lease
        interval = (
            lease.interval_ms / 1000 if lease is not None and lease.interval_ms else st.interval()
        )
        with st.cond:  # a commit whose LIST came before every announcement still waiting
            since = min((g.listed_from for g in st.groups()), default=0.0)  # on it landed
            due = st.rhythm.due(interval, since)  # cannot carry one: the poll skips it
            # a new group before the poll is due: announce it first (the holder lists it
            # next); once the poll is due it goes first, however busy the writers are
            while (left := due - time.monotonic()) > 0:
                if any(not g.announced for g in st.groups()):
                    return
                st.cond.wait(left)
        seen = time.monotonic()
        seen_wall = st.wall_ms()
        snap = st.queue.read_if_changed(st.view.etag)  # a 304 while unchanged (a lease that
        st.stats.incr("root_polls")  # lapsed meanwhile: the next turn takes it over)
        old = (st.view.root.next_seq, st.view.footer.epoch)
        moved = snap is not None and (snap.root.next_seq, snap.footer.epoch) != old
        was, lease = st.view.root.lease, None if snap is None else snap.root.lease
        same = lease is not None and was is not None and lease.holder == was.holder
        stamp = lease.expires_ms if same and lease is not None else None  # one holder's
        prev_seen = st.rhythm.seen_at
        st.rhythm.polled(seen, moved, interval, stamp)  # a commit, not any write (a dequeue)
        if snap is None:
            self._polled_wall = seen_wall
            return
        st.view = snap
        if snap.root.lease is not None and snap.root.lease.holder == st.holder:
            st.last_commit = seen  # handed to us: our first turn comes an interval after
            # the hand-over's write, at least
        committed = self.measure_skew(snap, seen_wall)
        self._polled_wall = seen_wall
        self.settler.look(snap)
        if committed:
            self.missed(prev_seen)

    def announce(self) -> None:
        """One PUT of every local group not announced yet: a run per writer, its groups
        in order, following the writer's group before them while that one waits (the
        next turn's announcement lists after this one)."""
        st = self.state
        created = st.wall_ms()
        with st.cond:
            runs, carried = st.to_announce(created)
        if not runs:
            return
        # nothing announced now can land below the root as this hub last saw it
        floor = 0 if st.view is None else st.view.root.next_seq
        for g in carried:
            g.floor = max(g.floor, floor)
        self.announced_n += 1
        started = time.monotonic()
        made = [fa.make(a.producer_id, 0, a.entries, a.after) for a in runs]
        body = fa.encode(made, created)  # spelled out in its key too where it fits: no GET
        room = keys.pending_room(st.holder, self.announced_n)
        spelled = key_form(made, created, body, room) or ""
        key = keys.pending_key(st.holder, self.announced_n, spelled)
        with contextlib.suppress(errors.AlreadyExistsError):  # our own earlier attempt, its
            st.store.put(key, body, mode="create")  # answer lost: only this hub writes it
        landed = time.monotonic()
        with st.cond:
            st.announce_s = ewma(st.announce_s, landed - started)
            for g in carried:
                g.announced = True
                g.listed_from = landed
        st.stats.incr("announcements")
        st.stats.incr("announced_groups", len(carried))

    def missed(self, prev_seen: float) -> None:
        """The holder committed: a group whose announcement could have been listed for
        that commit (it landed before the commit seen before this one) and that is still
        waiting counts a miss, and is announced again after a few."""
        st = self.state
        with st.cond:
            again = [
                g
                for g in st.groups()
                if g.announced and g.listed_from < prev_seen and g.missed_commit()
            ]
        if again:
            st.stats.incr("reannounced", len(again))
            log.warning(
                "%d group(s) announced to hub %s are still not committed after several of its "
                "commits (a damaged or deleted announcement, or one held back): announcing "
                "them again",
                len(again),
                st.view.root.lease.holder if st.view and st.view.root.lease else "?",
            )

    def measure_skew(self, snap: Snapshot, seen_wall: int) -> bool:
        """Bound the holder's clock against ours from a commit this poll found (True when
        it found one): the commit's time by the holder's clock (its watermarks' newest
        ``updated_ms``) falls between our last poll and this one."""
        stamp = max((w.updated_ms for w in snap.view.watermarks.values()), default=None)
        if stamp is None or stamp == self._stamp:
            return False
        first, self._stamp = self._stamp is None, stamp
        if first or not self._polled_wall:
            return True  # no poll before it to bound it with
        low, high = stamp - seen_wall, stamp - self._polled_wall
        skew = low if low > 0 else high if high < 0 else 0
        st = self.state
        self.skew_ms, self.skew_at = skew, time.monotonic()
        lease = snap.root.lease
        self.skew_holder = lease.holder if lease is not None else "?"
        st.stats.set("clock_skew_ms", skew)
        if self.skewed() and time.monotonic() - self._reported > SKEW_REPORT_EVERY_S:
            self._reported = time.monotonic()
            st.stats.incr("clock_skew_reports")
            log.warning(
                "hub %s, which commits for this buffer, has a clock %.1f s %s this process's: "
                "past %.1f s apart it takes this process's fresh uploads for ones older than "
                "half the GC grace period, and they wait (fix the clocks: NTP)",
                self.skew_holder,
                abs(skew) / 1000,
                "ahead of" if skew > 0 else "behind",
                self.bound_ms() / 1000,
            )
        return True

    def bound_ms(self) -> int:
        view = self.state.view
        return 0 if view is None else int(self.state.max_age_ms(view) * SKEW_BOUND)

    def skewed(self) -> bool:
        """The last measure put the holder's clock past :data:`SKEW_BOUND` from ours (only
        ahead matters: a holder behind takes our uploads for younger than they are)."""
        return (
            self.skew_ms is not None
            and self.skew_ms > self.bound_ms()
            and time.monotonic() - self.skew_at < 2 * SKEW_REPORT_EVERY_S
        )
