"""Prompt seals: a write someone waits on for REMOTE does not sit out max_open_duration.

A staged producer seals an open segment when it reaches ``target_size`` or is
``max_open_duration`` old (5 s: Quiver's default, chosen for throughput).  A caller
waiting for REMOTE (``handle.wait(Durability.REMOTE)``, ``watcher.when(REMOTE, ...)``,
the service's ``durability=remote``) would wait those 5 s.  So the first such wait on
a write asks this sealer for a seal, and it:

* waits ``COALESCE_S`` (a few ms) for other waiters to join the same seal;
* waits for the buffer's next commit, less the time a seal and an upload take
  (there is no point sealing earlier: the commit could not take it sooner -- this
  also rate-limits early seals to the buffer's commit rate,
  :mod:`tieredbuf.produce.fanin`);
* skips the early seal while the open segments fill fast enough to reach
  ``target_size`` within ``HORIZON_S`` (1 s) -- under load segments keep their full
  size and a waiter gets the size-triggered seal instead -- looking again every
  ``RECHECK_S`` in case the load drops;
* seals (``Stage.seal_all``: every open segment, durably) and wakes the exporter.

Every write appended before a seal starts is in that seal, so one seal serves every
waiter that asked before it started; later waiters ask for the next one.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from tieredbuf.runtime import forks
from tieredbuf.runtime.stats import ewma

if TYPE_CHECKING:
    from tieredbuf.produce.exporter import Exporter
    from tieredbuf.stage.stage import Stage

log = logging.getLogger(__name__)

COALESCE_S = 0.005
"""How long a seal waits for more REMOTE waiters to join it."""
HORIZON_S = 1.0
"""No early seal while the open segment would reach target_size within this long."""
RECHECK_S = 0.05
"""How often a skipped early seal is reconsidered."""


class PromptSealer:
    """One thread per staged producer; idle (no timer, no request) without waiters."""

    def __init__(self, stage: Stage, exporter: Exporter) -> None:
        self.stage = stage
        self.exporter = exporter
        self._cond = threading.Condition()
        self._asked_at: float | None = None
        """When the oldest waiter not yet covered by a seal asked (None: nobody)."""
        self._stop = False
        self._seal_s = 0.0
        """Recent seal time (EWMA): how long before the append slot to start one."""
        self._mark = (stage.stats.segments_sealed, stage.stats.bytes_in, time.monotonic())
        """(seals, bytes in, when) at the last seal seen: what the open segment holds."""
        self.seals = 0
        """Early seals made for REMOTE waiters (a counter for tests and metrics)."""
        self._guard = forks.ForkGuard("prompt sealer")
        self._thread = threading.Thread(target=self._run, name="tb-prompt-seal", daemon=True)
        self._thread.start()

    def request(self) -> None:
        """A caller started waiting for REMOTE on a write already appended."""
        with self._cond:
            if self._asked_at is None:
                self._asked_at = time.monotonic()
                self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if not self._guard.forked:
            self._thread.join()

    # --- the thread ------------------------------------------------------------------

    def _fills_soon(self, now: float) -> bool:
        """True when the open segment would reach target_size within HORIZON_S at the rate
        bytes arrived since the last seal (approximate: from the stage's counters)."""
        stats = self.stage.stats
        seals, since_bytes, since = self._mark
        if stats.segments_sealed != seals:  # a seal happened: start measuring again
            self._mark = (stats.segments_sealed, stats.bytes_in, now)
            return False
        held = stats.bytes_in - since_bytes
        if now - since <= 0:
            return False
        rate = held / (now - since)
        return held + rate * HORIZON_S >= self.stage.config.segment.target_size

    def _due(self, asked_at: float) -> float:
        """When to start the seal: after the coalescing delay, and not before the
        exporter's next append slot less a seal and an upload."""
        now = time.monotonic()
        # the next commit takes every segment handed to the fan-in hub by then: one still
        # waiting for it does not take the slot (it did when each commit took one writer's)
        slot = now + self.exporter.next_append_in() - self._seal_s - self.exporter.upload_s
        return max(asked_at + COALESCE_S, slot)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop and self._asked_at is None:
                    self._cond.wait()
                if self._stop:
                    return
                asked_at = self._asked_at
                assert asked_at is not None
                wait = self._due(asked_at) - time.monotonic()
                if wait > 0:
                    self._cond.wait(min(wait, RECHECK_S))
                    continue  # look again (the slot or the request may have moved)
                now = time.monotonic()
                if self._fills_soon(now) and now - asked_at < HORIZON_S:
                    self._cond.wait(RECHECK_S)
                    continue
                self._asked_at = None  # every write so far goes into this seal
            started = time.monotonic()
            try:
                sealed = self.stage.seal_all()
            except Exception as e:  # the stage reports it to writers; waiters time out
                log.warning("prompt seal failed: %s", e)
                continue
            took = time.monotonic() - started
            self._seal_s = ewma(self._seal_s, took)
            self.seals += bool(sealed)
            self.exporter.wake()
