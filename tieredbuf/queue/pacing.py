"""Group commit across producers: keep a buffer's manifest appends near a fixed rate.

Every append is a conditional PUT of the root (plus the GET before it), and the
root is one object: with N producers appending on their own timers, its write rate
-- what S3 bills, and what makes CAS conflicts -- grows with N.  There is no broker
to batch for them, but every producer sees the others in the root it reads: each
append refreshes the writer's watermark (``updated_ms``, section 1).  So each
writer paces itself:

    interval = active_writers / manifest_writes_per_s

where ``active_writers`` counts the watermarks updated within the last
``max(10 s, 3 x interval)`` (itself included) in the last root it read.  Each writer
keeps a token bucket filled at one token per interval and holding at most
``BURST`` (2): an append takes a token, and without one the writer waits and,
meanwhile, accumulates what arrives into its next append (the direct producer keeps
uploading batches, the exporter keeps uploading sealed segments).  A writer that
waits does so for its own **slot**: the wall-clock instants ``(k + rank / N) x
interval``, ``rank`` being its place among the active writers' ids in sorted order
(a pseudo-random phase each cycle while the root does not show it yet: new writers,
started together, spread out instead of meeting).  Writers under load thus take turns, an
interval apart in all, instead of meeting in CAS conflicts (each a wasted PUT and a
GET); clocks need to agree to well within a slot's width, ``1 / rate`` (200 ms).  So N writers
together make about ``manifest_writes_per_s`` appends per second, whatever N is (a
window of T seconds sees at most ``rate x T`` plus each writer's burst); below that
rate a write never waits (the burst absorbs jitter), and above it a record waits at
most about one interval for its append.  That interval is the price in REMOTE
latency under load: 0.2 s for one writer at the default 5/s, 0.8 s for four, 3.2 s
for sixteen (docs/operations.md).  A new writer's first append waits for its slot
too (writers started together would otherwise all CAS at once).

A writer the root does not show yet (a newcomer) knows only what it reads: before its
first slot it reads the root once (:meth:`AppendPacer.probe`), so its first phase is
drawn in a cycle of the writers shown, and an append due right after that read CASes
against it (no second GET).  Newcomers started together cannot see each other, so
they still meet; after a lost CAS a newcomer backs off at random over 2, 4, 8 ... slots
(doubling with each loss in a row, at most ``MAX_BACKOFF_SLOTS``) instead of a fresh
phase in the same cycle, and a writer the root shows waits for its slot by rank.  A
lost CAS's retry carries what its writer uploaded meanwhile (the producer's batches,
the exporter's segments: ``ManifestQueue.append(regroup=True)``), so a conflict costs
no extra append later.  A writer CASes unread (optimistic) only once a root it read
shows it alone: the empty root read before a first append is no evidence.

The rate must be the same for every writer of a buffer (as ``TreeConfig.m`` must):
a writer with a higher rate takes a larger share.  ``0`` turns pacing off (every
append as soon as it is ready: the rate then grows with the writers).
"""

from __future__ import annotations

import hashlib
import math
import random
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from tieredbuf.errors import TieredBufError

if TYPE_CHECKING:
    from tieredbuf.queue.manifest_queue import ManifestQueue

DEFAULT_WRITES_PER_S = 5.0
"""Successful manifest appends per second per buffer, all writers together."""
ACTIVE_WINDOW_MS = 10_000
"""A writer whose watermark moved within this long (or 3 intervals) counts as active."""
BURST = 2.0
"""Appends a writer may make back to back after being below its share for a while."""
SLACK = 0.5
"""A slot may be taken with this much of a token still owed (timing noise)."""
PROBE_FRESH_S = 0.02
"""A first append due within this long of its probe read CASes against that read."""
REGROUP_WAIT_S = 0.05
"""A lost CAS's retry waits at least this long (or twice the recent upload time) for an
object still uploading, to carry it too (the producer's batches, the exporter's
segments)."""
MAX_BACKOFF_SLOTS = 64
"""The back-off window of a writer the root does not show yet stops doubling here
(64 slots: 12.8 s at 5/s)."""


def _id_phase(producer_id: str) -> float:
    """A stable pseudo-random phase in [0, 1) for a writer that sees no other."""
    digest = hashlib.blake2b(producer_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


class AppendPacer:
    """Spaces one writer's appends by ``active writers / writes_per_s`` seconds."""

    def __init__(
        self,
        queue: ManifestQueue,
        producer_id: str,
        writes_per_s: float = DEFAULT_WRITES_PER_S,
        *,
        clock: Callable[[], float] = time.monotonic,
        clock_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
        rng: random.Random | None = None,
    ) -> None:
        if writes_per_s < 0:
            raise ValueError(f"manifest_writes_per_s must be >= 0, got {writes_per_s}")
        self.queue = queue
        self.producer_id = producer_id
        self.writes_per_s = writes_per_s
        self._clock = clock
        self._clock_ms = clock_ms
        self._tokens = 1.0 - SLACK
        """Appends this writer may make now (refilled at 1 per interval, at most BURST;
        below 0 after appends that could not wait: a flush or close with a timeout).
        A new writer starts short of a whole one, so its first append waits for its slot
        (at most one interval): writers started together do not all CAS at once."""
        self._at = clock()
        self._interval = 0.0
        self._known = False
        """The last root read showed this writer's watermark (its slot is by rank)."""
        self._losses = 0
        """CASes lost in a row while the root did not show this writer (its back-off)."""
        self._backoff_until = 0.0
        """The end of that back-off (``clock()``): no append before it (due_in says so,
        so a flusher keeps gathering into one batch meanwhile)."""
        self._rng = rng or random.Random()
        self._probed_at: float | None = None
        """When :meth:`probe` read the root (None: not yet; -1: failed, or already used)."""
        self._lock = threading.Lock()

    def _active_ids(self) -> list[str]:
        """Sorted ids of the writers (this one included) whose watermark moved recently,
        as of the last root this process read or wrote for this buffer."""
        seen = self.queue.last_read
        if seen is None:
            self._known = False
            return [self.producer_id]
        window = max(ACTIVE_WINDOW_MS, int(3000 * self._interval))
        # active as of that read: a root read long ago shows who was appending then,
        # not that they stopped since (judged from now, they would seem to have)
        since = min(self._clock_ms(), getattr(self.queue, "last_read_ms", 0) or
                    self._clock_ms()) - window
        ids = {w.producer_id for w in seen.watermarks.values() if w.updated_ms >= since}
        self._known = self.producer_id in ids
        ids.add(self.producer_id)
        return sorted(ids)

    def active_writers(self) -> int:
        """Writers (this one included) appending recently (1 before any read)."""
        return len(self._active_ids())

    def alone(self) -> bool:
        """True when the last root read shows this writer and no other appending recently:
        its next append may CAS against the root it wrote last without reading it
        (``ManifestQueue.append(optimistic=True)``: one request, one round trip).

        A root that does not show this writer yet (read before its first append) is no
        evidence: writers started together all read an empty root, and the first to
        append would CAS its second append blind against the others' (bench/cost.py saw
        3 of 7 conflicts so).  So a lone writer's second append reads once more."""
        if not self.queue.knows_root:
            return False
        n = self.active_writers()
        return n == 1 and self._known

    def probe(self) -> None:
        """Before a writer's first append: read the root once, if this process has not,
        so the first slot is chosen among the writers it shows (a cycle of ``N`` slots,
        not the one slot of a writer that sees none).  An error (the store's, a corrupt
        root) is left to the append itself, which reads the same root and reports it.
        No request when unpaced or once a root was read."""
        if self.writes_per_s == 0 or self._probed_at is not None:
            return
        if self.queue.last_read is not None:
            return
        self._probed_at = -1.0  # tried: once is enough
        try:
            self.queue.read()
        except TieredBufError:
            return
        self._probed_at = self._clock()

    def optimistic(self) -> bool:
        """CAS the next append against the root this process last read or wrote, unread:
        when :meth:`alone`, or once for a first append due right after its probe (that
        read is the one the CAS needs: a newcomer's probe costs no extra request)."""
        with self._lock:
            probed = self._probed_at
            fresh = probed is not None and probed >= 0 and (
                self._clock() - probed <= PROBE_FRESH_S)
            if fresh:
                self._probed_at = -1.0  # used
        return fresh or self.alone()

    def interval(self) -> float:
        """Seconds between this writer's appends under load now (0: unpaced)."""
        return self._schedule()[0]

    def _schedule(self) -> tuple[float, float | None]:
        """(interval, this writer's slot phase in [0, 1), or None for a writer the root
        does not show yet: it takes a pseudo-random phase each cycle)."""
        if self.writes_per_s == 0:
            return 0.0, 0.0
        ids = self._active_ids()
        n = len(ids)
        known = self._known
        phase = ids.index(self.producer_id) / n if known else None
        with self._lock:
            self._interval = n / self.writes_per_s
        return n / self.writes_per_s, phase

    def _refill(self, interval: float) -> None:
        """Under the lock: add the tokens earned since the last look."""
        now = self._clock()
        if interval > 0:
            self._tokens = min(BURST, self._tokens + (now - self._at) / interval)
        self._at = now

    def due_in(self, ahead: int = 0, *, turn: bool = False) -> float:
        """Seconds until this writer may append (<= 0: now); ``ahead``: after that many
        more appends (a batch already waiting takes the next token).  ``turn``: wait for
        this writer's slot even with a token in hand, when it is not alone (a flush or
        close: many writers closing together would otherwise all CAS at once)."""
        interval, phase = self._schedule()
        if interval == 0:
            return 0.0
        with self._lock:
            self._refill(interval)
            owed = 1 + ahead - self._tokens
            backoff = self._backoff_until - self._clock()
        if backoff > 0:  # a newcomer backing off after a lost CAS
            return backoff + ahead * interval
        if owed <= 0 and not (turn and interval * self.writes_per_s > 1):
            return 0.0  # below its share: at once
        # over its share: its next slot by which it has (nearly) earned the token
        now = self._clock_ms() / 1000
        earliest = now + max(0.0, (owed - SLACK) * interval)
        # a slot that began less than half a slot ago is still this writer's (a wait ends
        # at its slot, not just after it: that would chase the next one)
        late = 0.5 / self.writes_per_s
        k = math.floor((earliest - late) / interval)
        while True:
            at = (k + (phase if phase is not None else self._cycle_phase(k))) * interval
            if at >= earliest - late:
                return at - now
            k += 1

    def _cycle_phase(self, cycle: int) -> float:
        """A new writer's phase in one cycle: pseudo-random, so that writers the root
        does not show yet (started together, say) spread out instead of meeting."""
        return _id_phase(f"{self.producer_id}/{cycle}")

    def after_loss(self) -> float:
        """Seconds to wait after a lost CAS before reading the root again.

        A writer the root showed waits for its next slot by rank.  One the root does not
        show yet (a newcomer: writers started together) cannot know how many others are
        in its place, so it backs off at random over a window that doubles with each CAS
        it loses in a row: 2, 4, 8 ... slots (at most MAX_BACKOFF_SLOTS), instead of a
        fresh phase in the same small cycle, where the losers of one round meet again."""
        interval, phase = self._schedule()
        if interval == 0:
            return 0.0
        if phase is not None:
            return self.due_in(turn=True)
        with self._lock:
            self._losses += 1
            slots = min(MAX_BACKOFF_SLOTS, 2 ** self._losses)
            left = self._rng.uniform(0.0, slots) / self.writes_per_s
            self._backoff_until = self._clock() + left
        return left

    def wait_turn(self, stop: Callable[[], bool], wait: Callable[[float], object]) -> None:
        """After a lost CAS: wait as :meth:`after_loss` says, not the CAS loop's few
        milliseconds -- writers that met once would meet again.  ``stop()`` ends the wait
        (a close with a timeout); ``wait(seconds)`` sleeps, interruptibly."""
        left = self.after_loss()
        deadline = self._clock() + left
        while left > 0 and not stop():
            wait(left)
            left = deadline - self._clock()

    def appended(self) -> None:
        """An append landed (or was found landed): it takes a token."""
        interval = self.interval()
        with self._lock:
            self._losses = 0
            self._refill(interval)
            if interval > 0:
                self._tokens = max(-BURST, self._tokens - 1)
