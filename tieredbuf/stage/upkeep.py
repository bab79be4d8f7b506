"""The stage's upkeep: its caps (open-segment memory, disk: what an append at a cap
asks for), its sealer threads (timer, size and cap triggers), what a seal
that fails on a disk error does (re-seal from the WAL), and what becomes of a sealed
segment after export (release once the WAL cursor passes it) or when it is corrupt
(quarantine).  Stage (stage/stage.py) holds the state; docs/format-local.md, "Disk
faults" and "When the cursor moves", says why.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ulid import ULID

from tieredbuf.config import StageConfig
from tieredbuf.errors import DiskError, StageError
from tieredbuf.stage.accumulators import Accumulator, BundleAccumulator, RecordsAccumulator
from tieredbuf.stage.filesystem import disk_error
from tieredbuf.stage.sealed_segment import SealedSegment
from tieredbuf.stage.segments import CommitNotDurable, PreparedSegment, SegmentDir

if TYPE_CHECKING:
    from tieredbuf.stage.stage import StageStats
    from tieredbuf.stage.wal import WalWriter

log = logging.getLogger("tieredbuf.stage.stage")


@dataclass(slots=True)
class _SealJob:
    acc: Accumulator
    ticket: int
    ulid: ULID
    nbytes: int
    """The accumulator's size when taken (counted in _sealing_bytes, then _written_bytes)."""
    gen: int = 0
    """The stage's seal generation when taken (a seal fault makes it stale)."""
    written: bool = False


class StageUpkeep:
    """Stage's sealer threads, seal failures, release and quarantine (the module doc)."""

    if TYPE_CHECKING:
        config: StageConfig
        path: Path
        stats: StageStats
        _lock: threading.Lock
        _cond: threading.Condition
        _closed: bool
        _failed: BaseException | None
        _seal_fault: DiskError | None
        _seal_gen: int
        _reseal_delay: float
        _reseal_at: float
        _resealing: bool
        _uncertain: list[SealedSegment]
        _faults: dict[str, DiskError]
        _committed_tickets: int
        _seal_requested: set[str]
        _records: RecordsAccumulator | None
        _bundles: BundleAccumulator | None
        _entries: OrderedDict[int, list[int]]
        _sealed: OrderedDict[str, SealedSegment]
        _released: list[SealedSegment]
        _released_bytes: int
        _replay_frontier: int | None
        _segments: SegmentDir
        _wal: WalWriter | None
        _sealing_bytes: int
        _written_bytes: int
        _sealed_bytes: int

        def _take(self, kind: str) -> _SealJob | None: ...
        def _run_seal(self, job: _SealJob) -> SealedSegment: ...
        def _unaccount(self, job: _SealJob) -> None: ...
        def _wait_committed(self) -> None: ...
        def _replay(self, wal: WalWriter, covered: list[tuple[int, int]]) -> None: ...
        def _add_sealed(self, seg: SealedSegment) -> None: ...
        def _forget_sealed(self, seg: SealedSegment) -> bool: ...
        def _write_sequence(self, through: int | None = None) -> None: ...

    # --- the caps (I8): open-segment memory and stage disk -----------------------------

    def _over_cap(self, n: int) -> str | None:
        open_bytes = self._open_bytes() + self._sealing_bytes
        if open_bytes and open_bytes + n > self.config.segment.max_open_bytes:
            return "open-segment memory"
        # open and sealing segments are disk bytes about to be written, written ones
        # are on disk uncommitted (I8: the cap holds for the files on disk at every
        # moment, not just between seals)
        ahead = open_bytes + self._written_bytes + n
        segs = self._sealed_bytes + self._released_bytes + self._segments.spare_bytes()
        wal = self._wal
        if wal is not None and segs + wal.config.max_size + 4096 + ahead <= self.config.size_cap:
            return None  # the WAL keeps itself under max_size (+ a header): no need to ask
        if self._disk_bytes() + ahead > self.config.size_cap:
            return "disk"
        return None

    def _relieve(self, reason: str) -> None:
        """Under the lock, at a cap: ask for seals; with drop_oldest, drop sealed data."""
        want = {k for k, a in (("batch", self._records), ("qseg", self._bundles)) if a}
        if not want <= self._seal_requested:
            # notify only for a new request: producers waiting at the cap each call this,
            # and an unconditional notify_all woke the others into a ping-pong (33 k
            # wake-ups in a 1 s run at 64 KiB) that starved the sealer of the GIL
            self._seal_requested |= want
            self._cond.notify_all()
        if reason != "disk":
            return
        try:
            self._relieve_disk()
        except OSError as e:
            raise disk_error(e, "freeing stage disk space", self.path) from e

    def _relieve_disk(self) -> None:
        if self._segments.drop_spares() > 0:
            return
        if self._wal is not None and self._wal.reclaim() > 0:
            return
        if self.config.size_cap_policy == "drop_oldest" and self._sealed:
            seg = next(iter(self._sealed.values()))
            self._write_sequence(seg.last_sequence)
            self._forget_sealed(seg)
            self._segments.delete(seg)
            self.stats.dropped_segments += 1
            if seg.kind == "batch":
                self.stats.dropped_records += seg.record_count
            else:
                self.stats.dropped_bundles += seg.record_count
            log.warning("drop_oldest: deleted unexported segment %s (%d entries)",
                        seg.path.name, seg.entry_count)

    def _open_bytes(self) -> int:
        return sum(a.nbytes for a in (self._records, self._bundles) if a is not None)

    def _disk_bytes(self) -> int:
        return (self._sealed_bytes + self._released_bytes + self._segments.spare_bytes()
                + (self._wal.disk_bytes() if self._wal is not None else 0))

    # --- sealer threads and seal failures ---------------------------------------------

    def _seal_failed(self, job: _SealJob, e: BaseException,
                     prep: PreparedSegment | None) -> BaseException:
        """A seal failed: account for it, fail its appends (segment_only) and decide
        what the stage does (see the module doc); returns the error to raise."""
        acc = job.acc
        uncertain = e.segment if isinstance(e, CommitNotDurable) else None
        if isinstance(e, OSError):
            e = disk_error(e, "sealing a segment", self._segments.path)
        if uncertain is not None and self._wal is None:  # undo, best effort
            with contextlib.suppress(OSError):
                self._segments.fs.unlink(uncertain.sidecar_path, missing_ok=True)
                self._segments.fs.unlink(uncertain.path, missing_ok=True)
            uncertain = None
        with self._lock:
            if uncertain is not None:  # in place, names maybe not durable: _reseal
                self._uncertain.append(uncertain)
            if not isinstance(e, DiskError):
                if self._failed is None and job.gen == self._seal_gen:
                    self._failed = e
            elif self._wal is not None:
                # its entries are durable in the WAL: refuse appends until a sealer
                # has sealed everything after the cursor again (_reseal)
                self._seal_fault = e
                self._seal_gen += 1
                self._reseal_delay = min(2.0, max(0.05, 2 * self._reseal_delay))
                self._reseal_at = time.monotonic() + self._reseal_delay
            else:
                self._faults["seal"] = e  # segment_only: those appends fail (below)
            self._unaccount(job)
            self._committed_tickets += 1
            self._cond.notify_all()
        if prep is not None:  # best effort; recovery deletes .tmp files anyway
            with contextlib.suppress(OSError):
                self._segments.discard(prep)
        for f, _ in acc.futures:
            f.set_exception(e if isinstance(e, DiskError)
                            else StageError(f"sealing failed: {e}"))
        return e

    def _maintain(self) -> None:
        """Timer-driven sealing: max_open_duration, size triggers, cap relief.  Runs on
        SEALERS threads, so one segment is written while the previous one syncs."""
        max_open = self.config.segment.max_open_duration.total_seconds()
        while True:
            with self._cond:
                due: list[str] = []
                jobs: list[_SealJob] = []
                wait: float | None = None
                reseal = False
                while not self._closed and self._failed is None:
                    now = time.monotonic()
                    if self._seal_fault is not None:  # wait, then one thread re-seals
                        if not self._resealing and now >= self._reseal_at:
                            self._resealing = reseal = True
                            break
                        self._cond.wait(None if self._resealing else self._reseal_at - now)
                        continue
                    due = sorted(self._seal_requested)
                    for kind, acc in (("batch", self._records), ("qseg", self._bundles)):
                        if acc is None or kind in due:
                            continue
                        left = acc.opened_at + max_open - now
                        if left <= 0:
                            due.append(kind)
                        else:
                            wait = left if wait is None else min(wait, left)
                    # claim under the lock, so another sealer thread does not take the
                    # fresh (near-empty) accumulator for the same request
                    jobs = [j for k in due if (j := self._take(k)) is not None]
                    if jobs:
                        break
                    self._cond.wait(wait)
                    wait = None
                if not jobs and not reseal:
                    return
            if reseal:
                self._reseal()
                continue
            for i, job in enumerate(jobs):
                try:
                    self._run_seal(job)
                except BaseException as e:
                    if isinstance(e, DiskError):
                        log.warning("sealing %s failed: %s", job.acc.kind, e)
                    else:
                        log.exception("sealing %s failed", job.acc.kind)
                    for rest in jobs[i + 1:]:  # taken: their tickets must still pass
                        with contextlib.suppress(BaseException):
                            self._run_seal(rest)
                    break

    def _reseal(self) -> None:
        """After a seal failed on a disk error (``wal`` durability): once every seal
        taken before has committed or failed, drop the open segments and seal
        everything after the cursor again from the WAL -- what recovery does at open,
        skipping the sequences sealed segments hold.  Appends are refused meanwhile (so
        this is bounded); they resume when it succeeds, or it is tried again later."""
        wal = self._wal
        assert wal is not None
        try:
            self._wait_committed()
            if self._uncertain:  # their renames are durable once this returns
                self._segments.sync()
                with self._lock:
                    for seg in self._uncertain:
                        self._add_sealed(seg)
                    self._uncertain.clear()
            with self._lock:
                self._records = self._bundles = None
                self._seal_requested.clear()
                self._entries.clear()
                covered = [r for seg in (*self._sealed.values(), *self._released)
                           for r in seg.sequences]
            self._replay(wal, covered)
        except (DiskError, OSError) as e:
            err = e if isinstance(e, DiskError) else disk_error(e, "re-sealing", self.path)
            log.warning("re-sealing from the WAL failed (will retry): %s", err)
            with self._cond:
                self._replay_frontier = None
                self._seal_fault = err
                self._reseal_delay = min(2.0, max(0.05, 2 * self._reseal_delay))
                self._reseal_at = time.monotonic() + self._reseal_delay
        except BaseException as e:
            log.exception("re-sealing from the WAL failed")
            with self._cond:
                self._failed = e
        else:
            log.warning("stage sealing again after a disk error (%s)", self._seal_fault)
            with self._cond:
                self._seal_fault = None
                self._reseal_delay = 0.0
        finally:
            with self._cond:
                self._resealing = False
                self._cond.notify_all()

    def disk_fault(self) -> DiskError | None:
        """The disk error the stage is living with right now (appends refused or
        failing, a cursor or a delete not done), or None: what readiness reports."""
        wal = self._wal
        with self._lock:
            faults = [self._seal_fault, wal.fault if wal is not None else None,
                      *self._faults.values()]
        return next((f for f in faults if f is not None), None)

    # --- after export: release, quarantine ----------------------------------------------

    def release(self, segment: SealedSegment) -> None:
        """The exporter has appended ``segment`` to the queue: delete it -- at once if
        the WAL cursor has passed its entries, else once it has.

        Until the cursor passes a segment's entries its sidecar is what keeps them from
        being replayed after a crash: replayed, they could be sealed together with later
        entries into a segment whose append number the manifest's watermark does not
        cover, i.e. exported twice (I2).  The cursor stops at the first entry not yet in
        a sealed segment -- e.g. one in the other kind's open segment -- and moves only
        after a seal's commit, so an exporter can get there first.  A segment kept that
        way is exported again after a crash, and the watermark recognises it."""
        with self._lock:
            if not self._forget_sealed(segment):
                raise StageError(f"not a sealed segment of this stage: {segment.path.name}")
            wal = self._wal
            if wal is not None and segment.wal_end is not None and wal.cursor < segment.wal_end:
                self._released.append(segment)
                self._released_bytes += segment.size
                return
        self._delete_released(segment)

    def _delete_released(self, segment: SealedSegment) -> None:
        """Delete an exported segment; on a disk error keep it (it is in the queue: a
        re-export after a crash is recognised) and try again after the next seal."""
        try:
            self._write_sequence(segment.last_sequence)
            self._segments.delete(segment)
        except OSError as e:
            err = disk_error(e, "deleting an exported segment", segment.path)
            log.warning("%s; kept for now", err)
            with self._cond:
                self._faults["release"] = err
                if all(s.ulid != segment.ulid for s in self._released):
                    self._released.insert(0, segment)
                    self._released_bytes += segment.size
            return
        with self._cond:
            self._faults.pop("release", None)
            self._cond.notify_all()

    def quarantine(self, segment: SealedSegment, why: str) -> Path:
        """``segment`` failed its CRC check: set it aside (never exported) and forget it,
        as :meth:`release` does; returns where it went."""
        with self._lock:
            if not self._forget_sealed(segment):
                raise StageError(f"not a sealed segment of this stage: {segment.path.name}")
        self._write_sequence(segment.last_sequence)
        dest = self._segments.quarantine(segment, why)
        self.stats.segments_quarantined += 1
        with self._cond:
            self._cond.notify_all()
        return dest

    def quarantined(self) -> list[SealedSegment]:
        """Corrupt segments set aside in this stage (at open or before upload) and still on
        disk: each is data loss an operator must look at."""
        return self._segments.quarantined()

    def _delete_passed(self) -> None:
        """Delete the released segments whose entries the (durable) cursor has passed."""
        wal = self._wal
        if wal is None:
            return
        with self._lock:
            if not self._released:
                return
            cursor = wal.cursor
            due = [s for s in self._released if s.wal_end is not None and s.wal_end <= cursor]
            if not due:
                return
            self._released = [s for s in self._released if s not in due]
            self._released_bytes -= sum(s.size for s in due)
        for seg in due:
            self._delete_released(seg)
