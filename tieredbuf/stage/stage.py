"""The local tier facade: one producer's staging directory.

Layout of ``<staging_dir>/``::

    producer.id                 the default producer id (a ULID), stable across restarts
    <producer_id>/stage.lock    fcntl lock: one process per stage (StageLockedError)
    <producer_id>/sequence      sequence sidecar: next per-core sequence (Quiver #4024)
    <producer_id>/wal/          the WAL (stage/wal.py)
    <producer_id>/segments/     sealed segments + sidecars (stage/segments.py)

Quiver's truncation-safety rule decides the WAL cursor: it advances to the first
entry that is not yet in a *durable sealed* segment (never past the open segments).
So exporter lag never blocks WAL cleanup, and :meth:`Stage.release` only deletes the
file: the released entries are already behind the cursor, which makes a crash
mid-release harmless.  A crash after a segment is committed but before the cursor
moves is resolved on open by sequence (stage/stage_recovery.py).

:class:`Stage` builds its parts around one shared
:class:`~tieredbuf.stage.stage_state.StageState` and passes each what it needs: the
appender (stage/appender.py), the sealer (stage/sealing.py), release and quarantine
(stage/release.py), recovery (stage/stage_recovery.py) and the sealer threads
(stage/upkeep.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path

import pyarrow as pa

from tieredbuf import keys
from tieredbuf.config import StageConfig
from tieredbuf.errors import DiskError, StageError
from tieredbuf.stage import filesystem
from tieredbuf.stage.append_item import (
    PRODUCER_ID_RE,
    StageAck,
    bundle_item,
    default_producer_id,
    lock_stage,
    records_item,
)
from tieredbuf.stage.appender import Appender
from tieredbuf.stage.filesystem import FileSystem, disk_error
from tieredbuf.stage.malloc import keep_freed_heap
from tieredbuf.stage.release import Releaser
from tieredbuf.stage.sealed_segment import SealedSegment
from tieredbuf.stage.sealing import Sealer
from tieredbuf.stage.stage_recovery import Replayer
from tieredbuf.stage.stage_state import SequenceFile, StageState, StageStats
from tieredbuf.stage.upkeep import Upkeep
from tieredbuf.stage.wal import WalWriter

log = logging.getLogger(__name__)


class Stage:
    """Local staging for one producer (single process, thread-safe)."""

    def __init__(
        self,
        staging_dir: str | os.PathLike[str],
        producer_id: str | None = None,
        config: StageConfig | None = None,
        *,
        fs: FileSystem | None = None,
    ) -> None:
        self.config = config or StageConfig()
        if self.config.keep_freed_memory:
            keep_freed_heap()  # bodies of the next segment reuse the last one's pages
        fs = fs or filesystem.current()
        root = Path(staging_dir)
        fs.makedirs(root)
        self.producer_id = producer_id or default_producer_id(fs, root)
        if not PRODUCER_ID_RE.match(self.producer_id):
            raise StageError(f"producer_id must match [A-Za-z0-9_-]{{1,64}}: {self.producer_id!r}")
        self.path = root / self.producer_id
        fs.makedirs(self.path)
        lock_fd = lock_stage(fs, self.path / keys.STAGE_LOCK_NAME)
        st: StageState | None = None
        try:
            st = StageState(self.config, self.path, fs)
            sequence = SequenceFile(st)
            releaser = Releaser(st, sequence)
            sealer = Sealer(st, releaser)
            replayer = Replayer(st, sealer, releaser, sequence)
            replayer.recover()
        except BaseException as e:
            if st is not None and st.wal is not None:  # its flusher thread and files
                st.wal.close()
            with contextlib.suppress(OSError):
                fs.close(lock_fd)
            if isinstance(e, OSError):
                raise disk_error(e, "opening the stage", self.path) from e
            raise
        self._lock_fd: int | None = lock_fd
        self._state = st
        self.stats: StageStats = st.stats
        self._releaser = releaser
        self._sealer = sealer
        self._appender = Appender(st, sequence)
        self._upkeep = Upkeep(st, sealer, replayer)
        self._upkeep.start()

    # --- appends --------------------------------------------------------------------

    def append_records(
        self, records: Sequence[bytes], metadata: bytes = b"", timeout: float | None = None
    ) -> Future[StageAck]:
        """Stage one ``produce(entries, metadata)`` call.  The future completes at the
        LOCAL ack: after the WAL fdatasync (``wal``) or the segment seal (``segment_only``)."""
        item, n = records_item(
            records,
            metadata,
            self._state.wal is not None,
            self.config.segment.records_compression,
        )
        return self._appender.append(item, n, timeout)

    def append_bundle(
        self, bundle: Mapping[int, pa.RecordBatch], timeout: float | None = None
    ) -> Future[StageAck]:
        """Stage one Arrow bundle (slot id 0..63 -> RecordBatch)."""
        item, n = bundle_item(bundle, self._state.wal is not None)
        return self._appender.append(item, n, timeout)

    # --- sealing --------------------------------------------------------------------

    def seal_all(self) -> list[SealedSegment]:
        """Seal every open segment now (explicit finalize).  Raises the DiskError the
        stage is recovering from, if any (disk_fault())."""
        if self._state.seal_fault is not None:
            raise self._state.seal_fault
        return self._sealer.seal_all()

    def wait_committed(self) -> None:
        """Wait until every seal taken so far (by :meth:`seal_all` or a sealer thread)
        has committed or failed."""
        self._sealer.wait_committed()

    def sealed_segments(self) -> list[SealedSegment]:
        """Sealed segments not yet released, oldest first."""
        with self._state.lock:
            return list(self._state.sealed.values())

    # --- sealed segments: export, release, quarantine ---------------------------------

    def read_segment(self, segment: SealedSegment) -> bytes:
        """A sealed segment's bytes (for the exporter).  After :meth:`expect_reader`
        its pages are evicted from the page cache once read."""
        segments = self._state.segments
        return segments.read(segment, drop_cache=not segments.drop_cache_at_seal)

    def verify_segment(self, segment: SealedSegment) -> str | None:
        """What is wrong with a sealed segment's file (None: intact), checked over its
        pages in place; evicted afterwards as :meth:`read_segment` does."""
        segments = self._state.segments
        return segments.check(segment, drop_cache=not segments.drop_cache_at_seal)

    def expect_reader(self) -> None:
        """An exporter reads every sealed segment soon after its seal: keep a segment's
        pages cached until :meth:`read_segment` (evicted then) instead of evicting them
        at the seal (SegmentDir.drop_cache_at_seal)."""
        self._state.segments.drop_cache_at_seal = False

    def link_segment(self, segment: SealedSegment, dest: str | os.PathLike[str]) -> None:
        """Give a sealed segment's file a second name, ``dest`` (a hard link; the
        exporter's way into a local-directory store on the same file system: no byte
        copied).  The file is durable and read-only; from now on the stage never
        recycles it (SegmentDir.link).  OSError as ``os.link`` raises it."""
        with self._state.lock:
            if segment.ulid not in self._state.sealed:
                raise StageError(f"not a sealed segment of this stage: {segment.path.name}")
        self._state.segments.link(segment, Path(dest))

    def release(self, segment: SealedSegment) -> None:
        """The exporter has appended ``segment`` to the queue: delete it once the WAL
        cursor has passed its entries (Releaser.release says why not at once)."""
        self._releaser.release(segment)

    def quarantine(self, segment: SealedSegment, why: str) -> Path:
        """``segment`` failed its CRC check: set it aside (never exported) and forget it,
        as :meth:`release` does; returns where it went."""
        return self._releaser.quarantine(segment, why)

    def quarantined(self) -> list[SealedSegment]:
        """Corrupt segments set aside in this stage (at open or before upload) and still on
        disk: each is data loss an operator must look at."""
        return self._state.segments.quarantined()

    # --- state for metrics and readiness ----------------------------------------------

    @property
    def fs(self) -> FileSystem:
        """The file layer this stage does all its I/O through (stage/filesystem.py)."""
        return self._state.fs

    @property
    def wal(self) -> WalWriter | None:
        """The stage's WAL (None under ``segment_only``), for metrics: append through
        the stage, never to it directly."""
        return self._state.wal

    def wal_sync_stats(self) -> tuple[int, int]:
        """(group-commit fdatasyncs, nanoseconds spent in them) of the WAL (metrics)."""
        wal = self._state.wal
        return (0, 0) if wal is None else (wal.fsyncs, wal.fsync_ns)

    def wal_cursor(self) -> int | None:
        wal = self._state.wal
        return None if wal is None else wal.cursor

    def disk_bytes(self) -> int:
        with self._state.lock:
            return self._state.disk_bytes()

    @property
    def next_sequence(self) -> int:
        """The per-core sequence the next append gets: every lower one this stage has
        given out (across restarts; never reused)."""
        with self._state.lock:
            return self._state.next_seq

    def disk_fault(self) -> DiskError | None:
        """The disk error the stage is living with right now (appends refused or
        failing, a cursor or a delete not done), or None: what readiness reports."""
        st = self._state
        wal = st.wal
        with st.lock:
            faults = [
                st.seal_fault,
                wal.fault if wal is not None else None,
                *st.faults.values(),
            ]
        return next((f for f in faults if f is not None), None)

    # --- shutdown -------------------------------------------------------------------

    def close(self) -> None:
        """Seal open segments, sync and close the WAL, release the lock.  On a failing
        disk it still stops every thread, closes every file and releases the lock,
        then raises the DiskError: what could not be sealed stays in the WAL for the
        next open (or ``tieredbuf drain``)."""
        st = self._state
        with st.cond:
            if st.closed:
                return
        err: DiskError | None = None
        if st.failed is None:
            try:
                self.seal_all()
                self._releaser.advance_cursor()  # and delete the released segments it passes
            except DiskError as e:
                err = e
                log.warning("stage %s closed without sealing everything: %s", self.path, e)
        with st.cond:
            st.closed = True
            st.cond.notify_all()
        self._upkeep.join()
        if st.wal is not None:
            st.wal.close()
        with contextlib.suppress(OSError):
            st.segments.drop_spares()
        self._release_lock()
        if err is not None:
            raise err

    def __enter__(self) -> Stage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                self._state.fs.close(self._lock_fd)
            self._lock_fd = None
