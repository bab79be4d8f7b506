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
moves is resolved on open by sequence: WAL entries whose sequence a sealed segment's
sidecar covers are not replayed (no duplicates); every other entry is (no loss).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from tieredbuf import keys
from tieredbuf.config import StageConfig
from tieredbuf.errors import (
    BackpressureError,
    ClosedError,
    CorruptError,
    DiskError,
    StageError,
    WalFullError,
)
from tieredbuf.format import cursor as cursor_fmt
from tieredbuf.format import wal as wal_fmt
from tieredbuf.stage import filesystem
from tieredbuf.stage.accumulators import Accumulator, BundleAccumulator, RecordsAccumulator
from tieredbuf.stage.append_item import (
    PRODUCER_ID_RE,
    BundleOrRecords,
    StageAck,
    bundle_item,
    default_producer_id,
    lock_stage,
    records_item,
)
from tieredbuf.stage.filesystem import FileSystem, IoGate, disk_error
from tieredbuf.stage.malloc import keep_freed_heap
from tieredbuf.stage.sealed_segment import SealedSegment
from tieredbuf.stage.segments import PreparedSegment, SegmentDir
from tieredbuf.stage.upkeep import StageUpkeep, _SealJob
from tieredbuf.stage.wal import WalWriter

log = logging.getLogger(__name__)

SEQUENCE_NAME = "sequence"
SEALERS = 2
"""Sealer threads: a segment can be written while the previous one is fdatasynced
(commits stay in sequence order)."""
LAYOUT_CONTRACT = (
    b"tieredbuf.stage/1;slots=0..63;payload_type_id=slot;"
    b"schema_fingerprint=sha256(arrow ipc schema);entry 2=records"
)
"""What a WAL's segment_cfg_hash digests: how this build interprets bundle payloads."""


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


class Stage(StageUpkeep):
    """Local staging for one producer (single process, thread-safe)."""

    def __init__(
        self, staging_dir: str | os.PathLike[str], producer_id: str | None = None,
        config: StageConfig | None = None, *, fs: FileSystem | None = None,
    ) -> None:
        self.config = config or StageConfig()
        if self.config.keep_freed_memory:
            keep_freed_heap()  # bodies of the next segment reuse the last one's pages
        self._fs = fs = fs or filesystem.current()
        """Every file operation goes through this (stage/filesystem.py)."""
        root = Path(staging_dir)
        fs.makedirs(root)
        self.producer_id = producer_id or default_producer_id(fs, root)
        if not PRODUCER_ID_RE.match(self.producer_id):
            raise StageError(f"producer_id must match [A-Za-z0-9_-]{{1,64}}: {self.producer_id!r}")
        self.path = root / self.producer_id
        fs.makedirs(self.path)
        self._lock_fd = lock_stage(fs, self.path / keys.STAGE_LOCK_NAME)
        try:
            self._init_state()
            self._recover()
        except BaseException as e:
            if self._wal is not None:  # its flusher thread and files
                self._wal.close()
            self._release_lock()
            if isinstance(e, OSError):
                raise disk_error(e, "opening the stage", self.path) from e
            raise
        self._maint = [
            threading.Thread(target=self._maintain, name=f"stage-sealer-{i}", daemon=True)
            for i in range(SEALERS)
        ]
        for t in self._maint:
            t.start()

    def _init_state(self) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._seal_tickets = 0
        """Seals taken so far: each gets the next ticket, in sequence order."""
        self._committed_tickets = 0
        """Seals committed (or failed) so far: ticket N commits only after N - 1."""
        self._seq_file_lock = threading.Lock()
        self._seq_persisted = 0
        """The value last written to the sequence sidecar (under _seq_file_lock)."""
        self._replay_frontier: int | None = None
        self._closed = False
        self._failed: BaseException | None = None
        """A seal failed for a reason that is not the disk (a bug): the stage stops."""
        self._seal_fault: DiskError | None = None
        """wal durability: a seal failed on a disk error.  Appends are refused with it
        (typed) until a sealer re-seals everything after the cursor from the WAL."""
        self._seal_gen = 0
        """Bumped at each seal fault: seals taken before it must not commit."""
        self._reseal_delay = 0.0
        self._reseal_at = 0.0
        self._resealing = False
        self._uncertain: list[SealedSegment] = []
        """Segments whose commit's directory fsync failed (wal durability): in place,
        taken as sealed once a later directory fsync returns (_reseal)."""
        self._faults: dict[str, DiskError] = {}
        """The last disk error of a cursor update ("cursor"), a release ("release") or a
        segment_only seal ("seal"), each cleared by its next success (disk_fault())."""
        self._wal: WalWriter | None = None
        self.stats = StageStats()
        self._records: RecordsAccumulator | None = None
        self._bundles: BundleAccumulator | None = None
        self._sealing_bytes = 0
        """Accumulators taken for sealing whose bytes are not written yet (memory)."""
        self._written_bytes = 0
        """Seals written to their temp files, buffers dropped, not committed yet: disk
        bytes for the size cap, no longer memory for max_open_bytes."""
        self._seal_requested: set[str] = set()
        # WAL entries after the cursor, in order: sequence -> [start, end, sealed]
        self._entries: OrderedDict[int, list[int]] = OrderedDict()
        self._sealed: OrderedDict[str, SealedSegment] = OrderedDict()
        self._sealed_bytes = 0
        self._released: list[SealedSegment] = []
        """Exported segments kept until the cursor passes their entries (release())."""
        self._released_bytes = 0
        self._gate = IoGate()
        self._segments = SegmentDir(
            self.path / keys.SEGMENTS_DIR_NAME, self.config.segment.records_compression,
            self._gate, self._fs,
        )

    # --- recovery -------------------------------------------------------------------

    def _recover(self) -> None:
        before = len(self._segments.quarantined())
        for seg in self._segments.load():
            self._add_sealed(seg)
        bad = self._segments.quarantined()
        self.stats.segments_quarantined += len(bad) - before
        covered = [r for s in self._sealed.values() for r in s.sequences]
        # a quarantined segment's sequences are never reused (they may be in the queue)
        next_seq = max((hi + 1 for s in bad for _, hi in s.sequences), default=0)
        next_seq = max(next_seq, max((hi + 1 for _, hi in covered), default=0))
        seq_path = self.path / SEQUENCE_NAME
        raw = self._fs.read_if_exists(seq_path)
        if raw is not None:
            try:
                next_seq = max(next_seq, cursor_fmt.decode_sequence(raw, str(seq_path)))
            except CorruptError as e:
                log.warning("ignoring sequence sidecar: %s", e)
        wal_dir = self.path / keys.WAL_DIR_NAME
        use_wal = self.config.durability == "wal"
        if use_wal or (self._fs.exists(wal_dir) and self._fs.listdir(wal_dir)):
            wal = WalWriter(wal_dir, wal_fmt.segment_cfg_hash(LAYOUT_CONTRACT), self.config.wal,
                            self._gate, self._fs)
            if wal.recovery.max_sequence is not None:
                next_seq = max(next_seq, wal.recovery.max_sequence + 1)
            self._wal = wal
            self._next_seq = next_seq
            self._replay(wal, covered)
            if not use_wal:  # segment_only now, but a WAL was left from a wal-mode run
                wal.close()
                self._wal = None
        self._next_seq = next_seq
        self._write_sequence()

    def _replay(self, wal: WalWriter, covered: list[tuple[int, int]]) -> None:
        def is_covered(seq: int) -> bool:
            return any(lo <= seq <= hi for lo, hi in covered)

        for entry, start, end in wal.replay():
            live = isinstance(entry, wal_fmt.RecordsEntry | wal_fmt.BundleEntry) and not \
                is_covered(entry.sequence)
            bundle = entry.to_bundle(str(wal.dir)) if (
                live and isinstance(entry, wal_fmt.BundleEntry)) else None
            with self._lock:
                self._entries[entry.sequence] = [start, end, int(not live)]
                # Entries past ``end`` are not read yet: a seal during replay must not
                # move the cursor beyond them (it would purge unread WAL files).
                self._replay_frontier = end
                if not live:
                    continue
                acc: Accumulator
                if bundle is not None:
                    acc = self._bundles_acc()
                    acc.add(bundle, entry.ingestion_ts_nanos, entry.sequence)
                else:
                    assert isinstance(entry, wal_fmt.RecordsEntry)
                    acc = self._records_acc()
                    acc.add(entry.records, entry.metadata, entry.ingestion_ts_nanos)
                acc.note(entry.sequence, start, end)
                self.stats.replayed_entries += 1
                full = acc.nbytes >= self.config.segment.target_size
            if full:
                self._seal(acc.kind)
        self._seal_all()
        with self._lock:
            self._replay_frontier = None
        self._advance_cursor()

    # --- appends --------------------------------------------------------------------

    def append_records(
        self, records: Sequence[bytes], metadata: bytes = b"", timeout: float | None = None
    ) -> Future[StageAck]:
        """Stage one ``produce(entries, metadata)`` call.  The future completes at the
        LOCAL ack: after the WAL fdatasync (``wal``) or the segment seal (``segment_only``)."""
        item, n = records_item(records, metadata, self._wal is not None,
                               self.config.segment.records_compression)
        return self._append(item, n, timeout)

    def append_bundle(
        self, bundle: Mapping[int, pa.RecordBatch], timeout: float | None = None
    ) -> Future[StageAck]:
        """Stage one Arrow bundle (slot id 0..63 -> RecordBatch)."""
        item, n = bundle_item(bundle, self._wal is not None)
        return self._append(item, n, timeout)

    def _append(self, item: BundleOrRecords, n: int, timeout: float | None) -> Future[StageAck]:
        wait_s = self.config.backpressure_timeout.total_seconds() if timeout is None else timeout
        deadline = time.monotonic() + wait_s
        fut: Future[StageAck] = Future()
        # the Lock itself, not the Condition over it: Condition.__enter__/__exit__ are
        # Python frames (~8% of the GIL-held samples with four producer threads)
        with self._lock:
            while True:
                self._check_usable()
                reason = self._over_cap(n)
                wal_append = None
                if reason is None:
                    seq, ts = self._next_seq, time.time_ns()
                    if self._wal is not None:
                        try:
                            # the WAL resolves ``fut`` itself once the entry is durable
                            wal_append = self._wal.append(
                                item.encode(seq, ts), wait=False, future=fut,
                                result=functools.partial(StageAck, seq),
                            )
                        except WalFullError:
                            reason = "wal"
                if reason is None:
                    break
                self._relieve(reason)
                if self._over_cap(n) is None and reason != "wal":
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise BackpressureError(f"stage at its {reason} cap for {wait_s:.3g}s")
                self.stats.backpressure_waits += 1
                self._cond.wait(remaining)
            self._next_seq = seq + 1
            if item.bundle is not None:
                self.stats.bundles_in += 1
            else:
                self.stats.records_in += len(item.records)
            self.stats.bytes_in += n
            acc: Accumulator
            if item.bundle is not None:
                acc = self._bundles_acc()
                acc.add(item.bundle, ts, seq)
            else:
                acc = self._records_acc()
                acc.add(item.records, item.metadata, ts, item.size, item.block)
            start = end = None
            if wal_append is not None:
                start, end = wal_append.start, wal_append.end
                self._entries[seq] = [start, end, 0]
            acc.note(seq, start, end)
            ack = StageAck(seq, start, end)
            if wal_append is None:
                acc.futures.append((fut, ack))
            if acc.nbytes >= self.config.segment.target_size:
                self._seal_requested.add(acc.kind)
                self._cond.notify_all()
        if wal_append is not None:
            assert self._wal is not None
            self._wal.wait_durable(wal_append.end)  # flush_interval == 0: sync before return
        return fut

    def _check_usable(self) -> None:
        if self._closed:
            raise ClosedError("stage is closed")
        if self._failed is not None:
            raise StageError(f"stage failed: {self._failed}")
        if self._seal_fault is not None:
            raise self._seal_fault

    def _records_acc(self) -> RecordsAccumulator:
        if self._records is None:
            self._records = RecordsAccumulator()
            self._cond.notify_all()  # start its max_open_duration timer
        return self._records

    def _bundles_acc(self) -> BundleAccumulator:
        if self._bundles is None:
            self._bundles = BundleAccumulator()
            self._cond.notify_all()
        return self._bundles

    # --- sealing --------------------------------------------------------------------

    def _seal(self, kind: str) -> SealedSegment | None:
        """Seal one accumulator: write the file durably, then move the cursor."""
        with self._lock:
            job = self._take(kind)
        return None if job is None else self._run_seal(job)

    def _take(self, kind: str) -> _SealJob | None:
        """Under the lock: detach ``kind``'s accumulator for sealing, with its commit
        ticket and segment ULID (both in sequence order)."""
        acc: Accumulator | None
        if kind == "batch":
            acc, self._records = self._records, None
        else:
            acc, self._bundles = self._bundles, None
        self._seal_requested.discard(kind)
        if acc is None or len(acc) == 0:
            return None
        nbytes = acc.nbytes
        self._sealing_bytes += nbytes
        ticket = self._seal_tickets
        self._seal_tickets += 1
        return _SealJob(acc, ticket, self._segments.next_ulid(), nbytes, gen=self._seal_gen)

    def _seal_written(self, job: _SealJob) -> None:
        """The segment's bytes are in its temp file (page cache): drop the accumulator's
        buffers and count them as disk bytes, not memory -- appends waiting at
        max_open_bytes go on while the file is written back and fdatasynced."""
        job.acc.drop_buffers()
        with self._lock:
            job.written = True
            self._sealing_bytes -= job.nbytes
            self._written_bytes += job.nbytes
            self._cond.notify_all()

    def _unaccount(self, job: _SealJob) -> None:
        """Under the lock: the seal committed or failed."""
        if job.written:
            self._written_bytes -= job.nbytes
        else:
            self._sealing_bytes -= job.nbytes

    def _run_seal(self, job: _SealJob) -> SealedSegment:
        """Write the segment durably (concurrently with other seals), then -- in ticket
        order, so segments commit in sequence order (the exporter relies on it) --
        commit it, persist the sequence, account for it and move the cursor."""
        acc = job.acc
        prep: PreparedSegment | None = None
        err: BaseException | None = None
        try:
            prep = self._segments.prepare(acc, job.ulid,
                                          written=functools.partial(self._seal_written, job))
        except BaseException as e:
            err = e
        with self._cond:
            while self._committed_tickets != job.ticket:
                self._cond.wait()
        try:
            if err is None and self._failed is not None:
                err = StageError(f"an earlier seal failed: {self._failed}")
            if err is None and job.gen != self._seal_gen:
                err = StageError("an earlier seal failed on a disk error; this one is "
                                 "sealed again from the WAL")
            if err is not None:
                raise err
            assert prep is not None
            # no sequence sidecar write here: this segment's sidecar and the WAL still
            # hold its sequences; release() and drop_oldest persist it before deleting
            seg = self._segments.commit(prep)
        except BaseException as e:
            raise self._seal_failed(job, e, prep) from None
        with self._lock:
            self._unaccount(job)
            self._faults.pop("seal", None)
            self.stats.segments_sealed += 1
            self._add_sealed(seg)
            for seq in acc.seqs:
                slot = self._entries.get(seq)
                if slot is not None:
                    slot[2] = 1
            self._cond.notify_all()
        try:
            self._advance_cursor()
        finally:
            with self._lock:
                self._committed_tickets += 1
                self._cond.notify_all()
        for f, ack in acc.futures:
            f.set_result(ack)
        return seg

    def _wait_committed(self) -> None:
        """Wait for every seal taken so far to commit (or fail)."""
        with self._cond:
            target = self._seal_tickets
            while self._committed_tickets < target:
                self._cond.wait()

    def _advance_cursor(self) -> None:
        if self._wal is None:
            return
        with self._lock:
            while self._entries:
                done = next(iter(self._entries.values()))[2]
                if not done:
                    break
                self._entries.popitem(last=False)
            if self._entries:
                pos = next(iter(self._entries.values()))[0]
            elif self._replay_frontier is not None:
                pos = self._replay_frontier
            else:
                pos = self._wal.end
        try:
            self._wal.advance_cursor(pos)
        except DiskError as e:
            # the cursor stays where it was (safe: more is replayed after a crash, and
            # sidecars keep sealed entries from being replayed); the next seal retries
            log.warning("WAL cursor not advanced: %s", e)
            with self._lock:
                self._faults["cursor"] = e
            return
        with self._lock:
            self._faults.pop("cursor", None)
            self._cond.notify_all()
        self._delete_passed()

    def _write_sequence(self, through: int | None = None) -> None:
        """Persist the next sequence before anything carrying sequences is deleted
        (a released or dropped segment's sidecar; purged WAL entries are all in sealed
        segments whose sidecars still exist).  ``through``: skip the write if the
        persisted value already exceeds it (most releases: it was written ahead).

        release() and a producer at the drop_oldest cap call this from different
        threads: one lock keeps their temp files apart and makes the persisted value
        only grow (Quiver #4024).  It does not take the stage lock (the drop_oldest
        path holds it); ``_next_seq`` only grows, so a racy read is a valid lower bound.
        """
        with self._seq_file_lock:
            if through is not None and self._seq_persisted > through:
                return
            nxt = self._next_seq
            self._fs.write_atomic(self.path / SEQUENCE_NAME, [cursor_fmt.encode_sequence(nxt)])
            self._seq_persisted = max(self._seq_persisted, nxt)

    def _add_sealed(self, seg: SealedSegment) -> None:
        self._sealed[seg.ulid] = seg
        self._sealed_bytes += seg.size

    def _forget_sealed(self, seg: SealedSegment) -> bool:
        if self._sealed.pop(seg.ulid, None) is None:
            return False
        self._sealed_bytes -= seg.size
        return True

    # --- public surface -------------------------------------------------------------

    def seal_all(self) -> list[SealedSegment]:
        """Seal every open segment now (explicit finalize).  Raises the DiskError the
        stage is recovering from, if any (disk_fault())."""
        if self._seal_fault is not None:
            raise self._seal_fault
        return self._seal_all()

    def _seal_all(self) -> list[SealedSegment]:
        out = [s for k in ("batch", "qseg") if (s := self._seal(k)) is not None]
        self._wait_committed()  # and the background seals already under way
        return out

    def read_segment(self, segment: SealedSegment) -> bytes:
        """A sealed segment's bytes (for the exporter).  After :meth:`expect_reader`
        its pages are evicted from the page cache once read."""
        return self._segments.read(segment, drop_cache=not self._segments.drop_cache_at_seal)

    def verify_segment(self, segment: SealedSegment) -> str | None:
        """What is wrong with a sealed segment's file (None: intact), checked over its
        pages in place; evicted afterwards as :meth:`read_segment` does."""
        return self._segments.check(segment, drop_cache=not self._segments.drop_cache_at_seal)

    def expect_reader(self) -> None:
        """An exporter reads every sealed segment soon after its seal: keep a segment's
        pages cached until :meth:`read_segment` (evicted then) instead of evicting them
        at the seal (SegmentDir.drop_cache_at_seal)."""
        self._segments.drop_cache_at_seal = False

    def link_segment(self, segment: SealedSegment, dest: str | os.PathLike[str]) -> None:
        """Give a sealed segment's file a second name, ``dest`` (a hard link; the
        exporter's way into a local-directory store on the same file system: no byte
        copied).  The file is durable and read-only; from now on the stage never
        recycles it (SegmentDir.link).  OSError as ``os.link`` raises it."""
        with self._lock:
            if segment.ulid not in self._sealed:
                raise StageError(f"not a sealed segment of this stage: {segment.path.name}")
        self._segments.link(segment, Path(dest))

    @property
    def fs(self) -> FileSystem:
        """The file layer this stage does all its I/O through (stage/filesystem.py)."""
        return self._fs

    def sealed_segments(self) -> list[SealedSegment]:
        """Sealed segments not yet released, oldest first."""
        with self._lock:
            return list(self._sealed.values())

    def wal_sync_stats(self) -> tuple[int, int]:
        """(group-commit fdatasyncs, nanoseconds spent in them) of the WAL (metrics)."""
        wal = self._wal
        return (0, 0) if wal is None else (wal.fsyncs, wal.fsync_ns)

    def wal_cursor(self) -> int | None:
        return None if self._wal is None else self._wal.cursor

    def disk_bytes(self) -> int:
        with self._lock:
            return self._disk_bytes()

    def close(self) -> None:
        """Seal open segments, sync and close the WAL, release the lock.  On a failing
        disk it still stops every thread, closes every file and releases the lock,
        then raises the DiskError: what could not be sealed stays in the WAL for the
        next open (or ``tieredbuf drain``)."""
        with self._cond:
            if self._closed:
                return
        err: DiskError | None = None
        if self._failed is None:
            try:
                self.seal_all()
                self._advance_cursor()  # and delete the released segments it passes
            except DiskError as e:
                err = e
                log.warning("stage %s closed without sealing everything: %s", self.path, e)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for t in self._maint:
            t.join()
        if self._wal is not None:
            self._wal.close()
        with contextlib.suppress(OSError):
            self._segments.drop_spares()
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
                self._fs.close(self._lock_fd)
            self._lock_fd = None
