"""A worker's refill: the one progress CAS that applies its buffered resolutions and
leases its next batch, then what it needs to hand that batch out.

:class:`Refiller` runs one refill at a time, on whatever thread the worker gives it (a
background thread when the worker refills ahead, so the CAS -- 60-100 ms at S3's round
trips, more under contention -- is not on ``claim()``'s path).  It owns what a refill
reads besides the progress object: a cached root (re-read at least every
``check_interval``, or sooner when a 22-byte footer GET shows entries this claim could
take) and a decoded window of entries.  It touches the subscription (the CAS, its
written position, the lazy publication) only while the worker waits for no other
refill, so the worker never has two in flight.

A failure after the CAS landed (publishing the position into the root, loading the
leased entries) is returned with the result, not raised: the worker first takes in
what the CAS did (its applied resolutions must not be applied twice), then raises it.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import time
from collections.abc import Callable, Sequence

from ulid import ULID

from tieredbuf.errors import DataLossError, ObjectNotFoundError, TieredBufError
from tieredbuf.format import progress as fp
from tieredbuf.format.manifest import ManifestEntry
from tieredbuf.format.progress import Lease, Progress
from tieredbuf.queue import cas, shared
from tieredbuf.queue.manifest_queue import ManifestQueue, Snapshot
from tieredbuf.queue.subscription import NamedSubscription

WINDOW = 1024
"""Entries decoded ahead of the claims (as a consumer reads a window of the backlog)."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Apply:
    """What one CAS attempt decided, under its operation token, from the root it judged."""

    applied: shared.Applied
    token: bytes
    root: Snapshot
    wrote: bool = True


@dataclasses.dataclass(slots=True)
class Refilled:
    """What one refill did."""

    applied: shared.Applied
    wrote: bool
    """False: nothing to change (an idle poll), no write."""
    new: list[Lease]
    """The leases this refill took (with their entries in ``entries``)."""
    asked: int
    """How many it asked for (fewer taken: nothing more was claimable, or ``max_span``)."""
    entries: dict[int, tuple[ManifestEntry, int]]
    """The leased entries and their data objects' sizes."""
    seconds: float
    error: TieredBufError | None = None
    """A failure after the CAS landed: the worker raises it once it took the rest in."""
    unloaded: list[Lease] = dataclasses.field(default_factory=list)
    """Leased, but their entries could not be loaded: never handed out (released)."""


class Refiller:
    """One worker's refills (see the module docstring); one at a time."""

    def __init__(
        self,
        queue: ManifestQueue,
        sub: NamedSubscription,
        worker_id: bytes,
        limits: shared.Limits,
        *,
        check_interval_s: float,
        skip_lost: bool,
        clock_ms: Callable[[], int],
        on_landed: Callable[[Sequence[shared.Op], shared.Applied], None] | None = None,
    ) -> None:
        self.queue = queue
        self.sub = sub
        self.worker_id = worker_id
        self.limits = limits
        self.check_interval_s = check_interval_s
        self.skip_lost = skip_lost
        self.clock_ms = clock_ms
        self.on_landed = on_landed
        """Called right after each CAS landed, on the refill's thread, with the ops it
        applied and what it decided."""
        self._snap: Snapshot | None = None
        self._snap_at = 0.0
        self._window: dict[int, tuple[ManifestEntry, int]] = {}
        self.contended = False
        """The last CAS met another worker's write: read the progress object before the next."""
        self.retries = dataclasses.replace(queue.cas_retries(), conflict_delay=self._slot)
        self._attempt_s: float | None = None
        """How long one attempt (a read and a write of the progress object) takes."""
        self._decided: float | None = None
        self._patience_s = 0.0
        self._rng = random.Random(worker_id)

    def more_known(self, now_ms: int) -> bool:
        """Whether the last root and progress object this worker saw show entries it could
        still claim (beyond the claim cursor, or handed back or lapsed): no request."""
        p, snap = self.sub.progress, self._snap
        if p is None or snap is None:
            return True
        return p.claim_cursor < snap.root.next_seq or any(
            not shared.live(x, now_ms) for x in p.leases
        )

    def _slot(self, attempt: int) -> float:
        """The pause after a lost race: a random point within as many attempt times as
        there are workers at work (doubling for each further loss, up to the retry
        config's cap), so that the losers take turns instead of writing again together."""
        self._timed()
        t = self._attempt_s if self._attempt_s is not None else 0.05
        peers = max(2, self.workers(self.clock_ms()))  # a lost race: two writers at least
        cap = self.queue.retry.max_backoff.total_seconds()
        window = max(peers * t * 2 ** min(attempt, 8), self._patience_s / 2)
        return self._rng.uniform(0, min(cap, window))

    def _timed(self) -> None:
        """An attempt's write just ended: about half an attempt (a read, then a write)."""
        if self._decided is not None:
            x = 2 * (time.monotonic() - self._decided)
            a = self._attempt_s
            self._attempt_s = x if a is None else a + 0.3 * (x - a)
            self._decided = None

    def workers(self, now_ms: int) -> int:
        """Workers of this subscriber seen at work within a lease (by the last progress
        object this worker saw; at least this one)."""
        p = self.sub.progress
        if p is None:
            return 1
        recent = sum(1 for w in p.workers if now_ms - w.seen_ms < self.limits.lease_ms)
        return max(1, recent)

    def known_tail(self) -> int:
        """The root's ``next_sequence`` as this worker last read it (0: never read)."""
        return 0 if self._snap is None else self._snap.root.next_seq

    def read_root(self) -> Snapshot:
        """A fresh root (also the next refill's)."""
        snap = self._snap = self.queue.read()
        self._snap_at = time.monotonic()
        return snap

    def run(self, ops: Sequence[shared.Op], claim_n: int, patience_s: float = 0.0) -> Refilled:
        """One CAS: ``ops`` applied, up to ``claim_n`` entries leased.  ``patience_s``: how
        long the worker can still hand out what it holds (a refill running ahead): after a
        lost race it may wait up to half of that, spreading the workers' writes."""
        self._patience_s = patience_s
        t0 = time.monotonic()
        sub = self.sub
        limits = dataclasses.replace(self.limits, claim_n=claim_n)
        roots: list[Snapshot] = []
        retried: list[int] = []

        def decide(p: Progress, attempt: int) -> tuple[Progress, _Apply] | cas.Skip[_Apply]:
            self._decided = time.monotonic()
            if attempt:
                retried.append(attempt)
            if attempt or not roots:
                roots.append(self._root(p, claim_n))
            snap = roots[-1]
            if any(op.seq >= p.claim_cursor for op in ops):
                raise cas.Replan("worker_stale_progress")  # a copy older than our leases
            token = ULID().bytes  # each attempt its own: a retry knows which one landed
            applied = shared.apply(
                p,
                ops,
                worker_id=self.worker_id,
                op_token=token,
                now_ms=self.clock_ms(),
                limits=limits,
                next_seq=snap.root.next_seq,
                low=snap.low,
                skip_lost=self.skip_lost,
            )
            if not (
                ops
                or applied.claimed
                or applied.auto_rejected
                or (applied.lost is not None and self.skip_lost)
            ):
                applied.progress = p  # nothing to change: an idle poll costs no write
                return cas.Skip(_Apply(applied, token, snap, wrote=False))
            return applied.progress, _Apply(applied, token, snap)

        def landed(p: Progress, tried: Sequence[_Apply]) -> _Apply | None:
            token = shared.landed_op(p, self.worker_id, [t.token for t in tried])
            if token is None:
                return None
            self.queue.stats.incr("worker_ops_found_landed")
            mine = next(t for t in tried if t.token == token)
            return dataclasses.replace(
                mine,
                applied=dataclasses.replace(
                    mine.applied, progress=p, claimed=shared.mine(p, token)
                ),
            )

        def same(a: _Apply) -> _Apply:
            return a

        # after contention a blind CAS (from the cached progress) would only conflict
        got = sub.cas(decide, same, landed, blind=not self.contended, retries=self.retries)
        if not got.wrote and not self.contended:
            # the cached progress may be stale: judge from a fresh read
            got = sub.cas(decide, same, landed, blind=False, retries=self.retries)
        if got.wrote:
            self._timed()
        self._decided = None
        if got.wrote and self.on_landed is not None:
            self.on_landed(ops, got.applied)
        self.contended = bool(retried)
        new = [x for x in got.applied.claimed if x.token == got.token]
        out = Refilled(got.applied, got.wrote, new, claim_n, {}, 0.0)
        try:
            if new:
                out.entries = self._load_entries(got.root, [x.seq for x in new])
            sub.written = fp.needed(got.applied.progress)  # kept dead letters hold it
            sub.observe(got.root)
            if self.publisher(self.clock_ms()):
                sub.maybe_publish()
        except TieredBufError as e:
            out.error = e
            if not out.entries:
                out.new, out.unloaded = [], new  # never handed out: released, uncharged
        out.seconds = time.monotonic() - t0
        return out

    def _root(self, p: Progress | None, claim_n: int) -> Snapshot:
        """The root this refill judges by.  Re-read only when the claim reaches past the
        tail it knows: in full when that view is older than ``check_interval``, else when
        a 22-byte footer GET shows new entries.  A refill inside the known backlog reads
        no root at all: what retention unlinked meanwhile shows up when the entries load
        (a reaped group: re-read) or their data GET fails (:meth:`Worker._unlinked`)."""
        snap = self._snap
        if snap is None:
            return self.read_root()
        if p is None or p.claim_cursor + claim_n <= snap.root.next_seq:
            return snap
        if time.monotonic() - self._snap_at >= self.check_interval_s:
            return self.read_root()
        if self.queue.read_footer().next_sequence != snap.root.next_seq:
            return self.read_root()
        return snap

    def adopt(self, snap: Snapshot) -> None:
        """A root just read elsewhere (the registration's): the first refill's."""
        if self._snap is None:
            self._snap, self._snap_at = snap, time.monotonic()

    def publisher(self, now_ms: int) -> bool:
        """Whether this worker publishes the queue's position lazily: the one with the
        lowest id among the workers seen within a lease (every worker judges alike from
        the progress object; one that stops is replaced a lease later), so eight workers
        do not each publish every ``publish_interval``."""
        p = self.sub.progress
        if p is None:
            return True
        recent = [w.worker_id for w in p.workers if now_ms - w.seen_ms < self.limits.lease_ms]
        return not recent or min(recent) == self.worker_id

    def _load_entries(
        self, snap: Snapshot, seqs: list[int]
    ) -> dict[int, tuple[ManifestEntry, int]]:
        """Entries of the claimed sequences.  A window of up to WINDOW entries is decoded
        from the first one missing (claims move forward: the next refills find theirs
        there), one tree walk per contiguous run of missing sequences."""
        position = self.sub.progress.position if self.sub.progress else 0
        for s in [s for s in self._window if s < position]:
            del self._window[s]
        runs: list[list[int]] = []
        for s in sorted(x for x in seqs if x not in self._window):
            if runs and runs[-1][-1] + 1 == s:
                runs[-1].append(s)
            else:
                runs.append([s])
        for run in runs:
            n = max(len(run), WINDOW)
            try:
                got = list(itertools.islice(snap.iter_sized_from(run[0]), n))
            except ObjectNotFoundError:  # a cached root's group was unlinked and reaped
                snap = self.read_root()
                got = list(itertools.islice(snap.iter_sized_from(run[0]), n))
            if [e.sequence for e, _ in got[: len(run)]] != run:
                raise DataLossError(
                    f"subscriber {self.sub.name!r}: sequences {run[0]}..{run[-1]} were "
                    f"leased but are no longer linked (retention unlinked them)"
                )
            if len(self._window) > 4 * WINDOW:
                self._window.clear()
            self._window.update((e.sequence, (e, size)) for e, size in got)
        return {s: self._window[s] for s in seqs}
