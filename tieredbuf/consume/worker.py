"""A worker of a shared work queue: several workers, one subscriber, any order.

    w = buf.worker("jobs", lease=timedelta(seconds=30))
    while (b := w.claim(timeout=10)) is not None:   # long-polls up to 10 s when idle
        process(b)              # at-least-once: a lapsed lease is redelivered to another worker
        w.ack(b.sequence)       # or w.defer(seq) (redelivered after a delay), w.reject(seq, ...)
    w.close()                   # applies what is buffered, hands back what it still holds

Every change is one CAS of the subscriber's progress object (:mod:`tieredbuf.queue.shared`
decides; :mod:`tieredbuf.consume.refill` runs it): a refill applies this worker's
buffered operations and leases the next claimable entries (lowest first) under a fresh
operation token, which is also how a retry after an unknown outcome finds its own
write.  The workers a buffer opens on one queue share one writer of that object
(:mod:`tieredbuf.consume.hub`): what several ask for while a CAS is under way rides the
next one together, so they never race each other for it.

Acks, rejects and the word that claim() returned an entry (``out``: the only thing
that charges a delivery, never sent in a CAS started before claim() returned) are
buffered until the next refill, ``flush()``, ``close()``, or at once when an entry's
lease is about to lapse; ``defer`` and
``extend`` are applied at once.  An entry whose history is unknown (a worker went
silent holding it: ``SUSPECT``) or whose lease entered its margin during the data GET
is *marked* first -- one CAS that charges the delivery and renews the lease -- and only
then returned.  A data GET that fails leaves the entry first in line: the next claim()
tries it again (as a consumer retries its cursor); close() hands it back uncharged.

**Refilling ahead.**  At S3's round trips a refill takes 60-100 ms, more when several
workers contend for the progress object.  So a worker starts its next refill in the
background when its leased entries are about to run out (when no more are left than it
hands out during one refill), and ``claim()`` waits for a CAS only when it has none
left at all.  A refill leases ``claim_batch`` entries, or more when its refills are slow
against the caller's processing speed (:mod:`tieredbuf.consume.pace`).  Leases are honoured: an
entry within its margin of lapsing (a quarter of the lease, at most 5 s) is never handed
out.  ``refill_ahead=False`` refills only when claim() finds nothing left (``tieredbuf
work``: a lease covers one command).

Every entry is acked exactly once; processing is at-least-once.  An ack whose lease
lapsed *and* was claimed again by another worker is refused: the call that applies it
(the next claim(), flush() or close()) raises LeaseExpiredError and that ack changes
nothing -- the other worker's ack counts.  Workers never bump the subscriber's epoch.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from datetime import timedelta

from ulid import ULID

from tieredbuf.config import WorkerConfig
from tieredbuf.consume import pace
from tieredbuf.consume.claimwait import ClaimWait
from tieredbuf.consume.consumer import ConsumedBatch
from tieredbuf.consume.fetch import ReadAhead
from tieredbuf.consume.holdings import Held, Holdings
from tieredbuf.consume.hub import Hubs
from tieredbuf.consume.refill import Refilled
from tieredbuf.errors import (
    AckOrderError,
    ClosedError,
    CorruptError,
    DataLossError,
    LeaseExpiredError,
    MissingObjectError,
    SubscriberRemovedError,
)
from tieredbuf.format.manifest import ManifestEntry
from tieredbuf.format.progress import MAX_REASON, Progress
from tieredbuf.queue import shared
from tieredbuf.queue.manifest_queue import ManifestQueue
from tieredbuf.queue.subscription import NamedSubscription
from tieredbuf.runtime.pools import started_pool
from tieredbuf.runtime.stats import Stats
from tieredbuf.store.base import Store

log = logging.getLogger(__name__)
_MS = timedelta(milliseconds=1)
MARKS_PER_HAND_OUT = 3
"""Marks (CASes renewing a lease) one hand-out may take before the entry is handed back."""


def _ewma(old: float | None, x: float, alpha: float = 0.3) -> float:
    return x if old is None else old + alpha * (x - old)


DAMAGED_RETRY_MS = 1000
"""A lease on an entry whose data object is damaged (CorruptError) is handed back,
uncharged, claimable again this long after: the next worker meets the same error."""


class Worker:
    """One worker of the shared subscriber ``subscriber``; use from one thread (but
    :meth:`wake` from any)."""

    def __init__(
        self,
        store: Store,
        queue: ManifestQueue,
        subscriber: str,
        config: WorkerConfig | None = None,
        hubs: Hubs | None = None,
    ) -> None:
        """``hubs``: the registry of the buffer's refill hubs (the workers one buffer
        opens on one queue with one configuration share one); None: a hub of its own."""
        self.store = store
        self.queue = queue
        self.config = config or WorkerConfig()
        self.worker_id = ULID().bytes
        self._hubs = hubs or Hubs()
        self._hub = self._hubs.attach(queue, subscriber, self.config, self.worker_id)
        self.subscription: NamedSubscription = self._hub.sub
        """The queue's subscription (shared with the other workers of the hub)."""
        self.subscriber = subscriber
        self.stats = Stats()
        self._limits = self._hub.limits
        self._margin_ms = min(self._limits.lease_ms // 4, 5000)
        self._wait = ClaimWait(
            queue.read_footer,
            lambda: self._hub.reload(),
            self.clock_ms,
            max_s=self.config.idle_poll_max.total_seconds(),
        )
        self._h = Holdings()
        self._held = self._h.held  # the same dict (tests read it)
        self._entries: dict[int, tuple[ManifestEntry, int]] = {}
        self._got: dict[int, ConsumedBatch] = {}
        """Data fetched for an entry whose hand-out waits for its mark (a CAS that failed)."""
        self._refill_s: float | None = None
        self._item_s: float | None = None
        self._handed_at: float | None = None
        self._pending: tuple[Future[Refilled], int] | None = None
        """A refill running ahead, and how many of the buffered ops it applies."""
        self._short = False
        """The last refill got fewer entries than it asked for: none ahead until dry."""
        self._rng = random.Random(self.worker_id)
        self._spread = 1 + self._rng.random()
        self._pool = started_pool(max(4, self.config.read_ahead), "tb-worker")
        self._ahead = ReadAhead(
            store, self._pool, self.config.read_ahead, self.config.read_ahead_bytes
        )
        self._tried_ms = 0
        """When claim() last found nothing to lease (the progress object then was fresh)."""
        self._initialized = False
        self._closed = False
        self.on_applied: Callable[[list[int]], None] | None = None
        """Called right after each CAS landed with the sequences whose acks and rejects it
        applied (on the hub's thread: :mod:`tieredbuf.consume.hub`)."""
        self.on_mark: Callable[[int], None] | None = None
        """Called with a sequence just before the CAS that marks it (charges its delivery
        before claim() returns it): a test's record of a hand-out under way."""

    def clock_ms(self) -> int:
        """The wall clock leases are judged by (the subscription's)."""
        return self.subscription.clock_ms()

    # --- lifecycle -------------------------------------------------------------------

    def initialize(self, start: str = "earliest") -> None:
        """Register the shared subscriber if new (at the earliest entry the buffer holds, or
        the tail with ``start="latest"``).  No buffer at the URL: BufferNotFoundError."""
        self._check_open()
        if self._hub.retired:  # the queue was removed since this worker was opened
            if self._initialized:
                raise SubscriberRemovedError(self.subscriber, 0)
            self._rejoin()
        self._hub.register(start)
        self._initialized = True

    def _rejoin(self) -> None:
        """Leave a retired hub for a live one (this worker holds nothing yet)."""
        if self._hubs.detach(self._hub, self.worker_id):
            self._hub.close()
        self._hub = self._hubs.attach(self.queue, self.subscriber, self.config, self.worker_id)
        self.subscription = self._hub.sub

    def close(self) -> None:
        """Apply buffered operations and hand back every entry still held: one returned
        by claim() and not resolved is deferred (claimable at once, its delivery counted),
        one never returned is released (uncharged).  The queue's position is published
        into the root when this is the last worker of its hub to close and the hub is
        the queue's publisher (the one running the refills of the lowest id among the
        workers seen within a lease: see :meth:`Refiller.publisher`); ``flush()`` always
        publishes."""
        if self._closed:
            return
        self._wait.wake()
        last: bool | None = None
        try:
            if self._initialized:
                late: BaseException | None = None
                try:
                    self._settle(wait=True)  # what a refill running ahead leased is held too
                except (LeaseExpiredError, DataLossError) as e:
                    late = e
                for seq, h in self._held.items():
                    if h.handed_out:
                        self._h.buffer(shared.Op("defer", seq, h.token, ms=0), h.expires_ms)
                    else:
                        self._h.buffer(shared.Op("release", seq, h.token), h.expires_ms)
                self._held.clear()
                if self._h.ops:
                    self._apply(0)
                last = self._hubs.detach(self._hub, self.worker_id)
                if last and self._hub.publisher(self.clock_ms()):
                    self._hub.publish(force=True)
                if late is not None:
                    raise late
        finally:
            self._closed = True
            self._ahead.cancel()
            if last is None:
                last = self._hubs.detach(self._hub, self.worker_id)
            if last:
                self._hub.close()
            self._pool.shutdown(wait=True)

    def wake(self) -> None:
        """End a ``claim(timeout=...)`` wait now (from any thread; it returns None): the
        caller is stopping.  Later waits end at once too."""
        self._wait.wake()

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

    def claim(self, timeout: float | None = None) -> ConsumedBatch | None:
        """The next entry leased to this worker, with its data; None when nothing is
        claimable (everything is done, leased to live workers, or waiting for its
        redelivery delay).

        ``timeout`` (seconds): wait up to this long for an entry (a long poll,
        :mod:`tieredbuf.consume.claimwait`): an idle worker reads the root's 22-byte footer
        with a backoff up to ``idle_poll_max`` (3 s) and its progress object every 15 s,
        wakes when a lease lapses or a delay ends, and so sends at most 0.4 requests/s.
        The backoff carries over from call to call.  Without a timeout, no wait."""
        self._ensure()
        if self._handed_at is not None:  # the caller's processing time of the last one
            self._item_s = _ewma(self._item_s, time.monotonic() - self._handed_at)
            self._handed_at = None
        self._settle(wait=False)
        self._flush_if_lapsing()
        deadline = None if timeout is None or timeout <= 0 else time.monotonic() + timeout
        attempt = deadline is None or not self._wait.idle or self._h.has_ready()
        while True:
            if attempt:
                b = self._claim_now()
                if b is not None or deadline is None:
                    if b is not None:
                        self._wait.reset()
                    return b
            self._check_open()
            assert deadline is not None
            if not self._wait.wait(self._hub.known_tail(), self._due, self._open, deadline):
                return None
            attempt = True  # something may be claimable now

    def _due(self) -> int | None:
        """When an entry becomes claimable by time alone (a lease lapsing, a redelivery
        delay ending) after this worker last found nothing: from the progress object as
        last seen, no request."""
        p = self.subscription.progress
        return None if p is None else shared.next_due(p, self._tried_ms)

    def _open(self, p: Progress) -> bool:
        """Whether a progress object just read shows something this worker could claim."""
        now = self.clock_ms()
        return any(shared.claimable(x, now) for x in p.leases) or (
            p.claim_cursor < self._hub.known_tail()
            and p.claim_cursor < p.position + self._limits.max_span
        )

    def _claim_now(self) -> ConsumedBatch | None:
        while True:
            while (front := self._h.front()) is not None:
                seq, h = front
                if not h.said and h.expires_ms - self._margin_ms <= self.clock_ms():
                    self._release(seq, h)
                    continue
                got = self._hand_out(seq, h)
                if got is None:
                    continue
                batch, word = got
                self._h.ready.popleft()
                h.handed_out = True
                self._h.lapsed.discard(seq)
                self.stats.incr("claimed")
                try:
                    self._refill_ahead()
                finally:  # after it: no CAS started before claim() returns charges this
                    if word is not None:
                        self._h.buffer(word, h.expires_ms)
                self._handed_at = time.monotonic()
                return batch
            if self._pending is not None:
                self._settle(wait=True)  # ran dry before the refill ahead landed
                continue
            if not self._apply(self._claim_n()):
                self._tried_ms = self.clock_ms()
                return None

    def _hand_out(self, seq: int, h: Held) -> tuple[ConsumedBatch, shared.Op | None] | None:
        """``seq``'s data, once the progress object may count its delivery: with the
        ``out`` op for the caller to buffer once nothing else will start a CAS before
        claim() returns, or -- for a suspect entry, or one whose lease entered its margin
        during the GET -- a mark landed first (no op then).  None: it is no longer this
        worker's.  A failed GET or CAS raises with ``seq`` still first in line (data
        kept)."""
        batch = self._got.get(seq)
        if batch is None:
            try:
                batch = self._batch(seq)
            except MissingObjectError as e:
                self._h.ready.popleft()
                self._unlinked(seq, e)  # retention's loss: released (raised unless skip)
                return None
            except CorruptError:  # a damaged object fails again: hand it back uncharged,
                self._h.ready.popleft()  # claimable after a pause, and go on to the next
                self._release(seq, h, "damaged_object", DAMAGED_RETRY_MS)
                raise
            self._got[seq] = batch
        word: shared.Op | None = None
        for _ in range(MARKS_PER_HAND_OUT + 1):
            inside = h.expires_ms - self._margin_ms <= self.clock_ms()
            if not h.said or (inside and not h.marking):
                # a mark when its history is unknown, or to renew a lease the GET (or a
                # slow mark) took into its margin; else the word rides the next CAS that
                # starts after claim() returned (the caller buffers it)
                if h.suspect or inside or h.said:
                    op = shared.Op("mark", seq, h.token, ms=self._limits.lease_ms)
                    self._h.buffer(op, h.expires_ms)
                    word, h.marking = None, True
                else:
                    word, h.marking = shared.Op("out", seq, h.token), False
                h.said = True
            if not h.marking:
                break
            if self.on_mark is not None:
                self.on_mark(seq)
            self.stats.incr("marked")
            self._apply(0)  # on an error the mark stays buffered: the next CAS retries it
            if self._held.get(seq) is not h:
                self._got.pop(seq, None)
                return None  # refused: the lease lapsed and another worker took it
        else:  # every mark took the lease into its margin again: the store is too slow
            self._release(seq, h, "marks_too_slow")
            return None
        self._got.pop(seq, None)
        return batch, word

    def _release(
        self, seq: int, h: Held, why: str = "lapsed_before_use", after_ms: int | None = None
    ) -> None:
        """Hand back a lease whose entry claim() never returned (one about to lapse before
        its turn, by default) with the next CAS: no delivery is charged; claimable again
        at once, or ``after_ms`` later."""
        del self._held[seq]
        self._forget(seq)
        self._h.buffer(shared.Op("release", seq, h.token, ms=after_ms), h.expires_ms)
        self.stats.incr(why)

    def _forget(self, seq: int) -> None:
        self._entries.pop(seq, None)
        self._got.pop(seq, None)
        self._ahead.drop(seq)

    def _release_lapsing(self) -> None:
        for seq in self._h.lapsing(self.clock_ms(), self._margin_ms):
            self._release(seq, self._held[seq])

    def _claim_n(self) -> int:
        """How many to lease in the next refill (:func:`tieredbuf.consume.pace.claim_n`)."""
        return pace.claim_n(
            base=self.config.claim_batch,
            cap=self.config.max_claim_batch or 8 * self.config.claim_batch,
            refill_s=self._refill_s,
            item_s=self._item_s,
            lease_s=self._limits.lease_ms / 1000,
            ready=self._h.ready_n(),
            max_span=self.config.max_span,
            workers=self._hub.workers(self.clock_ms()),
        )

    def _refill_ahead(self) -> None:
        """Start the next refill in the background if the leased entries are about to run
        out and more are known to be claimable (one at a time).  At the known tail, or
        after a refill that got fewer than it asked for (``max_span``, or everything else
        leased), claim() refills only when it runs dry: no CAS after CAS finding nothing."""
        low = pace.low_water(self._refill_s, self._item_s, self._spread)
        if (
            self._pending is not None
            or not self.config.refill_ahead
            or low is None
            or self._short
            or self._h.ready_n() > low
            or not self._hub.more_known(self.clock_ms())
        ):
            return
        self._release_lapsing()
        ops = list(self._h.ops)
        patience = self._h.ready_n() * (self._item_s or 0.0)  # till it runs dry
        fut = self._hub.submit(self.worker_id, ops, self._claim_n(), patience, self._landed)
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
        entry, size = self._entries[seq]
        data = self._ahead.take(entry, size)  # may raise: the entry stays known
        del self._entries[seq]
        self._schedule_prefetch()
        return ConsumedBatch(entry.sequence, entry.location, entry.metadata, data)

    def _unlinked(self, seq: int, err: MissingObjectError) -> None:
        """The object of leased ``seq`` is gone.  If a fresh root no longer links it,
        retention unlinked it (and GC reaped it) while this worker held the lease: every
        held entry below the root's first sequence is released (the next CAS resolves them
        as lost, counted with ``on_lost="skip"``) and, unless skipping, DataLossError says
        so.  An object the root still links is missing for another reason: re-raised."""
        self._settle(wait=True)  # its own refill first (the hub reads the root locked)
        snap = self._hub.read_root()
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
        self._ahead.want(
            self._entries[s]
            for s, t in self._h.ready
            if s in self._entries and self._h.current(s, t) and s not in self._got
        )

    # --- resolving -------------------------------------------------------------------

    def _take(self, seq: int) -> Held:
        self._ensure()
        h = self._held.get(seq)
        if (h is None or not h.handed_out) and seq in self._h.lapsed:
            self._h.lapsed.discard(seq)
            raise LeaseExpiredError(self.subscriber, [seq])
        if h is None or not h.handed_out:
            raise AckOrderError(f"sequence {seq} is not leased to this worker (or was resolved)")
        return h

    def ack(self, sequence: int) -> None:
        """``sequence`` is processed (any order).  Buffered; see the module docstring."""
        h = self._take(sequence)
        del self._held[sequence]
        self._h.buffer(shared.Op("ack", sequence, h.token), h.expires_ms)
        self.stats.incr("acks")
        self._flush_if_lapsing()

    def reject(self, sequence: int, reason: bytes = b"") -> None:
        """``sequence`` failed for good: a dead letter, listed by ``tieredbuf subscribers``
        with its reason, never redelivered unless redriven (``Buffer.redrive``); its entry
        stays in the buffer until then.  Buffered like an ack."""
        if len(reason) > MAX_REASON:
            raise ValueError(f"reject reason of {len(reason)} bytes: at most {MAX_REASON}")
        h = self._take(sequence)
        del self._held[sequence]
        self._h.buffer(shared.Op("reject", sequence, h.token, bytes(reason)), h.expires_ms)
        self.stats.incr("rejects")
        self._flush_if_lapsing()

    def defer(self, sequence: int, delay: timedelta | None = None) -> None:
        """Hand ``sequence`` back now (one CAS, with whatever is buffered): claimable again,
        by any worker, after ``delay`` -- by default the redelivery delay, growing with its
        deliveries (``redelivery_delay`` doubled per delivery, at most
        ``redelivery_delay_max``); ``timedelta(0)``: at once."""
        if delay is not None and delay < timedelta(0):
            raise ValueError(f"delay must be >= 0, got {delay!r}")
        h = self._take(sequence)
        del self._held[sequence]
        ms = None if delay is None else delay // _MS
        self._h.buffer(shared.Op("defer", sequence, h.token, ms=ms), h.expires_ms)
        self.stats.incr("defers")
        self._apply(0)

    def extend(self, sequence: int, by: timedelta) -> None:
        """Keep ``sequence`` (returned by claim(), not yet resolved) for ``by`` from now
        (SQS's ChangeMessageVisibility): one CAS, with whatever is buffered.  Fenced like an
        ack: if its lease lapsed and another worker took it, LeaseExpiredError and it is no
        longer this worker's."""
        if by <= timedelta(0):
            raise ValueError(f"extend by a positive duration, got {by!r}")
        h = self._take(sequence)
        self._h.buffer(shared.Op("extend", sequence, h.token, ms=by // _MS), h.expires_ms)
        self.stats.incr("extends")
        self._apply(0)

    def expires_ms(self, sequence: int) -> int:
        """When the lease on ``sequence`` (held by this worker) lapses, by :meth:`clock_ms`."""
        h = self._held.get(sequence)
        if h is None:
            raise AckOrderError(f"sequence {sequence} is not leased to this worker")
        return h.expires_ms

    def waiting_s(self) -> float | None:
        """Seconds until the first entry in its redelivery delay becomes claimable again
        (from the last progress object this worker saw: no request); None if none waits."""
        p = self.subscription.progress
        if p is None:
            return None
        now = self.clock_ms()
        due = [x.expires_ms for x in p.leases if x.back and x.expires_ms > now]
        return (min(due) - now) / 1000 if due else None

    def flush(self) -> None:
        """Apply every buffered operation now and publish the subscriber's position."""
        self._ensure()
        self._settle(wait=True)
        if self._h.ops:
            self._apply(0)
        self._hub.publish(force=True)

    def _flush_if_lapsing(self) -> None:
        soonest = self._h.soonest_due()
        if soonest is not None and soonest - self._margin_ms <= self.clock_ms():
            self._apply(0)

    # --- the one CAS -----------------------------------------------------------------

    def _apply(self, claim_n: int) -> bool:
        """One CAS now (after the refill running ahead, if any): buffered ops applied, up
        to ``claim_n`` entries leased.  Returns True if it leased anything.  Raises
        DataLossError / LeaseExpiredError *after* the CAS landed (what it leased stays
        queued for the next claim())."""
        self._settle(wait=True)
        self._release_lapsing()
        ops = list(self._h.ops)
        return self._absorb(self._hub.run(self.worker_id, ops, claim_n, self._landed), len(ops))

    def _absorb(self, got: Refilled, n_ops: int) -> bool:
        """Take in what a refill did (on the caller's thread): its first ``n_ops`` buffered
        ops are applied; its leases are queued; then what it found is raised."""
        applied = got.applied
        done_ops = self._h.applied(n_ops)
        self.stats.incr("cas" if got.wrote else "idle_polls")
        if got.new:
            self._refill_s = _ewma(self._refill_s, got.seconds)
        self._short = len(got.new) < got.asked
        for seq, why in self._h.renewed(done_ops, applied):
            self._forget(seq)
            self.stats.incr(why)
        self._entries.update(got.entries)
        self._h.lease(got.new)
        self._schedule_prefetch()
        for x in got.unloaded:  # leased, but their entries could not be loaded
            self._h.buffer(shared.Op("release", x.seq, x.token), x.expires_ms)
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

    @property
    def held(self) -> list[int]:
        """Sequences leased to this worker and not yet resolved."""
        return sorted(self._held)
