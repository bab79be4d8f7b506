"""The stage's sealer threads: they seal on the timer (``max_open_duration``), on the
size trigger and when an append at a cap asks (stage/appender.py), and after a seal
failed on a disk error (``wal`` durability) they re-seal everything after the cursor
from the WAL.  docs/format-local.md, "Disk faults", says why.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

from tieredbuf.errors import DiskError
from tieredbuf.stage.filesystem import disk_error
from tieredbuf.stage.sealing import Sealer
from tieredbuf.stage.stage_recovery import Replayer
from tieredbuf.stage.stage_state import SealJob, StageState

log = logging.getLogger(__name__)

SEALERS = 2
"""Sealer threads: a segment can be written while the previous one is fdatasynced
(commits stay in sequence order)."""


class Upkeep:
    """The sealer threads (the module doc)."""

    def __init__(self, state: StageState, sealer: Sealer, replayer: Replayer) -> None:
        self.state = state
        self.sealer = sealer
        self.replayer = replayer
        self.threads = [
            threading.Thread(target=self._run, name=f"stage-sealer-{i}", daemon=True)
            for i in range(SEALERS)
        ]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def join(self) -> None:
        """After ``state.closed`` is set (and notified): wait for the threads to end."""
        for t in self.threads:
            t.join()

    def _run(self) -> None:
        """Timer-driven sealing: max_open_duration, size triggers, cap relief.  Runs on
        SEALERS threads, so one segment is written while the previous one syncs."""
        st = self.state
        sealer = self.sealer
        max_open = st.config.segment.max_open_duration.total_seconds()
        while True:
            with st.cond:
                due: list[str] = []
                jobs: list[SealJob] = []
                wait: float | None = None
                reseal = False
                while not st.closed and st.failed is None:
                    now = time.monotonic()
                    if st.seal_fault is not None:  # wait, then one thread re-seals
                        if not st.resealing and now >= st.reseal_at:
                            st.resealing = reseal = True
                            break
                        st.cond.wait(None if st.resealing else st.reseal_at - now)
                        continue
                    due = sorted(st.seal_requested)
                    for stream, acc in (("batch", st.records), ("qseg", st.bundles)):
                        if acc is None or stream in due:
                            continue
                        left = acc.opened_at + max_open - now
                        if left <= 0:
                            due.append(stream)
                        else:
                            wait = left if wait is None else min(wait, left)
                    # claim under the lock, so another sealer thread does not take the
                    # fresh (near-empty) accumulator for the same request
                    jobs = [j for k in due if (j := sealer.take(k)) is not None]
                    if jobs:
                        break
                    st.cond.wait(wait)
                    wait = None
                if not jobs and not reseal:
                    return
            if reseal:
                self.reseal()
                continue
            for i, job in enumerate(jobs):
                try:
                    sealer.run(job)
                except BaseException as e:
                    if isinstance(e, DiskError):
                        log.warning("sealing %s failed: %s", job.acc.stream, e)
                    else:
                        log.exception("sealing %s failed", job.acc.stream)
                    for rest in jobs[i + 1 :]:  # taken: their tickets must still pass
                        with contextlib.suppress(BaseException):
                            sealer.run(rest)
                    break

    def reseal(self) -> None:
        """After a seal failed on a disk error (``wal`` durability): once every seal
        taken before has committed or failed, drop the open segments and seal
        everything after the cursor again from the WAL -- what recovery does at open,
        skipping the sequences sealed segments hold.  Appends are refused meanwhile (so
        this is bounded); they resume when it succeeds, or it is tried again later."""
        st = self.state
        wal = st.wal
        assert wal is not None
        try:
            self.sealer.wait_committed()
            if st.uncertain:  # their renames are durable once this returns
                st.segments.sync()
                with st.lock:
                    for seg in st.uncertain:
                        st.add_sealed(seg)
                    st.uncertain.clear()
            with st.lock:
                st.records = st.bundles = None
                st.seal_requested.clear()
                st.entries.clear()
                covered = [r for seg in (*st.sealed.values(), *st.released) for r in seg.sequences]
            self.replayer.replay(wal, covered)
        except (DiskError, OSError) as e:
            err = e if isinstance(e, DiskError) else disk_error(e, "re-sealing", st.path)
            log.warning("re-sealing from the WAL failed (will retry): %s", err)
            with st.cond:
                st.replay_frontier = None
                st.seal_fault = err
                st.reseal_delay = min(2.0, max(0.05, 2 * st.reseal_delay))
                st.reseal_at = time.monotonic() + st.reseal_delay
        except BaseException as e:
            log.exception("re-sealing from the WAL failed")
            with st.cond:
                st.failed = e
        else:
            log.warning("stage sealing again after a disk error (%s)", st.seal_fault)
            with st.cond:
                st.seal_fault = None
                st.reseal_delay = 0.0
        finally:
            with st.cond:
                st.resealing = False
                st.cond.notify_all()
