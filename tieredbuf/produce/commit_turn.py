"""The holder's turn of a commit hub (:mod:`tieredbuf.produce.fanin`): once per interval it
LISTs ``queue/pending/``, reads the announcements it has not read yet, and appends them
together with every group of its own process that still waits (announced or not,
handed over in memory) in one root CAS that renews its lease; then a leaving holder's
last commit, which hands the lease to the hub heard from last.

Its own groups all go in from memory, announced or not: a hub that took the lease
(lapsed, or handed to it) while one of its own announcements was damaged, deleted or
not listed yet would otherwise commit the later groups without it.  The commit's chain
rule (:mod:`tieredbuf.queue.commit`) keeps any writer's appends from going in past one
that is not in; what it holds back as stale (older than half the GC grace period) this
hub uploads again where the writer is its own, and names in a warning where it is
another hub's (that hub's writer uploads it again itself:
:mod:`tieredbuf.produce.watch_turn`).
"""

from __future__ import annotations

import logging
import time

from tieredbuf import keys
from tieredbuf.produce.announcements import AnnouncementReader, Runs
from tieredbuf.produce.hub_state import HubState
from tieredbuf.produce.lease import Lease
from tieredbuf.produce.refresh import refresh
from tieredbuf.produce.rhythm import gap
from tieredbuf.produce.settle import Settler
from tieredbuf.queue import cas
from tieredbuf.queue.commit import STALE, Committed, Pending, age_ms, commit
from tieredbuf.queue.manifest_queue import Snapshot
from tieredbuf.store.base import ObjectMeta

log = logging.getLogger(__name__)


class Committer:
    """The commit turns of one hub."""

    def __init__(
        self, state: HubState, lease: Lease, reader: AnnouncementReader, settler: Settler
    ) -> None:
        self.state = state
        self.lease = lease
        self.reader = reader
        self.settler = settler
        self.prep_s = 0.0
        """A turn's LIST and reads (EWMA, at most an interval)."""
        self.yielded = False
        """A commit met another hub's lease: announce before trying again."""

    def may_commit(self) -> bool:
        if self.yielded:  # a commit just found another holder's lease: hand it our groups
            self.yielded = False  # (announce) rather than race it again; if its lease
            return False  # lapses meanwhile, the next turn commits them
        view = self.state.view
        if view is None:  # the first turn: try; the commit's own read decides (a live
            return True  # lease elsewhere: nothing written, and we announce next)
        return self.lease.free(view)

    def turn(self) -> None:
        """LIST and read the announcements, then one CAS, the CASes an interval apart: the
        reads start early by what they took lately (at S3's round trips a period of
        interval + turn gave 3.6 commits/s at a budget of 5)."""
        st = self.state
        interval = st.interval()
        with st.cond:  # the budget: a new group waits for the next turn, it never brings
            due = st.last_commit + interval - self.prep_s  # one forward (the last writer
            while st.budgets and (left := due - time.monotonic()) > 0:  # leaving does)
                st.cond.wait(left)
        started = time.monotonic()
        # a free or lapsed lease: take it with our own groups and LIST once it is ours
        # (hubs racing for it each LISTed and read every announcement)
        taking = bool(st.waiting) and not self.lease.holding(st.view)
        lease = None if st.view is None else st.view.root.lease
        if taking and lease is not None and lease.holder != st.holder:
            self.lease.met(started)  # another's lapsed lease: its announcements may linger
        anns: dict[str, Runs] = {}
        if not taking:
            anns = self.retire(st.view, self.reader.read(self.listed()))
            st.stats.incr("lists")
            self.prep_s = 0.8 * self.prep_s + 0.2 * min(time.monotonic() - started, interval)
        at = st.last_commit + gap(interval)  # the CASes an interval apart as sent
        with st.cond:
            while st.budgets and (left := at - time.monotonic()) > 0:
                st.cond.wait(left)
            local = st.pending(lambda g: True)
        remote = [
            Pending(a.producer_id, a.entries, k, a.after) for k, runs in anns.items() for a in runs
        ]
        self.lease.heard(anns)
        if not local and not remote:
            self.reader.sweep()  # holding, nothing to commit: what is due (the loop
            # deletes the rest at once when the lease is gone)
            if not self.lease.holding(st.view):
                with st.cond:  # nothing to do, and no lease to keep: look again later
                    st.cond.wait(interval)
            st.last_commit = time.monotonic()
            return
        view = st.view
        first = None
        if view is not None and self.lease.holding(view) and st.queue.knows_root:
            latest = st.queue.latest_snapshot()
            first = cas.Read(latest, latest.etag)
        st.last_commit = time.monotonic()
        others = bool(remote) or not self.lease.alone(interval)
        res = commit(
            st.queue,
            local + remote,
            holder=st.holder,
            lease_ms=self.lease.length_ms(interval, others),
            interval_ms=int(interval * 1000),
            max_age_ms=st.max_age_ms,
            first=first,
        )
        self.lease.turn_took(time.monotonic() - started)
        self.held_back(res, anns)
        if res.snapshot is None:  # nothing written: all covered already (a restart), held
            read = res.read if first is None else None  # elsewhere (another's live lease),
            st.view = read if read is not None else st.queue.read()  # or stale (a read the
            # decision was made on is fresh; the optimistic first one may not be)
            if res.lease is not None and res.lease.holder != st.holder:
                self.yielded = True  # another holder: announce before trying again, and
                self.lease.met()  # look for its next commit
                st.rhythm.polled(st.last_commit, True, interval)
            self.settler.look(st.view)
            self.refresh_stale(res)
            return
        st.view = res.snapshot
        st.rhythm.changed(time.monotonic(), interval)
        st.stats.incr("commits")
        self.settler.look(res.snapshot, res.placed)
        self.refresh_stale(res)
        self.retire(res.snapshot, anns)

    def release(self) -> None:
        """The last writer left while this hub holds the lease: one commit of whatever is
        announced that hands the lease to the hub that announced last (alive a moment
        ago: it commits next, while the others go on announcing -- a free lease had every
        waiting hub LIST and read every announcement in a race for it), or gives it up
        when nobody announced."""
        st = self.state
        interval = st.interval()
        with st.cond:  # a release is a root write too: it keeps to the budget
            due = st.last_commit + interval
            while not st.budgets and (left := due - time.monotonic()) > 0:
                st.cond.wait(left)
            if st.budgets:
                return  # a writer came back meanwhile: it keeps the lease
        anns = self.retire(st.view, self.reader.read(self.listed()))
        remote = [
            Pending(a.producer_id, a.entries, k, a.after) for k, runs in anns.items() for a in runs
        ]
        self.lease.heard(anns)
        heir = self.lease.heir(interval)
        res = commit(
            st.queue,
            remote,
            holder=st.holder,
            successor=heir,
            lease_ms=self.lease.handover_ms(interval),
            interval_ms=int(interval * 1000),
            release=True,
            max_age_ms=st.max_age_ms,
        )
        self.held_back(res, anns)
        st.view = res.snapshot if res.snapshot is not None else st.queue.read()
        st.stats.incr("releases")
        st.stats.incr("handovers", int(heir is not None and res.snapshot is not None))
        self.retire(st.view, anns)
        self.reader.sweep(force=True)  # the next holder never reads them again

    def listed(self) -> list[ObjectMeta]:
        return list(self.state.store.list(keys.PENDING_PREFIX))

    def retire(self, snap: Snapshot | None, anns: dict[str, Runs]) -> dict[str, Runs]:
        """Of ``anns``, those ``snap``'s watermarks cover, or that can never be committed
        (a data object older than the whole grace period: GC may have deleted it), are
        deleted with the others of the last second; the rest are returned.  Before a
        commit, with the root as last seen: what a holder that died (or lost its lease
        before its delete) left is never committed again, nor its announcer taken for a
        live hub."""
        if snap is None:
            return anns
        st = self.state
        return self.reader.retire(anns, snap.view.watermarks, st.wall_ms(), 2 * st.max_age_ms(snap))

    def held_back(self, res: Committed, anns: dict[str, Runs]) -> None:
        """Count what the commit held back, and say where another hub's writer is held
        back as stale: how old its data object is by this hub's clock, and how old it was
        by the announcer's own when it announced it -- far apart, the two clocks disagree
        (docs/architecture.md, "Clocks"); that writer uploads it again itself."""
        st = self.state
        for pid, h in res.held.items():
            st.stats.incr(f"held_back_{h.reason}")
            if h.reason != STALE:
                continue
            for k, runs in anns.items():
                for run in runs:
                    e = next(
                        (
                            e
                            for e in run.entries
                            if e.producer_seq == h.producer_seq and run.producer_id == pid
                        ),
                        None,
                    )
                    if e is not None:
                        parsed = keys.parse_pending_key(k)
                        log.warning(
                            "held back %s's appends from %d: their data object is %.1f s old "
                            "by this hub's clock; hub %s announced it %.1f s after its upload "
                            "by its own",
                            pid,
                            h.producer_seq,
                            h.age_ms / 1000,
                            parsed[0] if parsed is not None else k,
                            age_ms(e.location, run.created_ms) / 1000,
                        )

    def refresh_stale(self, res: Committed) -> None:
        """Our own groups whose data waited past half the grace period: upload them again
        (a commit takes the freshest of two uploads of one append)."""
        st = self.state
        if not res.stale:
            return
        with st.cond:
            stale = [g for pid in res.stale for g in st.waiting.get(pid, [])]
        for g in stale:
            refresh(st, g, "its commit held it back")
