"""The export tracker: a staged write's REMOTE outcome, whichever comes first -- its
LOCAL ack or the export of the segment holding it (:mod:`tieredbuf.produce.staged`)."""

from __future__ import annotations

import bisect
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from tieredbuf.errors import StagedDataLossError, TieredBufError
from tieredbuf.keys import STREAMS
from tieredbuf.produce.exporter import Exported


@dataclass(frozen=True, slots=True)
class Unconfirmed:
    sequences: tuple[tuple[int, int], ...]
    error: TieredBufError


class ExportTracker:
    """Maps per-core sequences to their REMOTE outcome, whichever arrives first.

    A LOCAL ack (the stage's future) and the export of the segment holding that
    sequence race: a segment can be sealed and exported before the WAL fsync that
    acks its entries returns.  Both sides meet here under one lock.

    While exports are stopped by a permanent store error (:meth:`fail`), every waiter
    is told so at once -- including ones that start waiting then -- but stays
    registered: its segment is still staged, and reaches REMOTE once exports work.
    """

    def __init__(self, remember: int = 1 << 20) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[
            tuple[str, int],
            tuple[Callable[[Exported], None], Callable[[BaseException], None] | None],
        ] = {}
        self._remember = remember
        self._recent: dict[str, list[Exported]] = {k: [] for k in STREAMS}
        """Each stream's exports, in export order (their sequences only grow): a wait on a
        sequence exported already finds its entry by bisection."""
        self._highest: dict[str, list[int]] = {k: [] for k in STREAMS}
        self._through: dict[str, int] = dict.fromkeys(STREAMS, -1)
        self._error: BaseException | None = None
        self._lost: dict[str, deque[Unconfirmed]] = {k: deque(maxlen=remember) for k in STREAMS}

    def exported(self, ex: Exported) -> None:
        fire: list[Callable[[Exported], None]] = []
        with self._lock:
            recent, highest = self._recent[ex.stream], self._highest[ex.stream]
            recent.append(ex)
            highest.append(ex.sequences[-1][1])
            if len(recent) > 2 * self._remember:
                del recent[: self._remember], highest[: self._remember]
            self._through[ex.stream] = max(self._through[ex.stream], ex.sequences[-1][1])
            for lo, hi in ex.sequences:
                if hi - lo + 1 <= len(self._waiting):
                    for s in range(lo, hi + 1):
                        pair = self._waiting.pop((ex.stream, s), None)
                        if pair is not None:
                            fire.append(pair[0])
                else:
                    for key in [k for k in self._waiting if k[0] == ex.stream and lo <= k[1] <= hi]:
                        fire.append(self._waiting.pop(key)[0])
        for fn in fire:
            fn(ex)

    def lost(self, stream: str, error: StagedDataLossError) -> None:
        """The segment holding ``error.sequences`` was quarantined: fail their waiters."""
        self.unconfirmed(stream, error.sequences, error)

    def unconfirmed(
        self, stream: str, sequences: tuple[tuple[int, int], ...], error: TieredBufError
    ) -> None:
        """The segment holding ``sequences`` will never be confirmed REMOTE (quarantined,
        or its append cannot be confirmed): fail their waiters, now and later."""
        with self._lock:
            self._lost[stream].append(Unconfirmed(sequences, error))
            hit = [
                k
                for k in self._waiting
                if k[0] == stream and any(lo <= k[1] <= hi for lo, hi in sequences)
            ]
            fns = [f for k in hit if (f := self._waiting.pop(k)[1]) is not None]
        for f in fns:
            f(error)

    def fail(self, error: BaseException | None) -> None:
        """Exports stopped on ``error`` (tell every waiter), or work again (None)."""
        with self._lock:
            self._error = error
            failed = [f for _, f in self._waiting.values() if f is not None] if error else []
        for f in failed:
            assert error is not None
            f(error)

    def exported_through(self, stream: str) -> int:
        """The highest sequence of ``stream`` exported so far (-1: none)."""
        return self._through[stream]

    def wait_for(
        self,
        stream: str,
        seq: int,
        cb: Callable[[Exported], None],
        on_fail: Callable[[BaseException], None] | None = None,
    ) -> None:
        """Call ``cb`` when ``seq`` is exported (at once if it already is); ``on_fail``
        when exports are stopped by a permanent store error (at once if they are)."""
        with self._lock:
            losts = self._lost[stream]  # almost always empty: no generator per call then
            lost = (
                next(
                    (u.error for u in losts if any(lo <= seq <= hi for lo, hi in u.sequences)), None
                )
                if losts
                else None
            )
            if lost is not None:
                error: BaseException | None = lost
            elif seq > self._through[stream]:
                self._waiting[(stream, seq)] = (cb, on_fail)
                error = self._error
                if error is None or on_fail is None:
                    return
            else:
                error = None
                i = bisect.bisect_left(self._highest[stream], seq)
                recent = self._recent[stream]
                hit = recent[i] if i < len(recent) else None
                if hit is not None and not any(lo <= seq <= hi for lo, hi in hit.sequences):
                    hit = None
                if hit is None:  # exported longer ago than this tracker remembers
                    error = TieredBufError(
                        f"the outcome of per-core sequence {seq} ({stream}) is no longer "
                        f"remembered (over {self._remember} segments ago): wait "
                        "on a handle sooner"
                    )
        if error is not None:
            if on_fail is not None:
                on_fail(error)
            return
        assert hit is not None
        cb(hit)
