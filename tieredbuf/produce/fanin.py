"""Fan-in: one commit per interval carries what every writer has uploaded.

Every writer (a stateless producer, one stream of an exporter) hands its uploaded
appends to the :class:`CommitHub` of its buffer in this process (:func:`hub_for`).
The hub plays one of two parts at a time, decided by the root's commit lease
(section 8; :mod:`tieredbuf.produce.lease`):

* **committer** (the lease is its own, or free, or lapsed;
  :mod:`tieredbuf.produce.commit_turn`): once per interval
  (``1 / manifest_writes_per_s``) it LISTs ``queue/pending/``, reads the announcements
  it has not read yet, and appends them together with every group of its own process
  still waiting (handed over in memory) in one root CAS that renews its lease; the
  announcements the watermarks now cover it deletes together, at most once a second,
  and all of them before it gives the lease up.  While it holds a live lease and nothing
  is pending it only LISTs; once the lease lapses it stops.
* **watcher** (another writer holds a live lease; :mod:`tieredbuf.produce.watch_turn`):
  it announces its process's appends (one create-if-absent PUT a turn, carrying every
  writer's) and reads the root when the holder's next commit is due, by a conditional
  GET that costs a 304 while it is unchanged.

Either way a waiting write is done only when its own entry is found in a root
(:mod:`tieredbuf.produce.settle`, I10): its sequence comes from the committer's own
write or from a look-up of its data object's key, never from a watermark alone.  A
writer's REMOTE latency is its upload, an announcement and about one interval --
whatever the number of writers -- and the root takes one write per interval
(docs/architecture.md, "Fan-in").  Exactly-once is the watermark's (I2), kept from
skipping an append by the chain rule (:mod:`tieredbuf.queue.commit`); a holder that
dies only delays commits until its lease lapses; two holders at once (clock skew) cost
conflicts, not duplicates.  An idle hub makes no request.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta

from tieredbuf import errors
from tieredbuf.config import DEFAULT_GC_GRACE_PERIOD, RetryConfig
from tieredbuf.format import announce as fa
from tieredbuf.produce.announcements import AnnouncementReader
from tieredbuf.produce.commit_turn import Committer
from tieredbuf.produce.hub_state import Done, Group, HubState, Refresh
from tieredbuf.produce.lease import LEASE_MIN_S, Lease
from tieredbuf.produce.refresh import refresh_aging
from tieredbuf.produce.rhythm import gap
from tieredbuf.produce.settle import Settler, call
from tieredbuf.produce.watch_turn import Watcher
from tieredbuf.queue.commit import new_holder_id
from tieredbuf.queue.manifest_queue import ManifestQueue, Snapshot
from tieredbuf.runtime.retry import RetryLog, background, backoff_delay
from tieredbuf.runtime.stats import Stats
from tieredbuf.store.base import Store

log = logging.getLogger(__name__)

__all__ = ["LEASE_MIN_S", "CommitHub", "Done", "Refresh", "hub_for"]


class CommitHub:
    """The fan-in of one buffer in this process; writers :meth:`attach`, :meth:`submit`
    their uploaded appends in producer-sequence order, and :meth:`detach`."""

    def __init__(
        self,
        store: Store,
        queue: ManifestQueue,
        *,
        retry: RetryConfig | None = None,
        wall_ms: Callable[[], int] | None = None,
    ) -> None:
        self.store = store
        self.queue = queue
        self.retry = retry or RetryConfig()
        self.wall_ms = wall_ms or queue.clock_ms
        self.holder = new_holder_id()
        self.stats = Stats()
        self._log = RetryLog(log)
        # the parts read this hub's clock through it (a test may set ``wall_ms``)
        self._state = HubState(store, queue, self.holder, self._wall, self.stats)
        self._lease = Lease(self.holder, self._wall)
        self._settler = Settler(self._state)
        reader = AnnouncementReader(store, self.stats, own=self.holder)
        self._committer = Committer(self._state, self._lease, reader, self._settler)
        self._watcher = Watcher(self._state, self._lease, self._settler)
        self._next_token = 0
        self._error_attempt = 0
        self._thread: threading.Thread | None = None

    def _wall(self) -> int:
        return self.wall_ms()

    # --- writers -----------------------------------------------------------------------

    def attach(
        self, manifest_writes_per_s: float, gc_grace_period: timedelta = DEFAULT_GC_GRACE_PERIOD
    ) -> int:
        """A writer joins; its budget counts (the hub commits at the lowest budget of its
        writers, ``0``: unpaced), and so does its grace period where the root records
        none yet (the shortest).  Returns the token to :meth:`detach` with."""
        st = self._state
        with st.cond:
            self._next_token += 1
            st.budgets[self._next_token] = manifest_writes_per_s
            st.graces[self._next_token] = gc_grace_period // timedelta(milliseconds=1)
            return self._next_token

    def detach(self, token: int, timeout: float = 10.0) -> None:
        """A writer leaves (its groups were all done or failed).  The last one to leave
        waits (up to ``timeout``) for the hub to give its lease up, so writers elsewhere
        take over at once and the process may exit."""
        st = self._state
        with st.cond:
            st.budgets.pop(token, None)
            st.graces.pop(token, None)
            st.cond.notify_all()
            if not st.budgets and self._thread is not None:
                st.cond.wait_for(lambda: self._thread is None or bool(st.budgets), timeout)

    def withdraw(self, producer_id: str) -> None:
        """Stop waiting for a writer's groups (it gave up on them and failed them itself);
        an announcement of them already out may still be committed."""
        st = self._state
        with st.cond:
            st.waiting.pop(producer_id, None)
            st.cond.notify_all()

    def submit(
        self,
        producer_id: str,
        entries: Sequence[fa.Announced],
        done: Done,
        refresh: Refresh | None = None,
    ) -> None:
        """Queue one group of a writer's uploaded appends (after every earlier group of the
        same writer); ``done`` is called once from the hub's thread, with each entry's
        (sequence, location) once its entry is found in a root, or the error."""
        if not entries:
            raise ValueError("an empty group")
        st = self._state
        with st.cond:
            mine = st.waiting.setdefault(producer_id, [])
            if mine and mine[-1].last_seq >= entries[0].producer_seq:
                raise ValueError(f"{producer_id}: groups must come in producer-sequence order")
            floor = 0 if st.view is None else st.view.root.next_seq
            mine.append(Group(producer_id, tuple(entries), done, refresh, floor))
            self.stats.incr("groups_submitted")
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="tb-fanin-hub", daemon=True)
                self._thread.start()
            st.cond.notify_all()

    def next_commit_in(self) -> float:
        """Seconds until a group must be submitted to go in the next commit (0: now).  A
        watcher's must be announced before the holder's LIST, which comes before its
        commit by a time the watcher does not know, and it sees commits late: it aims an
        announcement and a quarter interval (at most 75 ms: its late polls and the
        holder's LIST) early."""
        st = self._state
        with st.cond:
            interval = st.interval()
            now = time.monotonic()
            if self._lease.holding(st.view) or st.view is None:
                return max(0.0, st.last_commit + interval - now)
            # the holder commits on its beat: the one after the last change this hub saw,
            # or -- when it saw none lately (it polls only while its writers wait) -- the
            # next one on that beat, not "now" (a seal and an upload per request, else)
            early = min(interval / 4, 0.075) + st.announce_s
            at = st.rhythm.changed_at + interval - early
            if at < now:
                period = gap(interval)
                at += math.ceil((now - at) / period) * period
            return max(0.0, at - now)

    def cutoff_in(self) -> tuple[float, float] | None:
        """Holding the lease: seconds until its next turn takes its own process's groups
        (0: one submitted now goes at once), and that turn's identity (it changes once
        the turn's commit is sent); None otherwise (a group is announced)."""
        st = self._state
        with st.cond:
            if not self._lease.holding(st.view):
                return None
            left = st.last_commit + gap(st.interval()) - time.monotonic()
            return max(0.0, left), st.last_commit

    def pending(self) -> int:
        """Groups submitted and not done yet."""
        st = self._state
        with st.cond:
            return sum(len(g) for g in st.waiting.values())

    def max_age_ms(self, snap: Snapshot) -> int:
        """Half the buffer's GC grace period (the root's; the default before it has one):
        an older data object may be GC's already (I5)."""
        return self._state.max_age_ms(snap)

    def health(self) -> str | None:
        """What keeps this hub's writers from their commits now, or None: a committer
        whose clock is too far ahead of this process's (docs/architecture.md, "Clocks")."""
        w = self._watcher
        if not w.skewed() or w.skew_ms is None:
            return None
        return (
            f"the commit lease holder {w.skew_holder}'s clock is {w.skew_ms / 1000:.1f} s "
            f"ahead of this process's (at most {w.bound_ms() / 1000:.1f} s is tolerated): "
            "this process's writes may wait for their commit"
        )

    # --- the loop ----------------------------------------------------------------------

    def _loop(self) -> None:
        with background():  # its store retries go on until the writers leave
            self._serve()

    def _serve(self) -> None:
        st = self._state
        while True:
            # no lease (lost, lapsed, never had one): delete what we committed while we
            # held it before going idle (no request when there is nothing to delete)
            if not self._lease.holding(st.view):
                self._committer.reader.sweep(force=True)
            with st.cond:
                while not st.waiting and not self._lease.holding(st.view):
                    if not st.budgets:
                        self._thread = None
                        st.cond.notify_all()
                        return  # no writer left and nothing held: the hub is idle
                    st.cond.wait(1.0)
                leaving = not st.budgets and not st.waiting
                if leaving and self._lease.alone(st.interval()):  # nobody announced or held
                    self._thread = None  # the lease lately: it lapses on its own (a
                    st.cond.notify_all()  # release is a LIST and a root write for nobody:
                    return  # a lone producer's close paid it)
            try:
                refresh_aging(st)
                if leaving:
                    self._committer.release()
                elif self._committer.may_commit():
                    self._committer.turn()
                else:
                    self._watcher.turn()
                if self._error_attempt:
                    self._log.recovered("fan-in commit")
                self._error_attempt = 0
            except (errors.PermanentStoreError, errors.CorruptError) as e:
                # a refusal (credentials, access, bucket) or a damaged root or tree node:
                # no retry changes it; the writers fail loudly (their data stays theirs)
                self._fail_all(e)
            except errors.StoreError as e:
                delay = backoff_delay(self.retry, self._error_attempt)
                self._error_attempt += 1
                self.stats.incr("hub_retries")
                self._log.failed("fan-in commit", e, delay)
                with st.cond:
                    st.cond.wait(delay)
            except Exception as e:  # a bug: fail the writers loudly, never hang them
                log.exception("fan-in hub failed")
                self._fail_all(e)

    def _fail_all(self, error: BaseException) -> None:
        st = self._state
        with st.cond:
            groups = list(st.groups())
            st.waiting.clear()
            st.cond.notify_all()
        for g in groups:
            call(g, None, error)


_hubs: weakref.WeakKeyDictionary[ManifestQueue, CommitHub] = weakref.WeakKeyDictionary()
_hubs_lock = threading.Lock()


def hub_for(store: Store, queue: ManifestQueue) -> CommitHub:
    """The one hub of ``queue`` (one buffer) in this process."""
    with _hubs_lock:
        hub = _hubs.get(queue)
        if hub is None:
            hub = _hubs[queue] = CommitHub(store, queue)
        return hub
