"""What the stage's parts share: :class:`StageState`, one object with public fields
that the appender (stage/appender.py), the sealer (stage/sealing.py), the sealer
threads (stage/upkeep.py), release and quarantine (stage/release.py) and recovery
(stage/stage_recovery.py) each hold a reference to; and the sequence sidecar
(:class:`SequenceFile`), which persists its ``next_seq``.

Fields are read and written under ``lock`` (``cond`` is a Condition over it) unless
their note says otherwise.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from ulid import ULID

from tieredbuf import keys
from tieredbuf.config import StageConfig
from tieredbuf.errors import ClosedError, DiskError, StageError
from tieredbuf.format import cursor as cursor_fmt
from tieredbuf.stage.accumulators import Accumulator, BundleAccumulator, RecordsAccumulator
from tieredbuf.stage.filesystem import FileSystem, IoGate
from tieredbuf.stage.sealed_segment import SealedSegment
from tieredbuf.stage.segments import SegmentDir
from tieredbuf.stage.wal import WalWriter

SEQUENCE_NAME = "sequence"
"""The sequence sidecar, ``<stage>/sequence``: the next per-core sequence."""


@dataclass(slots=True)
class StageStats:
    dropped_segments: int = 0
    dropped_records: int = 0
    dropped_bundles: int = 0
    backpressure_waits: int = 0
    replayed_entries: int = 0
    records_in: int = 0
    bundles_in: int = 0
    bytes_in: int = 0
    """Bytes accepted into the stage (the same estimate the caps use)."""
    segments_sealed: int = 0
    segments_quarantined: int = 0
    """Sealed segments found corrupt (CRC) and set aside: their records are lost unless
    the WAL still held them (docs/failure-modes.md)."""


@dataclass(slots=True)
class SealJob:
    """An open segment taken for sealing (stage/sealing.py)."""

    acc: Accumulator
    ticket: int
    """Its place in the commit order (sequence order)."""
    ulid: ULID
    nbytes: int
    """The accumulator's size when taken (counted in sealing_bytes, then written_bytes)."""
    gen: int = 0
    """The stage's seal generation when taken (a seal fault makes it stale)."""
    written: bool = False


class StageState:
    """One stage's open segments, sealed and released segments, WAL entries after the
    cursor, seal bookkeeping and faults (the module doc)."""

    __slots__ = (
        "bundles",
        "closed",
        "committed_tickets",
        "cond",
        "config",
        "entries",
        "failed",
        "faults",
        "fs",
        "gate",
        "lock",
        "next_seq",
        "path",
        "records",
        "released",
        "released_bytes",
        "replay_frontier",
        "reseal_at",
        "reseal_delay",
        "resealing",
        "seal_fault",
        "seal_gen",
        "seal_requested",
        "seal_tickets",
        "sealed",
        "sealed_bytes",
        "sealing_bytes",
        "segments",
        "stats",
        "uncertain",
        "wal",
        "written_bytes",
    )

    def __init__(self, config: StageConfig, path: Path, fs: FileSystem) -> None:
        self.config = config
        self.path = path
        """``<staging_dir>/<producer_id>``."""
        self.fs = fs
        """Every file operation goes through this (stage/filesystem.py)."""
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.stats = StageStats()
        self.gate = IoGate()
        self.segments = SegmentDir(
            path / keys.SEGMENTS_DIR_NAME, config.segment.records_compression, self.gate, fs
        )
        self.wal: WalWriter | None = None
        """Set at open (``wal`` durability, or a WAL left by a ``wal`` run to replay)."""
        self.next_seq = 0
        """The next per-core sequence.  Only grows: read without the lock it is a lower
        bound (SequenceFile)."""
        self.seal_tickets = 0
        """Seals taken so far: each gets the next ticket, in sequence order."""
        self.committed_tickets = 0
        """Seals committed (or failed) so far: ticket N commits only after N - 1."""
        self.replay_frontier: int | None = None
        """While replaying: the end of the last entry read (the cursor stops there)."""
        self.closed = False
        self.failed: BaseException | None = None
        """A seal failed for a reason that is not the disk (a bug): the stage stops."""
        self.seal_fault: DiskError | None = None
        """wal durability: a seal failed on a disk error.  Appends are refused with it
        (typed) until a sealer re-seals everything after the cursor from the WAL."""
        self.seal_gen = 0
        """Bumped at each seal fault: seals taken before it must not commit."""
        self.reseal_delay = 0.0
        self.reseal_at = 0.0
        self.resealing = False
        self.uncertain: list[SealedSegment] = []
        """Segments whose commit's directory fsync failed (wal durability): in place,
        taken as sealed once a later directory fsync returns (Upkeep.reseal)."""
        self.faults: dict[str, DiskError] = {}
        """The last disk error of a cursor update ("cursor"), a release ("release") or a
        segment_only seal ("seal"), each cleared by its next success (disk_fault())."""
        self.records: RecordsAccumulator | None = None
        """The open records segment."""
        self.bundles: BundleAccumulator | None = None
        """The open bundle segment."""
        self.sealing_bytes = 0
        """Accumulators taken for sealing whose bytes are not written yet (memory)."""
        self.written_bytes = 0
        """Seals written to their temp files, buffers dropped, not committed yet: disk
        bytes for the size cap, no longer memory for max_open_bytes."""
        self.seal_requested: set[str] = set()
        """Kinds an append or a cap asked the sealer threads to seal."""
        self.entries: OrderedDict[int, list[int]] = OrderedDict()
        """WAL entries after the cursor, in order: sequence -> [start, end, sealed]."""
        self.sealed: OrderedDict[str, SealedSegment] = OrderedDict()
        """Sealed segments not yet released, oldest first, by ULID."""
        self.sealed_bytes = 0
        self.released: list[SealedSegment] = []
        """Exported segments kept until the cursor passes their entries (release())."""
        self.released_bytes = 0

    def check_usable(self) -> None:
        """Raise what an append meets on a closed, failed or seal-faulted stage."""
        if self.closed:
            raise ClosedError("stage is closed")
        if self.failed is not None:
            raise StageError(f"stage failed: {self.failed}")
        if self.seal_fault is not None:
            raise self.seal_fault

    def records_acc(self) -> RecordsAccumulator:
        """The open records segment (opened now if there is none)."""
        if self.records is None:
            self.records = RecordsAccumulator()
            self.cond.notify_all()  # start its max_open_duration timer
        return self.records

    def bundles_acc(self) -> BundleAccumulator:
        """The open bundle segment (opened now if there is none)."""
        if self.bundles is None:
            self.bundles = BundleAccumulator()
            self.cond.notify_all()
        return self.bundles

    def open_bytes(self) -> int:
        return sum(a.nbytes for a in (self.records, self.bundles) if a is not None)

    def disk_bytes(self) -> int:
        """Sealed, released and spare segment files plus the WAL."""
        return (
            self.sealed_bytes
            + self.released_bytes
            + self.segments.spare_bytes()
            + (self.wal.disk_bytes() if self.wal is not None else 0)
        )

    def add_sealed(self, seg: SealedSegment) -> None:
        self.sealed[seg.ulid] = seg
        self.sealed_bytes += seg.size

    def forget_sealed(self, seg: SealedSegment) -> bool:
        """False if ``seg`` is not (or no longer) one of the sealed segments."""
        if self.sealed.pop(seg.ulid, None) is None:
            return False
        self.sealed_bytes -= seg.size
        return True

    def unaccount(self, job: SealJob) -> None:
        """The seal ``job`` committed or failed: its bytes stop counting."""
        if job.written:
            self.written_bytes -= job.nbytes
        else:
            self.sealing_bytes -= job.nbytes


class SequenceFile:
    """The sequence sidecar: persists ``state.next_seq`` before anything carrying
    sequences is deleted (a released or dropped segment's sidecar; purged WAL entries
    are all in sealed segments whose sidecars still exist).

    release() and a producer at the drop_oldest cap write it from different threads:
    one lock keeps their temp files apart and makes the persisted value only grow
    (Quiver #4024).  It does not take the stage lock (the drop_oldest path holds it);
    ``next_seq`` only grows, so a racy read is a valid lower bound.
    """

    def __init__(self, state: StageState) -> None:
        self.state = state
        self.path = state.path / SEQUENCE_NAME
        self._lock = threading.Lock()
        self._persisted = 0
        """The value last written (under _lock)."""

    def write(self, through: int | None = None) -> None:
        """Persist the next sequence.  ``through``: skip the write if the persisted
        value already exceeds it (most releases: it was written ahead)."""
        with self._lock:
            if through is not None and self._persisted > through:
                return
            nxt = self.state.next_seq
            self.state.fs.write_atomic(self.path, [cursor_fmt.encode_sequence(nxt)])
            self._persisted = max(self._persisted, nxt)
