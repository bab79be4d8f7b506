"""A worker of a shared work queue: several workers, one subscriber, any order.

    w = buf.worker("jobs", lease=timedelta(seconds=30))
    while (b := w.claim()) is not None:
        process(b)              # at-least-once: a lapsed lease is redelivered to another worker
        w.ack(b.sequence)       # or w.defer(seq) (hand it back now), w.reject(seq, reason=b"...")
    w.close()                   # applies what is buffered, hands back what it still holds

Every change is one CAS of the subscriber's progress object (:mod:`tieredbuf.queue.shared`
decides): a refill applies this worker's buffered acks and rejects and leases the next
``claim_batch`` claimable entries (lowest first) under a fresh operation token, which
is also how a retry after an unknown outcome finds its own write.  Acks and rejects are
buffered until the next refill, ``flush()``, ``close()``, or at once when a buffered
ack's lease is about to lapse; ``defer`` is applied at once.

Every entry is acked exactly once; processing is at-least-once.  An ack whose lease
lapsed *and* was claimed again by another worker is refused: the call that applies it
(the next claim(), flush() or close()) raises LeaseExpiredError and that ack changes
nothing -- the other worker's ack counts.  Workers never bump the subscriber's epoch.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from datetime import timedelta

from ulid import ULID

from tieredbuf.config import WorkerConfig
from tieredbuf.consume.consumer import ConsumedBatch, fetch_object
from tieredbuf.errors import (
    AckOrderError,
    ClosedError,
    DataLossError,
    LeaseExpiredError,
    MissingObjectError,
    ObjectNotFoundError,
)
from tieredbuf.format.manifest import ManifestEntry
from tieredbuf.format.progress import MAX_REASON, Lease, Progress
from tieredbuf.queue import cas, shared
from tieredbuf.queue.manifest_queue import ManifestQueue, Snapshot
from tieredbuf.queue.subscription import NamedSubscription
from tieredbuf.runtime.pools import started_pool
from tieredbuf.runtime.stats import Stats
from tieredbuf.store.base import Store

log = logging.getLogger(__name__)


def _ewma(old: float | None, x: float, alpha: float = 0.3) -> float:
    return x if old is None else old + alpha * (x - old)


WINDOW = 1024
"""Entries decoded ahead of the claims (as a consumer reads a window of the backlog)."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Apply:
    """What one refill CAS decided, under its operation token, from the root it judged."""

    applied: shared.Applied
    token: bytes
    root: Snapshot
    wrote: bool = True


@dataclasses.dataclass(slots=True)
class _Held:
    token: bytes
    expires_ms: int
    handed_out: bool = False


class Worker:
    """One worker of the shared subscriber ``subscriber``; use from one thread."""

    def __init__(self, store: Store, queue: ManifestQueue, subscriber: str,
                 config: WorkerConfig | None = None) -> None:
        self.store = store
        self.queue = queue
        self.config = config or WorkerConfig()
        self.worker_id = ULID().bytes
        self.subscription = NamedSubscription(
            queue, subscriber, shared=True, owner=f"w-{ULID.from_bytes(self.worker_id)}",
            publish_interval_ms=self.config.publish_interval // timedelta(milliseconds=1))
        self.subscriber = subscriber
        self.stats = Stats()
        self._limits = shared.Limits(
            lease_ms=self.config.lease // timedelta(milliseconds=1),
            claim_n=self.config.claim_batch, max_span=self.config.max_span,
            max_deliveries=self.config.max_deliveries)
        self._margin_ms = min(self._limits.lease_ms // 4, 5000)
        self._held: dict[int, _Held] = {}
        self._ready: deque[int] = deque()
        self._ops: list[shared.Op] = []
        self._expiries: dict[bytes, int] = {}
        self._entries: dict[int, ManifestEntry] = {}
        self._snap: Snapshot | None = None
        self._window: dict[int, ManifestEntry] = {}
        self._contended = False
        self._refill_s: float | None = None
        self._item_s: float | None = None
        self._handed_at: float | None = None
        """The last CAS met another worker's write: read the progress object before the next."""
        self._snap_at = 0.0
        self._prefetch: dict[int, Future[bytes]] = {}
        self._pool = started_pool(max(1, self.config.read_ahead), "tb-worker")
        self._initialized = False
        self._closed = False
        self.on_applied: Callable[[list[int]], None] | None = None
        """Called after each CAS with the sequences whose acks and rejects it applied."""

    def clock_ms(self) -> int:
        """The wall clock leases are judged by (the subscription's)."""
        return self.subscription.clock_ms()

    # --- lifecycle -------------------------------------------------------------------

    def initialize(self, start: str = "earliest") -> None:
        """Register the shared subscriber if new (at the earliest entry the buffer holds, or
        the tail with ``start="latest"``).  No buffer at the URL: BufferNotFoundError."""
        self._check_open()
        self.subscription.register(start)
        self._initialized = True

    def close(self) -> None:
        """Apply buffered acks/rejects and hand back every entry still held (defer), so
        other workers can take them at once."""
        if self._closed:
            return
        try:
            if self._initialized:
                for seq, h in self._held.items():  # returned by claim(): a delivery
                    action: shared.Action = "defer" if h.handed_out else "release"
                    self._ops.append(shared.Op(action, seq, h.token))
                if self._ops:
                    self._apply(0)
                self.subscription.maybe_publish(force=True)
        finally:
            self._closed = True
            for f in self._prefetch.values():
                f.cancel()
            self._pool.shutdown(wait=True)

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("worker is closed")

    def _ensure(self) -> None:
        self._check_open()
        if not self._initialized:
            self.initialize()

    # --- claiming --------------------------------------------------------------------

    def claim(self) -> ConsumedBatch | None:
        """The next entry leased to this worker, with its data; None when nothing is
        claimable now (everything is done, or leased to live workers)."""
        self._ensure()
        if self._handed_at is not None:  # the caller's processing time of the last one
            self._item_s = _ewma(self._item_s, time.monotonic() - self._handed_at)
            self._handed_at = None
        self._flush_if_lapsing()
        while True:
            now = self.clock_ms()
            while self._ready:
                seq = self._ready.popleft()
                h = self._held.get(seq)
                if h is None:
                    continue
                if h.expires_ms - self._margin_ms <= now:
                    self._release(seq, h)
                    continue
                try:
                    batch = self._batch(seq)
                except MissingObjectError as e:
                    self._unlinked(seq, e)  # retention's loss: released (raised unless skip)
                    continue
                h.handed_out = True
                self.stats.incr("claimed")
                self._handed_at = time.monotonic()
                return batch
            t0 = time.monotonic()
            if not self._apply(self._claim_n()):
                return None
            self._refill_s = _ewma(self._refill_s, time.monotonic() - t0)

    def _release(self, seq: int, h: _Held, why: str = "lapsed_before_use") -> None:
        """Hand back a lease whose entry claim() never returned (one about to lapse before
        its turn, by default) with the next CAS: no delivery is charged."""
        del self._held[seq]
        self._ops.append(shared.Op("release", seq, h.token))
        self.stats.incr(why)

    def _release_lapsing(self) -> None:
        now = self.clock_ms()
        for seq in self._ready:
            h = self._held.get(seq)
            if h is not None and not h.handed_out and h.expires_ms - self._margin_ms <= now:
                self._release(seq, h)

    def _claim_n(self) -> int:
        """How many to lease in the next refill: ``claim_batch``, or more when a refill takes
        long against this worker's processing speed (contention on the progress object):
        about twice the refill time's worth of entries, at most ``max_claim_batch``, and
        never more than it processes in half a lease (so none lapses before its turn)."""
        base = self.config.claim_batch
        if self._refill_s is None or not self._item_s:
            return base
        cap = self.config.max_claim_batch or 8 * base
        want = math.ceil(2 * self._refill_s / self._item_s)
        safe = int(self._limits.lease_ms / 1000 / 2 / self._item_s)
        return max(1, min(max(base, want), cap, max(safe, 1)))

    def _batch(self, seq: int) -> ConsumedBatch:
        entry = self._entries.pop(seq)
        fut = self._prefetch.pop(seq, None)
        data = fut.result() if fut is not None else fetch_object(self.store, entry)
        self._schedule_prefetch()
        return ConsumedBatch(entry.sequence, entry.location, entry.metadata, data)

    def _unlinked(self, seq: int, err: MissingObjectError) -> None:
        """The object of leased ``seq`` is gone.  If a fresh root no longer links it,
        retention unlinked it (and GC reaped it) while this worker held the lease: every
        held entry below the root's first sequence is released (the next CAS resolves them
        as lost, counted with ``on_lost="skip"``) and, unless skipping, DataLossError says
        so.  An object the root still links is missing for another reason: re-raised."""
        snap = self._snap = self.queue.read()
        self._snap_at = time.monotonic()
        if seq >= snap.low:
            raise err
        for s in sorted(x for x, h in self._held.items() if x < snap.low and not h.handed_out):
            self._entries.pop(s, None)
            fut = self._prefetch.pop(s, None)
            if fut is not None:
                fut.cancel()
            self._release(s, self._held[s], "unlinked_while_leased")
        if self.config.on_lost != "skip":
            raise DataLossError(
                f"subscriber {self.subscriber!r}: sequences before {snap.low} were unlinked "
                f"(retention) before they were acked; on_lost='skip' moves on")

    def _schedule_prefetch(self) -> None:
        for seq in itertools.islice(self._ready, self.config.read_ahead):
            e = self._entries.get(seq)
            if e is not None and seq not in self._prefetch:
                self._prefetch[seq] = self._pool.submit(fetch_object, self.store, e)

    def _load_entries(self, snap: Snapshot, seqs: list[int]) -> None:
        """Entries of the claimed sequences.  A window of up to WINDOW entries is decoded
        from the first one missing (claims move forward: the next refills find theirs
        there), one tree walk per contiguous run of missing sequences."""
        position = self.subscription.progress.position if self.subscription.progress else 0
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
                got = list(itertools.islice(snap.iter_from(run[0]), n))
            except ObjectNotFoundError:  # a cached root's group was unlinked and reaped
                snap = self._snap = self.queue.read()
                self._snap_at = time.monotonic()
                got = list(itertools.islice(snap.iter_from(run[0]), n))
            if [e.sequence for e in got[: len(run)]] != run:
                raise DataLossError(
                    f"subscriber {self.subscriber!r}: sequences {run[0]}..{run[-1]} were "
                    f"leased but are no longer linked (retention unlinked them)")
            if len(self._window) > 4 * WINDOW:
                self._window.clear()
            self._window.update((e.sequence, e) for e in got)
        for s in seqs:
            self._entries[s] = self._window[s]

    # --- resolving -------------------------------------------------------------------

    def _take(self, seq: int) -> _Held:
        self._ensure()
        h = self._held.get(seq)
        if h is None or not h.handed_out:
            raise AckOrderError(f"sequence {seq} is not leased to this worker (or was resolved)")
        return h

    def ack(self, sequence: int) -> None:
        """``sequence`` is processed (any order).  Buffered; see the module docstring."""
        h = self._take(sequence)
        del self._held[sequence]
        self._ops.append(shared.Op("ack", sequence, h.token))
        self.stats.incr("acks")
        self._flush_if_lapsing()

    def reject(self, sequence: int, reason: bytes = b"") -> None:
        """``sequence`` failed for good: recorded as rejected (listed by ``tieredbuf
        subscribers``), never redelivered.  Buffered like an ack."""
        if len(reason) > MAX_REASON:
            raise ValueError(f"reject reason of {len(reason)} bytes: at most {MAX_REASON}")
        h = self._take(sequence)
        del self._held[sequence]
        self._ops.append(shared.Op("reject", sequence, h.token, bytes(reason)))
        self.stats.incr("rejects")
        self._flush_if_lapsing()

    def defer(self, sequence: int) -> None:
        """Hand ``sequence`` back now (one CAS, with whatever is buffered): claimable at once
        by any worker, this one included."""
        h = self._take(sequence)
        del self._held[sequence]
        self._ops.append(shared.Op("defer", sequence, h.token))
        self.stats.incr("defers")
        self._apply(0)

    def flush(self) -> None:
        """Apply every buffered ack and reject now and publish the subscriber's position."""
        self._ensure()
        if self._ops:
            self._apply(0)
        self.subscription.maybe_publish(force=True)

    def _flush_if_lapsing(self) -> None:
        if not self._ops:
            return
        now = self.clock_ms()
        soonest = min((self._expiry(op) for op in self._ops), default=None)
        if soonest is not None and soonest - self._margin_ms <= now:
            self._apply(0)

    def _expiry(self, op: shared.Op) -> int:
        return self._expiries.get(op.token, 1 << 62)

    # --- the one CAS -----------------------------------------------------------------

    def _apply(self, claim_n: int) -> bool:
        """One CAS: buffered ops applied, up to ``claim_n`` entries leased.  Returns True if
        it leased anything.  Raises DataLossError / LeaseExpiredError *after* the CAS
        landed (what it leased stays queued for the next claim())."""
        sub = self.subscription
        self._release_lapsing()
        ops = list(self._ops)
        limits = dataclasses.replace(self._limits, claim_n=claim_n)
        roots: list[Snapshot] = []
        retried: list[int] = []
        skip_lost = self.config.on_lost == "skip"

        def decide(p: Progress, attempt: int
                   ) -> tuple[Progress, _Apply] | cas.Skip[_Apply]:
            if attempt:
                retried.append(attempt)
            if attempt or not roots:
                roots.append(self._root(p, claim_n))
            snap = roots[-1]
            token = ULID().bytes  # each attempt its own: a retry knows which one landed
            applied = shared.apply(p, ops, worker_id=self.worker_id, op_token=token,
                                   now_ms=self.clock_ms(), limits=limits,
                                   next_seq=snap.root.next_seq, low=snap.low,
                                   skip_lost=skip_lost)
            if not (ops or applied.claimed or applied.auto_rejected
                    or (applied.lost is not None and skip_lost)):
                applied.progress = p  # nothing to change: an idle poll costs no write
                return cas.Skip(_Apply(applied, token, snap, wrote=False))
            return applied.progress, _Apply(applied, token, snap)

        def landed(p: Progress, tried: Sequence[_Apply]) -> _Apply | None:
            token = shared.landed_op(p, self.worker_id, [t.token for t in tried])
            if token is None:
                return None
            self.queue.stats.incr("worker_ops_found_landed")
            mine = next(t for t in tried if t.token == token)
            return dataclasses.replace(mine, applied=dataclasses.replace(
                mine.applied, progress=p, claimed=shared.mine(p, token)))

        def same(a: _Apply) -> _Apply:
            return a

        def run(blind: bool) -> _Apply:
            return sub.cas(decide, same, landed, blind=blind)

        # after contention a blind CAS (from the cached progress) would only conflict
        got = run(blind=not self._contended)
        if not got.wrote and not self._contended:
            got = run(blind=False)  # the cached progress may be stale: judge from a fresh read
        applied, op_token, snap, wrote = got.applied, got.token, got.root, got.wrote
        self._ops = self._ops[len(ops):]
        self.stats.incr("cas" if wrote else "idle_polls")
        self._contended = bool(retried)
        if self.on_applied is not None and ops:
            refused = set(applied.expired)
            self.on_applied([op.seq for op in ops if op.action in ("ack", "reject")
                             and op.seq not in refused])
        sub.written = applied.progress.position
        sub.observe(snap)
        new = [x for x in applied.claimed if x.token == op_token]
        if new:
            self._load_entries(snap, [x.seq for x in new])
        self._lease(new)
        if applied.auto_rejected:
            self.stats.incr("auto_rejected", len(applied.auto_rejected))
            log.warning("subscriber %r: rejected %s after %s deliveries", self.subscriber,
                        applied.auto_rejected, self.config.max_deliveries)
        sub.maybe_publish()
        if applied.lost is not None and self.config.on_lost == "skip":
            self.stats.incr("lost_sequences", applied.lost[1] - applied.lost[0] + 1)
        if applied.expired:  # first: it is this call's news; a loss is raised again next call
            self.stats.incr("expired_acks", len(applied.expired))
            raise LeaseExpiredError(self.subscriber, applied.expired)
        if applied.lost is not None and self.config.on_lost != "skip":
            first, last = applied.lost
            raise DataLossError(
                f"subscriber {self.subscriber!r}: sequences {first}..{last} were unlinked "
                f"(retention) before they were acked; on_lost='skip' moves on")
        return bool(new)

    def _root(self, p: Progress | None, claim_n: int) -> Snapshot:
        """The root as of at most ``publish_interval`` ago, re-read sooner when new entries
        may be claimable (one 22-byte footer GET tells): a refill of a long backlog does
        not read (and decode) the whole root every time."""
        now = time.monotonic()
        snap = self._snap
        stale = snap is None or now - self._snap_at >= self.subscription.publish_interval_ms / 1000
        if (not stale and snap is not None and p is not None
                and p.claim_cursor + claim_n > snap.root.next_seq):
            stale = self.queue.read_footer().next_sequence != snap.root.next_seq
        if stale or snap is None:
            snap = self.queue.read()
            self._snap, self._snap_at = snap, now
        return snap

    def _lease(self, leases: list[Lease]) -> None:
        for x in leases:
            self._held[x.seq] = _Held(x.token, x.expires_ms)
            self._expiries[x.token] = x.expires_ms
            self._ready.append(x.seq)
        live = {h.token for h in self._held.values()} | {op.token for op in self._ops}
        self._expiries = {t: e for t, e in self._expiries.items() if t in live}
        self._schedule_prefetch()

    @property
    def held(self) -> list[int]:
        """Sequences leased to this worker and not yet resolved."""
        return sorted(self._held)
