"""The long poll of an idle worker: ``claim(timeout=...)`` waits here when nothing is
claimable, at most 0.4 requests/s, and wakes when something may be.

Work becomes claimable in three ways, and each is watched at its own cost:

* **new entries** (a producer appended): the root's 22-byte footer shows a new
  ``next_sequence`` (:mod:`tieredbuf.queue.longpoll`'s footer read).  Read 0.1 s after
  the worker went idle, then with a backoff doubling to ``max_s`` (``idle_poll_max``,
  3 s): new entries are seen within ``max_s``;
* **by time alone**: a lease lapsing, a deferred entry's redelivery delay ending.  The
  last progress object seen says when (:func:`tieredbuf.queue.shared.next_due`): no
  request until then;
* **another worker hands an entry back** (defer, release on close, a redrive): only the
  progress object shows it; it is read every ``progress_every`` x ``max_s`` (15 s).

So an idle worker with nothing pending sends one footer GET per 3 s and one progress
GET per 15 s (0.4/s).  The backoff lives across calls (a worker calling
``claim(timeout=1)`` in a loop keeps backing off); :meth:`ClaimWait.reset` (something
was claimed) ends the idle period.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from tieredbuf.format.manifest import Footer
from tieredbuf.format.progress import Progress
from tieredbuf.queue.longpoll import IDLE_BACKOFF_S

PROGRESS_EVERY = 5
"""The progress object is read once per this many ``max_s`` while idle."""


class ClaimWait:
    """One worker's idle wait (not thread-safe, but :meth:`wake` may be called from any
    thread)."""

    def __init__(
        self,
        read_footer: Callable[[], Footer],
        read_progress: Callable[[], Progress],
        clock_ms: Callable[[], int],
        *,
        max_s: float,
        first_s: float = IDLE_BACKOFF_S,
        progress_every: int = PROGRESS_EVERY,
    ) -> None:
        self._read_footer = read_footer
        self._read_progress = read_progress
        self._clock_ms = clock_ms
        self.first_s = min(first_s, max_s)
        self.max_s = max_s
        self.progress_s = progress_every * max_s
        self._stop = threading.Event()
        self._backoff = 0.0
        self._footer_at: float | None = None
        self._progress_at: float | None = None
        self.footer_reads = 0
        self.progress_reads = 0

    @property
    def idle(self) -> bool:
        """True between a wait that found nothing and the next claim or reset."""
        return self._footer_at is not None

    def reset(self) -> None:
        self._backoff = 0.0
        self._footer_at = self._progress_at = None

    def wake(self) -> None:
        """End a wait now and every later one (the worker is closing): they return False."""
        self._stop.set()

    @property
    def woken(self) -> bool:
        return self._stop.is_set()

    def wait(
        self,
        tail: int,
        due_ms: Callable[[], int | None],
        claimable: Callable[[Progress], bool],
        deadline: float,
    ) -> bool:
        """Wait until something may be claimable: True when the footer shows a
        ``next_sequence`` other than ``tail``, ``due_ms()`` (wall ms; the caller's
        earliest lapse or delay end, from what it last read) has come, or a progress read
        satisfies ``claimable``; False at ``deadline`` (monotonic) or on :meth:`wake`."""
        now = time.monotonic()
        if self._footer_at is None:
            self._pause_footer(now)
            self._progress_at = now + self.progress_s
        while not self._stop.is_set():
            now = time.monotonic()
            assert self._footer_at is not None and self._progress_at is not None
            due = due_ms()
            due_at = None if due is None else now + max(0, due - self._clock_ms()) / 1000
            if due_at is not None and due_at <= now:
                return True
            if now >= self._progress_at:
                self._progress_at = now + self.progress_s
                self.progress_reads += 1
                if claimable(self._read_progress()):
                    return True
                continue  # its due times may have changed
            if now >= self._footer_at:
                self.footer_reads += 1
                moved = self._read_footer().next_sequence != tail
                self._pause_footer(time.monotonic())
                if moved:
                    return True
                continue
            if now >= deadline:
                return False
            wake_at = min(self._footer_at, self._progress_at, deadline)
            if due_at is not None:
                wake_at = min(wake_at, due_at)
            self._stop.wait(wake_at - now)
        return False

    def _pause_footer(self, now: float) -> None:
        self._backoff = min(self.max_s, max(self.first_s, 2 * self._backoff))
        self._footer_at = now + self._backoff
