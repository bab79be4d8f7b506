"""WAL group commit: sync rounds, the flusher thread, waiting for durability.

A sync round fdatasyncs the active file up to what was written when it began (or
commits a pending rotation: stage/wal_rotation.py) and then resolves the appends it
covered.  With ``flush_interval > 0`` a flusher thread runs rounds at most once per
interval while appends are pending; with ``flush_interval == 0`` appenders run them
(:meth:`WalSync.wait_durable`), and concurrent appenders share one round
(leader/follower).  A failed round breaks the WAL and repairs it
(stage/wal_repair.py).
"""

from __future__ import annotations

import functools
import threading
import time
from contextlib import nullcontext

from tieredbuf.stage.wal_recovery import ACTIVE_NAME
from tieredbuf.stage.wal_repair import WalRepair
from tieredbuf.stage.wal_rotation import WalRotation
from tieredbuf.stage.wal_state import WalState, resolve


class WalSync:
    """The WAL's sync rounds and flusher thread (the module doc)."""

    def __init__(
        self, state: WalState, rotation: WalRotation, repair: WalRepair, interval: float
    ) -> None:
        self.state = state
        self.rotation = rotation
        self.repair = repair
        self.interval = interval
        """``flush_interval`` in seconds; 0: appenders sync themselves."""
        self.round_lock = threading.Lock()
        """Serialises sync rounds (the flusher's and explicit ones)."""
        self.syncing = False
        """An appender is running a round (``flush_interval == 0``; under the lock)."""
        self.last_sync = 0.0
        self.fsyncs = 0
        """Group-commit fdatasyncs done (metrics; updated under ``round_lock``)."""
        self.fsync_ns = 0
        """Nanoseconds spent in them."""
        self.stop = threading.Event()
        """Set at close: cuts the flusher's group-commit window short."""
        self.flusher: threading.Thread | None = None

    def start_flusher(self, name: str) -> None:
        """With ``flush_interval > 0``: start the flusher thread."""
        if self.interval > 0:
            self.flusher = threading.Thread(target=self._flush_loop, name=name, daemon=True)
            self.flusher.start()

    def stop_flusher(self) -> None:
        """After ``closing`` is set (and notified): let the flusher finish and join it."""
        self.stop.set()
        if self.flusher is not None:
            self.flusher.join()

    def round(self) -> None:
        """One group commit: make every byte written so far durable (and commit a
        pending rotation), then resolve the appends it covered."""
        st = self.state
        with self.round_lock:
            with st.lock:
                if st.broken is not None:
                    return  # nothing to sync until a repair (an append) succeeds
                rot, st.rotation = st.rotation, None
                st.rotating = rot is not None
                f, target, epoch = st.active, st.written, st.epoch
                if rot is None and target <= st.durable:
                    return
            try:
                t0 = time.perf_counter_ns()
                with st.gate.wal_round() if st.gate is not None else nullcontext():
                    if rot is not None:
                        # every byte up to ``target`` is in the old file or the new one;
                        # the old file's entries are acked as soon as it is synced (a
                        # rotation round makes three syncs: measured 150-190 ms against
                        # 60-80 for a plain round at 64 KiB records)
                        self.rotation.commit(
                            rot, functools.partial(self._acked_to, rot.span.start, epoch)
                        )
                    else:
                        with f.sync_lock:
                            if not f.closed:  # a rotation already synced a closed file
                                st.fs.fdatasync(f.fd)
                self.fsync_ns += time.perf_counter_ns() - t0
                self.fsyncs += 1
            except OSError as e:
                with st.lock:
                    if rot is not None and st.epoch == epoch:
                        st.rotation, st.rotating = rot, False
                self.repair.fail(e, epoch)
                return
            with st.lock:
                if st.epoch != epoch:  # broken meanwhile: the repair acks these
                    return
                if rot is not None:
                    rot.span.path = st.dir / ACTIVE_NAME
                    st.rotating = False
                st.durable = max(st.durable, target)
                self.last_sync = time.monotonic()
                done = st.pop_durable()
        resolve(done)

    def _acked_to(self, position: int, epoch: int) -> None:
        """Every byte before ``position`` is durable: resolve those appends."""
        st = self.state
        with st.lock:
            if st.epoch != epoch:
                return
            st.durable = max(st.durable, position)
            done = st.pop_durable()
        resolve(done)

    def wait_durable(self, end: int) -> None:
        """Run sync rounds (or join one in progress) until ``end`` is durable; raises
        the WAL's DiskError while it is broken."""
        st = self.state
        while True:
            with st.cond:
                if st.durable >= end:
                    return
                if st.broken is not None:
                    raise st.broken
                if self.syncing:
                    st.cond.wait()
                    continue
                self.syncing = True
            try:
                self.round()
            finally:
                with st.cond:
                    self.syncing = False
                    st.cond.notify_all()

    def _flush_loop(self) -> None:
        st = self.state
        stop = self.stop
        while True:
            with st.cond:
                while not st.closing and (st.broken is not None or st.durable >= st.written):
                    st.cond.wait()
                if st.closing and (st.broken is not None or st.durable >= st.written):
                    return
                delay = self.last_sync + self.interval - time.monotonic()
                closing = st.closing
            if delay > 0 and not closing:
                stop.wait(delay)  # the group-commit window (close() cuts it short)
            self.round()
