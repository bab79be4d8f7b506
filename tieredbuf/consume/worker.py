"""A worker of a shared work queue: several workers, one subscriber, any order.

    w = buf.worker("jobs", lease=timedelta(seconds=30))
    while (b := w.claim()) is not None:
        process(b)              # at-least-once: a lapsed lease is redelivered to another worker
        w.ack(b.sequence)       # or w.defer(seq) (hand it back now), w.reject(seq, reason=b"...")
    w.close()                   # applies what is buffered, hands back what it still holds

Every change is one CAS of the subscriber's progress object (:mod:`tieredbuf.queue.shared`
decides; :mod:`tieredbuf.consume.refill` runs it): a refill applies this worker's
buffered acks and rejects and leases the next claimable entries (lowest first) under a
fresh operation token, which is also how a retry after an unknown outcome finds its own
write.  Acks and rejects are buffered until the next refill, ``flush()``, ``close()``,
or at once when a buffered ack's lease is about to lapse; ``defer`` is applied at once.

**Refilling ahead.**  At S3's round trips a refill takes 60-100 ms, more when several
workers contend for the progress object.  So a worker starts its next refill in the
background when its leased entries are about to run out (when no more are left than it
hands out during one refill), and ``claim()`` waits for a CAS only when it has none
left at all.  A refill leases ``claim_batch`` entries, or more when its refills are slow
against the caller's processing speed: about twice a refill's worth, at most
``max_claim_batch``, and never more than the worker processes in half a lease, counting
what it already holds.  Leases are still honoured: an entry whose lease would lapse
(within a quarter of the lease, at most 5 s) before claim() returns it is handed back
uncharged, never handed out.  ``refill_ahead=False`` refills only when claim() finds
nothing left (``tieredbuf work``: a lease covers one command).

Every entry is acked exactly once; processing is at-least-once.  An ack whose lease
lapsed *and* was claimed again by another worker is refused: the call that applies it
(the next claim(), flush() or close()) raises LeaseExpiredError and that ack changes
nothing -- the other worker's ack counts.  Workers never bump the subscriber's epoch.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from datetime import timedelta

from ulid import ULID

from tieredbuf.config import WorkerConfig
from tieredbuf.consume.consumer import ConsumedBatch
from tieredbuf.consume.fetch import ReadAhead
from tieredbuf.consume.refill import Refilled, Refiller
from tieredbuf.errors import (
    AckOrderError,
    ClosedError,
    DataLossError,
    LeaseExpiredError,
    MissingObjectError,
)
from tieredbuf.format.manifest import ManifestEntry
from tieredbuf.format.progress import MAX_REASON, Lease
from tieredbuf.queue import shared
from tieredbuf.queue.manifest_queue import ManifestQueue
from tieredbuf.queue.subscription import NamedSubscription
from tieredbuf.runtime.pools import started_pool
from tieredbuf.runtime.stats import Stats
from tieredbuf.store.base import Store

log = logging.getLogger(__name__)


def _ewma(old: float | None, x: float, alpha: float = 0.3) -> float:
    return x if old is None else old + alpha * (x - old)


@dataclasses.dataclass(slots=True)
class _Held:
    token: bytes
    expires_ms: int
    handed_out: bool = False


class Worker:
    """One worker of the shared subscriber ``subscriber``; use from one thread."""

    def __init__(
        self,
        store: Store,
        queue: ManifestQueue,
        subscriber: str,
        config: WorkerConfig | None = None,
    ) -> None:
        self.store = store
        self.queue = queue
        self.config = config or WorkerConfig()
        self.worker_id = ULID().bytes
        self.subscription = NamedSubscription(
            queue,
            subscriber,
            shared=True,
            owner=f"w-{ULID.from_bytes(self.worker_id)}",
            publish_interval_ms=self.config.publish_interval // timedelta(milliseconds=1),
        )
        self.subscriber = subscriber
        self.stats = Stats()
        self._limits = shared.Limits(
            lease_ms=self.config.lease // timedelta(milliseconds=1),
            claim_n=self.config.claim_batch,
            max_span=self.config.max_span,
            max_deliveries=self.config.max_deliveries,
        )
        self._margin_ms = min(self._limits.lease_ms // 4, 5000)
        self._refiller = Refiller(
            queue,
            self.subscription,
            self.worker_id,
            self._limits,
            check_interval_s=self.config.check_interval.total_seconds(),
            skip_lost=self.config.on_lost == "skip",
            clock_ms=self.clock_ms,
            on_landed=self._landed,
        )
        self._held: dict[int, _Held] = {}
        self._ready: deque[int] = deque()
        self._ops: list[shared.Op] = []
        self._expiries: dict[bytes, int] = {}
        self._entries: dict[int, tuple[ManifestEntry, int]] = {}
        self._refill_s: float | None = None
        self._item_s: float | None = None
        self._handed_at: float | None = None
        self._pending: tuple[Future[Refilled], int] | None = None
        """A refill running ahead, and how many of ``_ops`` it applies."""
        self._short = False
        """The last refill got fewer entries than it asked for: none ahead until dry."""
        self._rng = random.Random(self.worker_id)
        self._spread = 1 + self._rng.random()
        self._cas_thread = started_pool(1, "tb-refill")
        self._pool = started_pool(max(4, self.config.read_ahead), "tb-worker")
        self._ahead = ReadAhead(
            store, self._pool, self.config.read_ahead, self.config.read_ahead_bytes
        )
        self._initialized = False
        self._closed = False
        self.on_applied: Callable[[list[int]], None] | None = None
        """Called right after each CAS landed with the sequences whose acks and rejects it
        applied (on the worker's CAS thread when the CAS was a refill running ahead)."""

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
                late: BaseException | None = None
                try:
                    self._settle(wait=True)  # what a refill running ahead leased is held too
                except (LeaseExpiredError, DataLossError) as e:
                    late = e
                for seq, h in self._held.items():  # returned by claim(): a delivery
                    action: shared.Action = "defer" if h.handed_out else "release"
                    self._ops.append(shared.Op(action, seq, h.token))
                self._held.clear()
                if self._ops:
                    self._apply(0)
                self.subscription.maybe_publish(force=True)
                if late is not None:
                    raise late
        finally:
            self._closed = True
            self._ahead.cancel()
            self._cas_thread.shutdown(wait=True)
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
        self._settle(wait=False)
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
                self._refill_ahead()
                self._handed_at = time.monotonic()
                return batch
            if self._pending is not None:
                self._settle(wait=True)  # ran dry before the refill ahead landed
                continue
            if not self._apply(self._claim_n()):
                return None

    def _release(self, seq: int, h: _Held, why: str = "lapsed_before_use") -> None:
        """Hand back a lease whose entry claim() never returned (one about to lapse before
        its turn, by default) with the next CAS: no delivery is charged."""
        del self._held[seq]
        self._entries.pop(seq, None)
        self._ahead.drop(seq)
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
        long against this worker's processing speed (contention on the progress object, S3's
        round trips): about twice the refill time's worth of entries, at most
        ``max_claim_batch``, never more than it processes in half a lease, counting the
        entries it already holds (so none lapses before its turn), and never more than a
        third of its share of ``max_span`` among the workers at work (each holds about
        three batches of the span: acked but not yet applied, ready, and the refill's), so
        that the span does not fill and stall them all."""
        base = self.config.claim_batch
        if self._refill_s is None or not self._item_s:
            return base
        cap = self.config.max_claim_batch or 8 * base
        want = math.ceil(2 * self._refill_s / self._item_s)
        safe = int(self._limits.lease_ms / 1000 / 2 / self._item_s) - len(self._ready)
        share = self.config.max_span // (3 * self._refiller.workers(self.clock_ms()))
        return max(1, min(max(base, want), cap, safe, share))

    def _low_water(self) -> int | None:
        """Entries left when the next refill starts ahead: what this worker hands out during
        one refill, times a random 1-2 (workers that run alike would otherwise refill at
        the same moments and conflict on the progress object; None until both are
        measured: no refill ahead yet)."""
        if self._refill_s is None or self._item_s is None:
            return None
        return max(1, math.ceil(self._refill_s / max(self._item_s, 1e-6) * self._spread))

    def _refill_ahead(self) -> None:
        """Start the next refill in the background if the leased entries are about to run
        out and more are known to be claimable (one at a time).  At the known tail, or
        after a refill that got fewer than it asked for (``max_span``, or everything else
        leased), claim() refills only when it runs dry: no CAS after CAS finding nothing."""
        low = self._low_water()
        if (
            self._pending is not None
            or not self.config.refill_ahead
            or low is None
            or self._short
            or len(self._ready) > low
            or not self._refiller.more_known(self.clock_ms())
        ):
            return
        self._release_lapsing()
        ops = list(self._ops)
        fut = self._cas_thread.submit(self._refiller.run, ops, self._claim_n())
        self._pending = (fut, len(ops))
        self._spread = 1 + self._rng.random()
        self.stats.incr("refills_ahead")

    def _settle(self, wait: bool) -> None:
        """Take in the refill running ahead: when it is done, or (``wait``) once it is."""
        if self._pending is None:
            return
        fut, n = self._pending
        if not wait and not fut.done():
            return
        self._pending = None
        self._absorb(fut.result(), n)

    def _batch(self, seq: int) -> ConsumedBatch:
        entry, size = self._entries.pop(seq)
        data = self._ahead.take(entry, size)
        self._schedule_prefetch()
        return ConsumedBatch(entry.sequence, entry.location, entry.metadata, data)

    def _unlinked(self, seq: int, err: MissingObjectError) -> None:
        """The object of leased ``seq`` is gone.  If a fresh root no longer links it,
        retention unlinked it (and GC reaped it) while this worker held the lease: every
        held entry below the root's first sequence is released (the next CAS resolves them
        as lost, counted with ``on_lost="skip"``) and, unless skipping, DataLossError says
        so.  An object the root still links is missing for another reason: re-raised."""
        self._settle(wait=True)  # the refiller's root is read here: none may run meanwhile
        snap = self._refiller.read_root()
        if seq >= snap.low:
            raise err
        for s in sorted(x for x, h in self._held.items() if x < snap.low and not h.handed_out):
            self._release(s, self._held[s], "unlinked_while_leased")
        if self.config.on_lost != "skip":
            raise DataLossError(
                f"subscriber {self.subscriber!r}: sequences before {snap.low} were unlinked "
                f"(retention) before they were acked; on_lost='skip' moves on"
            )

    def _schedule_prefetch(self) -> None:
        self._ahead.want(self._entries[s] for s in self._ready if s in self._entries)

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
        self._settle(wait=True)
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
        """One CAS now (after the refill running ahead, if any): buffered ops applied, up
        to ``claim_n`` entries leased.  Returns True if it leased anything.  Raises
        DataLossError / LeaseExpiredError *after* the CAS landed (what it leased stays
        queued for the next claim())."""
        self._settle(wait=True)
        self._release_lapsing()
        ops = list(self._ops)
        return self._absorb(self._refiller.run(ops, claim_n), len(ops))

    def _absorb(self, got: Refilled, n_ops: int) -> bool:
        """Take in what a refill did (on the caller's thread): its first ``n_ops`` buffered
        ops are applied; its leases are queued; then what it found is raised."""
        applied = got.applied
        self._ops = self._ops[n_ops:]
        self.stats.incr("cas" if got.wrote else "idle_polls")
        if got.new:
            self._refill_s = _ewma(self._refill_s, got.seconds)
        self._short = len(got.new) < got.asked
        self._entries.update(got.entries)
        self._lease(got.new)
        if applied.auto_rejected:
            self.stats.incr("auto_rejected", len(applied.auto_rejected))
            log.warning(
                "subscriber %r: rejected %s after %s deliveries",
                self.subscriber,
                applied.auto_rejected,
                self.config.max_deliveries,
            )
        if applied.lost is not None and self.config.on_lost == "skip":
            self.stats.incr("lost_sequences", applied.lost[1] - applied.lost[0] + 1)
        if applied.expired:  # first: it is this call's news; a loss is raised again next call
            self.stats.incr("expired_acks", len(applied.expired))
            raise LeaseExpiredError(self.subscriber, applied.expired)
        if applied.lost is not None and self.config.on_lost != "skip":
            first, last = applied.lost
            raise DataLossError(
                f"subscriber {self.subscriber!r}: sequences {first}..{last} were unlinked "
                f"(retention) before they were acked; on_lost='skip' moves on"
            )
        if got.error is not None:
            raise got.error
        return bool(got.new)

    def _landed(self, ops: Sequence[shared.Op], applied: shared.Applied) -> None:
        """A CAS landed (on the thread that ran it): tell ``on_applied`` at once."""
        if self.on_applied is not None and ops:
            refused = set(applied.expired)
            self.on_applied(
                [op.seq for op in ops if op.action in ("ack", "reject") and op.seq not in refused]
            )

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
