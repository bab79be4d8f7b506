"""Sealed segment files: writing them (prepare, then commit), listing them at open,
recycling, deleting and quarantining them.  What a sealed segment is, and its sidecar,
is in stage/sealed_segment.py; the open segments they are made from in
stage/accumulators.py.

Sealed files live in ``<stage>/segments/``::

    <ULID>.qseg          Arrow bundles, Quiver segment format (read-only, 0o440)
    <ULID>.batch         opaque records, RFC 0001 data batch (read-only, 0o440)
    <ULID>.<stream>.json   sidecar: what the exporter needs and what recovery needs --
                         WAL position range, per-core sequences covered, and for
                         records the RFC metadata items (start_index, ingestion_time_ms,
                         metadata payload)

Seal order: prepare (concurrently with other seals) writes the segment to ``.tmp``
and its sidecar to ``.json.tmp``, fdatasyncing both; commit (in seal order) renames
the sidecar, then the segment, and fsyncs the directory once.  A sidecar without a
segment (a crash before the segment rename, or mid-release) is discarded on open --
its entries are still in the WAL, whose cursor only moves after the commit's
directory fsync returned.  The two renames share one directory fsync: a journaling
filesystem (ext4, XFS) commits them in order, so the segment is never visible
without its sidecar; were a filesystem to persist only the second, load() would
quarantine the segment as ``.orphan`` and its entries would be replayed from the WAL
(neither lost nor exported twice).

CRC.  A ``.qseg`` carries a CRC32 of the whole file in its trailer; a ``.batch`` (the
RFC's data batch has none) gets one in its sidecar (``crc32``).  segment_check.verify checks
it; ``load()`` verifies every sealed segment at open and the exporter again before
each upload.  A corrupt segment is quarantined -- renamed ``<name>.corrupt``, its
sidecar ``<name>.corrupt.json`` -- never uploaded, and reported (see
docs/failure-modes.md).  Its sequences still count when the next sequence is chosen,
so none is ever reused.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
from ulid import ULID

from tieredbuf.config import Compression
from tieredbuf.format.batch import encode_batch_parts, encode_footer
from tieredbuf.format.crc import crc32
from tieredbuf.stage import filesystem
from tieredbuf.stage.accumulators import Accumulator, RecordsAccumulator
from tieredbuf.stage.filesystem import FileSystem, IoGate
from tieredbuf.stage.sealed_segment import (
    BATCH,
    CORRUPT_SUFFIX,
    QSEG,
    SIDECAR_SUFFIX,
    SealedSegment,
    from_sidecar,
    seq_runs,
    sidecar_json,
)
from tieredbuf.stage.segment_check import verify_file

log = logging.getLogger(__name__)

SPARE_PREFIX = "free."
"""A released segment file kept for reuse by the next seal (see SegmentDir)."""


class CommitNotDurable(OSError):
    """A segment's renames happened but the directory fsync failed (SegmentDir.commit)."""

    def __init__(self, e: OSError, segment: SealedSegment) -> None:
        super().__init__(e.errno, e.strerror, e.filename)
        self.segment = segment


@dataclass(frozen=True, slots=True)
class PreparedSegment:
    """A segment written durably under its ``.tmp`` name, not yet committed."""

    segment: SealedSegment
    tmp: Path
    sidecar_tmp: Path
    """The sidecar, written and fdatasynced under its temp name (renamed at commit)."""


class SegmentDir:
    """The ``segments/`` directory: writes, lists and deletes sealed segments.

    Released files are recycled, as the WAL's are: unlinking a 32 MiB file on ext4
    mounted with ``discard`` discards its blocks in the next journal commit, which
    the WAL's next fdatasync then waits for (StagedProducer at 1 KiB records
    exporting to memory://: 182 -> 218 MiB/s, medians of 6 alternating runs).
    ``delete`` renames the segment ``free.<K>`` (directory fsynced, so the
    segment's name is gone for good before its bytes can change) and keeps at most
    ``max_spares``; ``prepare`` renames a spare to its ``.tmp`` name and overwrites
    it, truncating it to the new size before the fdatasync, so a committed segment
    never holds stale bytes.  A spare is never a segment: ``load`` deletes
    ``free.*`` files, and spares count as disk bytes (``spare_bytes``;
    ``drop_spares`` under the size cap and at close).
    """

    max_spares = 2

    drop_cache_at_seal = True
    """Evict a segment's pages from the page cache once it is fdatasynced.  Page-cache
    pages that come from long-free memory are expensive to fill on this kind of host
    (a VM whose free memory is handed back to the hypervisor: writing 32 MiB into
    fresh pages took ~85 ms of system time against ~8 ms into just-freed ones), and a
    stage that never evicts fills fresh pages for every segment.  False when an
    exporter reads each segment soon after its seal (:meth:`read` evicts then)."""

    def __init__(
        self,
        path: Path,
        compression: Compression = Compression.NONE,
        gate: IoGate | None = None,
        fs: FileSystem | None = None,
    ) -> None:
        self.path = path
        self.fs = fs = fs or filesystem.current()
        self.compression = compression
        self.gate = gate
        """If set, segment bytes go to the disk between WAL sync rounds (IoGate)."""
        self._ulid_lock = threading.Lock()
        self._last_ulid: ULID | None = None
        self._spare_lock = threading.Lock()
        self._spares: list[tuple[Path, int]] = []
        """(path, size) of released files ready for reuse."""
        self._spare_total = 0
        """Their sizes' sum (read without the lock on every append: spare_bytes)."""
        self._spare_jobs = 0
        """Releases turning a segment into a spare right now."""
        self._next_spare = 0
        fs.makedirs(path)

    def spare_bytes(self) -> int:
        return self._spare_total

    def drop_spares(self) -> int:
        """Unlink every spare; returns the bytes freed."""
        with self._spare_lock:
            spares, self._spares = self._spares, []
            self._spare_total = 0
        for p, _ in spares:
            self.fs.unlink(p, missing_ok=True)
        return sum(n for _, n in spares)

    def _reuse_spare(self, tmp: Path) -> bool:
        """Rename a spare to ``tmp`` (writable again); False if there is none.  A spare
        that has another name (a store object linked to it: :meth:`link`) is unlinked,
        never overwritten -- checked here, after it lost its segment name, so no new
        link can appear (links are made only to sealed segments' names)."""
        with self._spare_lock:
            if not self._spares:
                return False
            spare, size = self._spares.pop()
            self._spare_total -= size
        fs = self.fs
        try:
            fs.rename(spare, tmp)
            if fs.link_count(tmp) != 1:
                log.warning(
                    "segment spare %s shares its bytes with another name; unlinked, not reused",
                    spare,
                )
                fs.unlink(tmp)
                return False
            fs.chmod(tmp, 0o640)
        except OSError as e:
            log.warning("segment spare %s unusable (%s); creating a new file", spare, e)
            fs.unlink(spare, missing_ok=True)
            fs.unlink(tmp, missing_ok=True)
            return False
        return True

    def next_ulid(self) -> ULID:
        """Strictly increasing ULIDs, so names sort in seal order.  Callers that seal
        concurrently take it when they take the accumulator (in sequence order)."""
        with self._ulid_lock:
            u = ULID()
            if self._last_ulid is not None and u <= self._last_ulid:
                u = ULID.from_int(int(self._last_ulid) + 1)
            self._last_ulid = u
            return u

    def prepare(
        self, acc: Accumulator, ulid: ULID | None = None, written: Callable[[], None] | None = None
    ) -> PreparedSegment:
        """Encode ``acc`` and write it to ``<ULID>.<stream>.tmp`` durably (fdatasync), and
        its sidecar to ``<ULID>.<stream>.json.tmp`` (fdatasync).  Independent of other
        segments: several may be prepared at once.  ``written`` is called once the bytes
        are in the file (before write-back): the caller may drop ``acc``'s buffers."""
        if isinstance(acc, RecordsAccumulator):
            parts: list[bytes | memoryview | pa.Buffer]
            if self.compression == Compression.NONE and acc.count:
                parts = [*acc.block_parts(), encode_footer(acc.count)]
            else:
                if acc.has_blocks():
                    raise ValueError("encoded record blocks need compression NONE")
                parts = list(encode_batch_parts(acc.records, self.compression))
            items = tuple(acc.items)
            entry_count, record_count = len(acc.items), acc.count
        else:
            parts = acc.builder.finish()
            items = ()
            entry_count = record_count = len(acc.builder)
        crc = None
        if acc.stream == BATCH:
            crc = 0
            for part in parts:
                crc = crc32(part, crc)
        ulid = self.next_ulid() if ulid is None else ulid
        final = self.path / f"{ulid}.{acc.stream}"
        tmp = final.with_name(final.name + ".tmp")
        reused = self._reuse_spare(tmp)
        fs = self.fs
        fd = fs.open(tmp, os.O_WRONLY | (0 if reused else os.O_CREAT | os.O_EXCL), 0o640)
        try:
            try:
                size = fs.write_all(fd, parts)
                if reused:  # drop the old segment's tail (before the fdatasync)
                    fs.ftruncate(fd, size)
                parts.clear()
                if written is not None:
                    written()
                if self.gate is not None:
                    self.gate.write_back(fd, size, fs)
                if crc is not None:
                    fs.keep_checksum(fd, crc)
                fs.fdatasync(fd)
                if self.drop_cache_at_seal:
                    fs.drop_cache(fd)
                fs.fchmod(fd, 0o440)
            finally:
                fs.close(fd)
        except BaseException:
            with contextlib.suppress(OSError):  # a full disk needs the space back
                fs.unlink(tmp, missing_ok=True)
            raise
        seg = SealedSegment(
            final,
            acc.stream,
            str(ulid),
            size,
            seq_runs(acc.seqs),
            acc.wal_start,
            acc.wal_end,
            items,
            entry_count,
            record_count,
            time.time_ns() // 1_000_000,
            crc,
        )
        side_tmp = seg.sidecar_path.with_name(seg.sidecar_path.name + ".tmp")
        try:
            fs.write_durable(side_tmp, [json.dumps(sidecar_json(seg)).encode()])
        except BaseException:
            fs.unlink(tmp, missing_ok=True)
            raise
        return PreparedSegment(seg, tmp, side_tmp)

    def commit(self, prep: PreparedSegment) -> SealedSegment:
        """Rename the sidecar, then the segment, into place; one directory fsync (see
        the module doc).  Commit prepared segments in seal order: the exporter relies
        on it.  A failed rename raises OSError and leaves no segment (a sidecar left
        alone is ignored by recovery).  A failed directory fsync raises
        CommitNotDurable: the segment is in place, its names not known to survive a
        power cut until a later directory fsync returns."""
        seg = prep.segment
        fs = self.fs
        fs.rename(prep.sidecar_tmp, seg.sidecar_path)
        try:
            fs.rename(prep.tmp, seg.path)
        except OSError:
            with contextlib.suppress(OSError):
                fs.unlink(seg.sidecar_path)
            raise
        try:
            fs.fsync_dir(self.path)
        except OSError as e:
            raise CommitNotDurable(e, seg) from e
        return seg

    def sync(self) -> None:
        """fsync the directory: every rename and unlink in it so far is durable."""
        self.fs.fsync_dir(self.path)

    def discard(self, prep: PreparedSegment) -> None:
        """Best effort: remove a prepared segment's temp files (load() does it anyway)."""
        self.fs.unlink(prep.tmp, missing_ok=True)
        self.fs.unlink(prep.sidecar_tmp, missing_ok=True)

    def read(self, seg: SealedSegment, drop_cache: bool = False) -> bytes:
        """A sealed segment's bytes; ``drop_cache``: evict its pages afterwards (the
        caller holds the bytes; see :attr:`drop_cache_at_seal`)."""
        data = self.fs.read_bytes(seg.path)
        if drop_cache:
            self._evict(seg)
        return data

    def check(self, seg: SealedSegment, drop_cache: bool = False) -> str | None:
        """:func:`verify_file` of a sealed segment (its pages read in place, not copied);
        ``drop_cache`` as for :meth:`read`."""
        why = verify_file(self.fs, seg)
        if drop_cache:
            self._evict(seg)
        return why

    def _evict(self, seg: SealedSegment) -> None:
        with contextlib.suppress(OSError):  # a hint: a failure changes nothing
            fd = self.fs.open(seg.path, os.O_RDONLY)
            try:
                self.fs.drop_cache(fd)
            finally:
                self.fs.close(fd)

    def link(self, seg: SealedSegment, dest: Path) -> None:
        """Give a sealed segment's file the second name ``dest`` (a hard link: no byte is
        copied).  Its bytes are durable (fdatasynced at seal) and never change again:
        a file with another name is never recycled (:meth:`delete`, :meth:`_reuse_spare`).
        ``dest``'s directory entry is the caller's to make durable.  OSError as
        ``os.link`` raises it (EXDEV: another file system)."""
        self.fs.link(seg.path, dest)

    def load(self, verify_crc: bool = True) -> list[SealedSegment]:
        """Sealed segments on disk, in seal order; cleans up what a crash left and
        quarantines segments whose CRC does not match (:meth:`quarantine`)."""
        fs = self.fs
        out: list[SealedSegment] = []
        names = set(fs.listdir(self.path))
        changed = False
        for name in sorted(names):
            p = self.path / name
            if name.endswith(".tmp") or name.startswith(SPARE_PREFIX):
                fs.unlink(p)
                changed = True
            elif name.endswith(SIDECAR_SUFFIX):
                if name[: -len(SIDECAR_SUFFIX)] not in names:
                    fs.unlink(p)  # crash before the segment rename, or mid-release
                    changed = True
            elif name.endswith((f".{QSEG}", f".{BATCH}")):
                side = p.with_name(name + SIDECAR_SUFFIX)
                if side.name not in names:
                    log.error("segment %s has no sidecar; quarantined as .orphan", p)
                    fs.rename(p, p.with_name(name + ".orphan"))
                    changed = True
                    continue
                try:
                    seg = from_sidecar(p, json.loads(fs.read_bytes(side)), fs.file_size(p))
                except (ValueError, KeyError, TypeError) as e:
                    log.error("segment %s has an unreadable sidecar (%s); quarantined", p, e)
                    fs.rename(p, p.with_name(name + ".orphan"))
                    changed = True
                    continue
                if verify_crc and (why := verify_file(fs, seg, p)) is not None:
                    self.quarantine(seg, why, fsync=False)
                    changed = True
                    continue
                out.append(seg)
        if changed:
            fs.fsync_dir(self.path)
        return out

    def quarantined(self) -> list[SealedSegment]:
        """Every quarantined (corrupt) segment still in the directory, from its sidecar."""
        out = []
        fs = self.fs
        for name in sorted(fs.listdir(self.path)):
            if not name.endswith(CORRUPT_SUFFIX + SIDECAR_SUFFIX):
                continue
            side = self.path / name
            seg_path = side.with_name(side.name[: -len(SIDECAR_SUFFIX)])
            try:
                out.append(from_sidecar(seg_path, json.loads(fs.read_bytes(side)), None))
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.error("quarantined segment %s: unreadable sidecar (%s)", side, e)
        return out

    def quarantine(self, seg: SealedSegment, why: str, *, fsync: bool = True) -> Path:
        """Rename a corrupt segment ``<name>.corrupt`` and its sidecar ``<name>.corrupt.json``
        (never uploaded, kept for inspection); returns the new path.  The segment is gone
        from the stage's view; its sequences stay known through the sidecar."""
        dest = seg.path.with_name(seg.path.name + CORRUPT_SUFFIX)
        side_dest = dest.with_name(dest.name + SIDECAR_SUFFIX)
        self.fs.rename(seg.sidecar_path, side_dest)
        self.fs.rename(seg.path, dest)
        if fsync:
            self.fs.fsync_dir(self.path)
        log.error(
            "sealed segment %s is corrupt (%s): quarantined as %s, never uploaded; its "
            "sequences %s are LOST unless the WAL still held them (docs/failure-modes.md)",
            seg.path,
            why,
            dest.name,
            list(seg.sequences),
        )
        return dest

    def delete(self, seg: SealedSegment, keep: bool = True) -> None:
        """Segment first (the commit point of a release), then its sidecar.  With
        ``keep``, the segment file may become a spare instead of being unlinked -- unless
        another name shares it (:meth:`link`): its bytes then belong to that name too,
        and unlinking ours frees no block, so discards nothing."""
        spare: Path | None = None
        with self._spare_lock:
            if keep and len(self._spares) + self._spare_jobs < self.max_spares:
                spare = self.path / f"{SPARE_PREFIX}{self._next_spare}"
                self._next_spare += 1
                self._spare_jobs += 1
        job = spare is not None
        fs = self.fs
        try:
            if spare is not None:
                try:
                    if fs.link_count(seg.path) != 1:  # a store object shares it: unlink
                        spare = None
                    else:
                        fs.rename(seg.path, spare)
                except FileNotFoundError:
                    spare = None
            if spare is None:
                fs.unlink(seg.path, missing_ok=True)
            fs.unlink(seg.sidecar_path, missing_ok=True)
            fs.fsync_dir(self.path)  # the segment's name is gone before a spare is reused
            if spare is not None:
                with self._spare_lock:
                    self._spares.append((spare, seg.size))
                    self._spare_total += seg.size
        finally:
            with self._spare_lock:
                self._spare_jobs -= job
