"""The WAL writer: append, group commit, rotation.  Opening a WAL (file names,
recovery scan, replay) is in stage/wal_recovery.py; the cursor and purge in
stage/wal_purge.py; what happens after a failed write or fdatasync (the repair) in
stage/wal_repair.py.

Files under ``<stage>/wal/`` (Quiver's layout, docs/format-local.md)::

    quiver.wal             active file (38-byte header, then entries)
    quiver.wal.<N>         rotated siblings, N a rotation id; deleted once the cursor
                           passes their end position
    quiver.wal.cursor      24-byte cursor sidecar: the earliest position still needed
    quiver.wal.free.<K>    a spare: a purged file kept for reuse, its bytes zeroed
                           (ignored by recovery, which deletes it; deleted at close)

An append writes its entry with ``os.writev`` and returns a :class:`WalAppend` whose
``durable`` future completes once an fdatasync covering those bytes has *returned*:
that is the honest LOCAL ack.  With ``flush_interval > 0`` a timer-driven flusher
thread syncs at most once per interval while appends are pending (group commit);
with ``flush_interval == 0`` the appender syncs before returning, and concurrent
appenders share one fdatasync (leader/follower).

Rotation holds the lock only for two renames' worth of work: the old file is renamed
``quiver.wal.N`` and appends continue into a new file created as ``quiver.wal.new``
(header written, not yet synced).  The next sync round -- the flusher, or the appender
itself with ``flush_interval == 0`` -- fdatasyncs the old file and acks its entries,
then fdatasyncs the new one, fsyncs the directory (the old file's rename first),
renames it ``quiver.wal`` and fsyncs the directory again, all outside the lock;
entries in the new file are acknowledged only after that.  A crash
before the rename leaves ``quiver.wal.N`` (or the old ``quiver.wal``) without the new
file, which recovery repairs by creating the active file at the end of the last one
(the unacknowledged ``.new`` file is discarded).

Recycling (unlinking a 64 MiB file on ext4 mounted with ``discard`` stalled a
concurrent fdatasync ~30 ms): a purged file is renamed ``quiver.wal.free.<K>``
(directory fsynced), zeroed with ``fallocate(FALLOC_FL_ZERO_RANGE)`` and fsynced,
outside the lock; the next rotation overwrites it from offset 0, so it holds header,
entries, zeros -- a torn tail, never stale entries.  Rotating or closing a recycled
file truncates it to its last entry.  See docs/format-local.md.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tieredbuf.config import WalConfig
from tieredbuf.errors import ClosedError, DiskError, WalFullError
from tieredbuf.format import wal as wal_fmt
from tieredbuf.stage import filesystem
from tieredbuf.stage.filesystem import FileSystem, IoGate, disk_error, zero_file
from tieredbuf.stage.wal_purge import WalPurgeMixin
from tieredbuf.stage.wal_recovery import (
    ACTIVE_NAME,
    CURSOR_NAME,
    FREE_PREFIX,
    NEW_NAME,
    WalRecovery,
    WalSpan,
    recover,
    replay_spans,
)
from tieredbuf.stage.wal_repair import OpenFile, WalRepairMixin

__all__ = ["ACTIVE_NAME", "CURSOR_NAME", "FREE_PREFIX", "NEW_NAME", "WalAppend",
           "WalRecovery", "WalWriter", "zero_file"]

log = logging.getLogger(__name__)

@dataclass(slots=True)
class _Rotation:
    """A rotation begun under the lock (the old file renamed ``quiver.wal.N``, appends
    going to a fresh ``quiver.wal.new``) whose fdatasyncs, rename to ``quiver.wal`` and
    directory fsync are still to do -- outside the lock, by the next sync round."""

    old: OpenFile
    old_size: int
    """The old file's size up to its last entry (a recycled one is truncated to it)."""
    new: OpenFile
    span: WalSpan
    """The new active file's span (its path is the temp name until committed)."""
    tmp: Path


@dataclass(frozen=True, slots=True)
class WalAppend:
    """Where an entry landed; ``durable`` resolves to ``end`` after its fdatasync."""

    start: int
    end: int
    durable: Future[Any]
    """Resolves to ``end``, or to what the appender's ``result`` made of (start, end)."""


class WalWriter(WalRepairMixin, WalPurgeMixin):
    """One per-core WAL.  Thread-safe; opening it runs recovery."""

    max_spares = 1
    """Purged files kept (zeroed) for reuse by the next rotation; 0 unlinks them."""

    def __init__(self, directory: Path, cfg_hash: bytes, config: WalConfig,
                 gate: IoGate | None = None, fs: FileSystem | None = None) -> None:
        self.dir = directory
        self._fs = fs = fs or filesystem.current()
        self._gate = gate
        """Marks sync rounds so segment write-back yields to them (stage/filesystem.IoGate)."""
        self.config = config
        self._cfg_hash = cfg_hash
        self._interval = config.flush_interval.total_seconds()
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._cursor_lock = threading.Lock()
        self._pending: deque[tuple[int, Future[Any], object]] = deque()
        self._frames: deque[tuple[int, Sequence[bytes | memoryview]]] = deque()
        """(end, parts) of every frame written but not yet durable, oldest first: what
        a repair writes again (stage/wal_repair.py).  Bounded by one group commit."""
        self._broken: DiskError | None = None
        """A write or fdatasync failed and the repair has not succeeded yet."""
        self._broken_at: WalSpan | None = None
        """The committed file the repair cuts back to the durable position."""
        self._epoch = 0
        """Bumped when the WAL breaks: a sync round begun before must not ack."""
        self.last_error: DiskError | None = None
        """The last disk error, cleared by the next successful write (readiness)."""
        self._resolve_later: list[tuple[Future[Any], object]] = []
        """Acks (or failures) decided under the lock, to resolve after releasing it."""
        self._closing = False
        self._syncing = False
        self._round_lock = threading.Lock()
        """Serialises sync rounds (the flusher's and explicit ones)."""
        self._rotation: _Rotation | None = None
        """A begun rotation no sync round has claimed yet."""
        self._rotating = False
        """A sync round is finishing a rotation outside the lock."""
        self._last_sync = 0.0
        self.fsyncs = 0
        """Group-commit fdatasyncs done (metrics; updated under the file's sync lock)."""
        self.fsync_ns = 0
        """Nanoseconds spent in them."""
        fs.makedirs(self.dir)
        self._rotated: list[WalSpan] = []
        self._spares: list[tuple[Path, int]] = []
        """(path, size) of zeroed purged files ready for reuse (under the lock)."""
        self._spare_jobs = 0
        """Purged files being turned into spares outside the lock."""
        self._next_free = 0
        self.recycled = 0
        """Rotations that reused a spare (metrics)."""
        rec = recover(fs, directory, cfg_hash, config)
        self._scans: deque[tuple[Path, wal_fmt.ScanResult, int]] = rec.scans
        """The newest files' recovery scans, for the first replay (bounded, I8)."""
        self._rotated = rec.spans[:-1]
        self._active_span = rec.spans[-1]
        self._active = OpenFile(fs.open(self._active_span.path, os.O_WRONLY))
        fs.lseek(self._active.fd, 0, os.SEEK_END)
        self._cursor = rec.cursor
        self._next_rotation = max((s.rotation_id or 0 for s in self._rotated), default=0) + 1
        self.recovery: WalRecovery = rec.recovery
        self._written = self._active_span.end
        self._durable = self._written
        self._flusher: threading.Thread | None = None
        self._stop = threading.Event()
        if self._interval > 0:
            self._flusher = threading.Thread(
                target=self._flush_loop, name=f"wal-flusher:{directory}", daemon=True
            )
            self._flusher.start()

    # --- recovery -------------------------------------------------------------------

    def replay(
        self, from_position: int | None = None
    ) -> Iterator[tuple[wal_fmt.WalEntry, int, int]]:
        """(entry, start, end) for every entry at or after ``from_position`` (default:
        the cursor), reading one file at a time.  Call before appending."""
        pos = self._cursor if from_position is None else from_position
        with self._lock:
            spans = [*self._rotated, self._active_span]
            scans = {p: r for p, r, _ in self._scans}
            self._scans.clear()  # one replay uses them; later ones read the files
        yield from replay_spans(self._fs, spans, scans, pos, self._cfg_hash)

    # --- appending ------------------------------------------------------------------

    @property
    def cursor(self) -> int:
        return self._cursor

    @property
    def end(self) -> int:
        """Logical position after the last written byte."""
        return self._written

    @property
    def durable_end(self) -> int:
        return self._durable

    @property
    def fault(self) -> DiskError | None:
        """The disk error the WAL is living with (broken, or the last write failed)."""
        return self._broken or self.last_error

    def disk_bytes(self) -> int:
        with self._lock:
            return self._disk_bytes()

    def _disk_bytes(self) -> int:
        """WAL bytes plus spares (a recycled active file's zero tail is not counted: it
        is bounded by the rotation target the file grows to anyway)."""
        return (sum(s.file_size for s in self._rotated) + self._active_span.file_size
                + sum(size for _, size in self._spares))

    def _drop_spares_locked(self) -> None:
        spares, self._spares = self._spares, []
        for p, _ in spares:
            self._fs.unlink(p, missing_ok=True)

    def file_count(self) -> int:
        with self._lock:
            return len(self._rotated) + 1

    def append(
        self, parts: Sequence[bytes | memoryview], wait: bool = True, *,
        future: Future[Any] | None = None, result: Callable[[int, int], object] | None = None,
    ) -> WalAppend:
        """Write one encoded entry.  Raises WalFullError at ``max_size`` /
        ``max_rotated_files`` when nothing can be reclaimed (the caller decides to
        wait, seal, or drop).  With ``flush_interval == 0`` and ``wait``, returns only
        once the entry is durable; a caller holding its own lock passes ``wait=False``
        and calls :meth:`wait_durable` after releasing it.  ``future``: resolve this one
        (the caller's own ack) instead of a new one, with ``result(start, end)`` if given
        -- one Future per append instead of two chained ones."""
        n = sum(len(p) for p in parts)
        fut: Future[Any] = Future() if future is None else future
        done: list[tuple[Future[Any], object]] = []
        try:
            with self._lock:
                try:
                    start, end = self._append_locked(parts, n, fut, result)
                finally:
                    done, self._resolve_later = self._resolve_later, []
        finally:
            self._resolve(done)
        if wait:
            self.wait_durable(end)
        return WalAppend(start, end, fut)

    def _append_locked(self, parts: Sequence[bytes | memoryview], n: int, fut: Future[Any],
                       result: Callable[[int, int], object] | None) -> tuple[int, int]:
        if self._closing:
            raise ClosedError("WAL is closed")
        if self._broken is not None:
            self._resolve_later += self._repair_locked()
        if self._scans:  # appending: recovery's scans are stale (and only memory)
            self._scans.clear()
        try:
            self._resolve_later += self._make_room(n)
        except OSError as e:  # a purge's unlink, or a spare's
            raise disk_error(e, "WAL purge", self.dir) from e
        start = self._written
        try:
            written = self._fs.write_all(self._active.fd, parts)
        except OSError as e:
            err = disk_error(e, "WAL write", self._active_span.path)
            self.last_error = err
            self._undo_partial_write(start, err)
            raise err from e
        assert written == n
        self._written += n
        self._active_span.end += n
        end = self._written
        self._pending.append((end, fut, end if result is None else result(start, end)))
        self._frames.append((end, parts))
        self.last_error = None
        self._cond.notify_all()
        return start, end

    def _undo_partial_write(self, start: int, err: DiskError) -> None:
        """A failed write must not leave half an entry for the next one to follow: cut
        it off, or (if even that fails) break and repair (stage/wal_repair.py)."""
        off = self._active_span.header_size + start - self._active_span.start
        try:
            self._fs.ftruncate(self._active.fd, off)
            self._fs.lseek(self._active.fd, off, os.SEEK_SET)
        except OSError:
            self._break_locked(err)

    def _check_open(self) -> None:
        if self._closing:
            raise ClosedError("WAL is closed")

    def _make_room(self, n: int) -> list[tuple[Future[Any], object]]:
        cfg = self.config
        if n + self._active_span.header_size > cfg.max_size:
            raise ValueError(f"a {n}-byte WAL entry can never fit wal.max_size={cfg.max_size}")
        done: list[tuple[Future[Any], object]] = []
        active = self._active_span
        if active.end > active.start and active.end - active.start >= cfg.rotation_target:
            self._purge_locked()
            if len(self._rotated) + 2 > cfg.max_rotated_files:
                raise WalFullError(
                    f"WAL rotation needed but {cfg.max_rotated_files} files are in use"
                )
            done += self._rotate()
        if self._disk_bytes() + n > cfg.max_size:
            self._drop_spares_locked()
            self._purge_locked()
            active = self._active_span
            if (
                self._disk_bytes() + n > cfg.max_size and self._cursor > active.start
                and len(self._rotated) + 2 <= cfg.max_rotated_files
            ):
                done += self._rotate()  # make the covered part of the active file deletable
                self._purge_locked()
            if self._disk_bytes() + n > cfg.max_size:
                raise WalFullError(
                    f"WAL holds {self._disk_bytes()} bytes; {n} more exceed max_size "
                    f"{cfg.max_size} until the cursor advances"
                )
        return done

    def _rotate(self) -> list[tuple[Future[Any], object]]:
        """Under the lock: retire the active file and start a fresh one; the syncs are
        left to the next sync round (see _Rotation).  A rotation still pending is
        committed first (inline: this is the rare path of a file filled within one
        flush interval, or a reclaim at a cap).  Acks it decides go to
        ``_resolve_later`` (the caller resolves them after releasing the lock)."""
        self._resolve_later += self._settle_rotation()
        old = self._active
        rid = self._next_rotation
        self._next_rotation += 1
        span = self._active_span
        target = self.dir / f"{ACTIVE_NAME}.{rid}"
        fs = self._fs
        try:
            fs.rename(span.path, target)
        except OSError as e:  # nothing changed
            self._next_rotation -= 1
            self.last_error = disk_error(e, "WAL rotation", span.path)
            raise self.last_error from e
        span.path, span.rotation_id = target, rid
        tmp = self.dir / NEW_NAME
        header = wal_fmt.encode_header(self._cfg_hash, self._written)
        recycled = False
        if self._spares:
            # a zeroed spare: header at 0, entries overwrite zeros (see module doc)
            spare, _ = self._spares.pop()
            try:
                fs.rename(spare, tmp)
                recycled = True
            except OSError as e:
                log.warning("WAL spare %s unusable (%s); creating a new file", spare, e)
        flags = os.O_WRONLY | os.O_CREAT | (0 if recycled else os.O_TRUNC)
        try:
            fd = fs.open(tmp, flags, 0o644)
            try:
                fs.write_all(fd, [header])
            except OSError:
                fs.close(fd)
                raise
        except OSError as e:  # the old file is renamed, no new one: repair makes one
            self._fail_pending_and_raise(disk_error(e, "WAL rotation", tmp))
            return []  # repaired at once: the repair made the new active file
        self._rotated.append(span)
        self.recycled += recycled
        self._active_span = WalSpan(tmp, None, self._written, self._written, len(header))
        self._active = OpenFile(fd, recycled=recycled)
        self._rotation = _Rotation(old, span.file_size, self._active, self._active_span, tmp)
        return []

    def _settle_rotation(self) -> list[tuple[Future[Any], object]]:
        """Under the lock: make sure no rotation is pending (wait for a sync round that
        is committing one; commit an unclaimed one here)."""
        while self._rotating:
            self._cond.wait()
        self._check_open()
        if self._broken is not None:
            raise self._broken
        rot, self._rotation = self._rotation, None
        if rot is None:
            return []
        try:
            self._commit_rotation(rot)
        except OSError as e:
            self._rotation = rot
            self._fail_pending_and_raise(disk_error(e, "WAL rotation", self.dir))
            return []  # repaired at once
        rot.span.path = self.dir / ACTIVE_NAME
        self._durable = self._written
        return self._pop_durable()

    def _commit_rotation(self, rot: _Rotation,
                         old_durable: Callable[[], None] | None = None) -> None:
        """The I/O of a rotation: old file durable and closed, new file durable and
        renamed into place, directory fsynced.  Called by one thread per rotation.
        ``old_durable`` runs once the old file's fdatasync returned: its entries are
        durable then, whatever happens to the renames (a crash leaves the old file
        under its old or its rotated name, and recovery reads either)."""
        fs = self._fs
        with rot.old.sync_lock:
            if not rot.old.closed:
                if rot.old.recycled:  # only the newest file may end in zeros
                    fs.ftruncate(rot.old.fd, rot.old_size)
                fs.fdatasync(rot.old.fd)
                fs.close(rot.old.fd)
                rot.old.closed = True
        if old_durable is not None:
            old_durable()
        fs.fdatasync(rot.new.fd)
        # the old file's rename to quiver.wal.N must be durable before the new file
        # takes its name: were only the second rename to survive a power cut, the old
        # file -- acknowledged entries -- would have no name left
        fs.fsync_dir(self.dir)
        fs.rename(rot.tmp, self.dir / ACTIVE_NAME)
        fs.fsync_dir(self.dir)

    def _pop_durable(self) -> list[tuple[Future[Any], object]]:
        done = []
        while self._pending and self._pending[0][0] <= self._durable:
            _, fut, value = self._pending.popleft()
            done.append((fut, value))
        while self._frames and self._frames[0][0] <= self._durable:
            self._frames.popleft()
        self._cond.notify_all()
        return done

    @staticmethod
    def _resolve(done: list[tuple[Future[Any], object]]) -> None:
        for fut, value in done:
            if isinstance(value, DiskError):
                fut.set_exception(value)
            else:
                fut.set_result(value)

    # --- durability -----------------------------------------------------------------

    def _sync_round(self) -> None:
        with self._round_lock:
            with self._lock:
                if self._broken is not None:
                    return  # nothing to sync until a repair (an append) succeeds
                rot, self._rotation = self._rotation, None
                self._rotating = rot is not None
                f, target, epoch = self._active, self._written, self._epoch
                if rot is None and target <= self._durable:
                    return
            try:
                t0 = time.perf_counter_ns()
                with self._gate.wal_round() if self._gate is not None else nullcontext():
                    if rot is not None:
                        # every byte up to ``target`` is in the old file or the new one;
                        # the old file's entries are acked as soon as it is synced (a
                        # rotation round makes three syncs: measured 150-190 ms against
                        # 60-80 for a plain round at 64 KiB records)
                        self._commit_rotation(rot, functools.partial(
                            self._acked_to, rot.span.start, epoch))
                    else:
                        with f.sync_lock:
                            if not f.closed:  # a rotation already synced a closed file
                                self._fs.fdatasync(f.fd)
                self.fsync_ns += time.perf_counter_ns() - t0
                self.fsyncs += 1
            except OSError as e:
                with self._lock:
                    if rot is not None and self._epoch == epoch:
                        self._rotation, self._rotating = rot, False
                self._fail(e, epoch)
                return
            with self._lock:
                if self._epoch != epoch:  # broken meanwhile: the repair acks these
                    return
                if rot is not None:
                    rot.span.path = self.dir / ACTIVE_NAME
                    self._rotating = False
                self._durable = max(self._durable, target)
                self._last_sync = time.monotonic()
                done = self._pop_durable()
        self._resolve(done)

    def _acked_to(self, position: int, epoch: int) -> None:
        """Every byte before ``position`` is durable: resolve those appends."""
        with self._lock:
            if self._epoch != epoch:
                return
            self._durable = max(self._durable, position)
            done = self._pop_durable()
        self._resolve(done)

    def wait_durable(self, end: int) -> None:
        """With ``flush_interval == 0``: sync (or join a sync in progress) until ``end``
        is durable.  With a flusher thread this returns at once (use the futures)."""
        if self._interval > 0:
            return
        self._wait_durable(end)

    def _wait_durable(self, end: int) -> None:
        while True:
            with self._cond:
                if self._durable >= end:
                    return
                if self._broken is not None:
                    raise self._broken
                if self._syncing:
                    self._cond.wait()
                    continue
                self._syncing = True
            try:
                self._sync_round()
            finally:
                with self._cond:
                    self._syncing = False
                    self._cond.notify_all()

    def _flush_loop(self) -> None:
        stop = self._stop
        while True:
            with self._cond:
                while not self._closing and (self._broken is not None
                                             or self._durable >= self._written):
                    self._cond.wait()
                if self._closing and (self._broken is not None
                                      or self._durable >= self._written):
                    return
                delay = self._last_sync + self._interval - time.monotonic()
                closing = self._closing
            if delay > 0 and not closing:
                stop.wait(delay)  # the group-commit window (close() cuts it short)
            self._sync_round()

    def sync(self) -> None:
        """Make every written byte durable now (and commit a pending rotation)."""
        self._wait_durable(self._written)
        if self._rotation is not None:
            self._sync_round()

    # --- shutdown -------------------------------------------------------------------

    def close(self) -> None:
        """Sync what was written, stop the flusher, close the file.  On a failing disk
        it still stops and closes everything (the appends it could not make durable
        fail with the typed error; recovery deals with the files at the next open)."""
        with self._cond:
            if self._closing:
                return
        if self._broken is None:
            try:
                self.sync()
            except DiskError as e:
                log.warning("WAL: closing with unsynced appends: %s", e)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._stop.set()
        if self._flusher is not None:
            self._flusher.join()
        with self._lock, contextlib.suppress(OSError):
            self._drop_spares_locked()
        a = self._active
        if a.recycled and not a.closed and self._broken is None:
            try:  # drop the zero tail so a clean reopen finds no torn bytes
                self._fs.ftruncate(a.fd, self._active_span.file_size)
                self._fs.fdatasync(a.fd)
            except OSError as e:
                log.warning("WAL: cannot truncate %s at close: %s", self._active_span.path, e)
        files = [self._active] + ([self._rotation.old] if self._rotation is not None else [])
        for f in files:
            with f.sync_lock:
                if not f.closed:
                    with contextlib.suppress(OSError):
                        self._fs.close(f.fd)
                    f.closed = True
        with self._lock:
            left = [(fut, ClosedError("WAL closed before this append was durable"))
                    for _, fut, _ in self._pending]
            self._pending.clear()
        for fut, err in left:
            fut.set_exception(err)
