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
uploading batches, the exporter keeps uploading sealed segments).  So N writers
together make about ``manifest_writes_per_s`` appends per second, whatever N is (a
window of T seconds sees at most ``rate x T`` plus each writer's burst); below that
rate a write never waits (the burst absorbs jitter), and above it a record waits at
most about one interval for its append.  That interval is the price in REMOTE
latency under load: 0.2 s for one writer at the default 5/s, 0.8 s for four, 3.2 s
for sixteen (docs/operations.md).

The rate must be the same for every writer of a buffer (as ``TreeConfig.m`` must):
a writer with a higher rate takes a larger share.  ``0`` turns pacing off (every
append as soon as it is ready: the rate then grows with the writers).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tieredbuf.queue.manifest_queue import ManifestQueue

DEFAULT_WRITES_PER_S = 5.0
"""Successful manifest appends per second per buffer, all writers together."""
ACTIVE_WINDOW_MS = 10_000
"""A writer whose watermark moved within this long (or 3 intervals) counts as active."""
BURST = 2.0
"""Appends a writer may make back to back after being below its share for a while."""


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
    ) -> None:
        if writes_per_s < 0:
            raise ValueError(f"manifest_writes_per_s must be >= 0, got {writes_per_s}")
        self.queue = queue
        self.producer_id = producer_id
        self.writes_per_s = writes_per_s
        self._clock = clock
        self._clock_ms = clock_ms
        self._tokens = 1.0
        """Appends this writer may make now (refilled at 1 per interval, at most BURST;
        below 0 after appends that could not wait: a flush or close with a timeout)."""
        self._at = clock()
        self._interval = 0.0
        self._lock = threading.Lock()

    def active_writers(self) -> int:
        """Writers (this one included) whose watermark moved recently, as of the last root
        this process read for this buffer (1 before any read)."""
        seen = self.queue.last_read
        if seen is None:
            return 1
        window = max(ACTIVE_WINDOW_MS, int(3000 * self._interval))
        since = self._clock_ms() - window
        ids = {w.producer_id for w in seen.watermarks.values() if w.updated_ms >= since}
        ids.add(self.producer_id)
        return len(ids)

    def alone(self) -> bool:
        """True when no other writer appended recently (and this one has appended before):
        its next append may CAS against the root it wrote last without reading it
        (``ManifestQueue.append(optimistic=True)``: one request, one round trip)."""
        return self.queue.knows_root and self.active_writers() == 1

    def interval(self) -> float:
        """Seconds between this writer's appends now (0: unpaced)."""
        if self.writes_per_s == 0:
            return 0.0
        with self._lock:
            self._interval = self.active_writers() / self.writes_per_s
            return self._interval

    def _refill(self, interval: float) -> None:
        """Under the lock: add the tokens earned since the last look."""
        now = self._clock()
        if interval > 0:
            self._tokens = min(BURST, self._tokens + (now - self._at) / interval)
        self._at = now

    def due_in(self, ahead: int = 0) -> float:
        """Seconds until this writer may append (<= 0: now); ``ahead``: after that many
        more appends (a batch already waiting takes the next token)."""
        interval = self.interval()
        with self._lock:
            if interval == 0:
                return 0.0
            self._refill(interval)
            return (1 + ahead - self._tokens) * interval

    def appended(self) -> None:
        """An append landed (or was found landed): it takes a token."""
        interval = self.interval()
        with self._lock:
            self._refill(interval)
            if interval > 0:
                self._tokens = max(-BURST, self._tokens - 1)
