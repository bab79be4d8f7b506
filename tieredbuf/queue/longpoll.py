"""A long poll on the queue's 22-byte root footer: wait for new entries at little cost.

A reader that found nothing new (a consumer's ``next_batch``, a subscriber, a worker's
claim) waits here instead of re-reading the whole root.  :class:`FooterPoll` reads only
the root's footer (one ranged GET of 22 bytes: the queue's ``next_sequence`` and
``epoch``), and between reads it pauses with a backoff: 0.1 s after the reader went
idle, doubling to 2 s (a consumer's cap is its ``idle_poll_max``, 2.5 s).  An idle
reader thus reads at 0.1, 0.3, 0.7, 1.5, 3.1 s, then one small GET every 2 s (0.5
requests/s), and notices new entries within the current pause; a busy one never waits.

The backoff lives in the poll object, across calls: a reader that calls
``wait(..., timeout=1)`` in a loop keeps backing off rather than starting again at
0.1 s each call.  :meth:`FooterPoll.reset` (or a footer that shows a change) ends the
idle period.  The poll says only *that* something changed; the reader then reads the
root in full (entries, fencing) as it would anyway.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from tieredbuf.format import manifest as fm

IDLE_BACKOFF_S = 0.1
"""The first pause after the reader went idle."""
IDLE_BACKOFF_MAX_S = 2.0
"""The longest pause: an idle reader sends at most one footer GET per this long."""


class FooterPoll:
    """Waits until the root's footer shows new entries or a new epoch.

    ``read_footer`` is :meth:`tieredbuf.queue.manifest_queue.ManifestQueue.read_footer`
    (or anything returning a :class:`tieredbuf.format.manifest.Footer`).  Not
    thread-safe: one per reader.
    """

    def __init__(
        self,
        read_footer: Callable[[], fm.Footer],
        *,
        first_s: float = IDLE_BACKOFF_S,
        max_s: float = IDLE_BACKOFF_MAX_S,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], object] | None = None,
    ) -> None:
        if not 0 < first_s <= max_s:
            raise ValueError(f"backoff must satisfy 0 < first_s <= max_s, got {first_s}, {max_s}")
        self._read_footer = read_footer
        self.first_s, self.max_s = first_s, max_s
        self._clock = clock
        self._stop = threading.Event()
        self._sleep = sleep if sleep is not None else self._stop.wait
        self._backoff = 0.0
        self._next_read: float | None = None
        self.footer_reads = 0

    @property
    def idle(self) -> bool:
        """True between a wait that found nothing and the next change or reset."""
        return self._next_read is not None

    def reset(self) -> None:
        """The reader found something: the next idle period starts at ``first_s`` again."""
        self._backoff = 0.0
        self._next_read = None

    def wake(self) -> None:
        """End a wait early (e.g. the reader is closing); the wait returns None."""
        self._stop.set()

    def wait(
        self, next_sequence: int, timeout: float, *, epoch: int | None = None
    ) -> fm.Footer | None:
        """The footer once it shows ``next_sequence`` moved (or an epoch other than
        ``epoch``); None when ``timeout`` seconds pass without that, or on :meth:`wake`.

        The first footer read of an idle period comes ``first_s`` after it began (the
        reader has just read the root and found nothing); later ones follow the backoff.
        """
        deadline = self._clock() + max(0.0, timeout)
        if self._next_read is None:
            self._pause(self._clock())
        while not self._stop.is_set():
            now = self._clock()
            assert self._next_read is not None
            if now >= self._next_read:
                footer = self._read_footer()
                self.footer_reads += 1
                if footer.next_sequence != next_sequence or (
                    epoch is not None and footer.epoch != epoch
                ):
                    self.reset()
                    return footer
                self._pause(self._clock())
                continue
            if now >= deadline:
                return None
            self._sleep(min(self._next_read, deadline) - now)
        return None

    def _pause(self, now: float) -> None:
        self._backoff = min(self.max_s, max(self.first_s, 2 * self._backoff))
        self._next_read = now + self._backoff
