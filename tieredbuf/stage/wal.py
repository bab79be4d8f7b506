"""The WAL writer: appends, and the facade over its parts, which share one
:class:`~tieredbuf.stage.wal_state.WalState`: group commit (stage/wal_sync.py),
rotation (stage/wal_rotation.py), the cursor and purge (stage/wal_purge.py), what
happens after a failed write or fdatasync (the repair, stage/wal_repair.py).  Opening
a WAL (file names, recovery scan, replay) is in stage/wal_recovery.py.

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
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tieredbuf.config import WalConfig
from tieredbuf.errors import ClosedError, DiskError, WalFullError
from tieredbuf.format import wal as wal_fmt
from tieredbuf.stage import filesystem
from tieredbuf.stage.filesystem import FileSystem, IoGate, disk_error, zero_file
from tieredbuf.stage.wal_purge import WalPurge
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
from tieredbuf.stage.wal_repair import WalRepair
from tieredbuf.stage.wal_rotation import WalRotation
from tieredbuf.stage.wal_state import Done, OpenFile, WalState, resolve
from tieredbuf.stage.wal_sync import WalSync

__all__ = [
    "ACTIVE_NAME",
    "CURSOR_NAME",
    "FREE_PREFIX",
    "NEW_NAME",
    "WalAppend",
    "WalRecovery",
    "WalWriter",
    "zero_file",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WalAppend:
    """Where an entry landed; ``durable`` resolves to ``end`` after its fdatasync."""

    start: int
    end: int
    durable: Future[Any]
    """Resolves to ``end``, or to what the appender's ``result`` made of (start, end)."""


class WalWriter:
    """One per-core WAL.  Thread-safe; opening it runs recovery."""

    def __init__(
        self,
        directory: Path,
        cfg_hash: bytes,
        config: WalConfig,
        gate: IoGate | None = None,
        fs: FileSystem | None = None,
    ) -> None:
        self.dir = directory
        fs = fs or filesystem.current()
        self.config = config
        self._interval = config.flush_interval.total_seconds()
        fs.makedirs(directory)
        rec = recover(fs, directory, cfg_hash, config)
        self.recovery: WalRecovery = rec.recovery
        active = OpenFile(fs.open(rec.spans[-1].path, os.O_WRONLY))
        fs.lseek(active.fd, 0, os.SEEK_END)
        self._state = st = WalState(
            directory, cfg_hash, config, fs, gate, rec.spans, active, rec.cursor, rec.scans
        )
        self._repair = WalRepair(st)
        self._rotation = WalRotation(st, self._repair)
        self._purge = WalPurge(st, self._rotation)
        self._sync = WalSync(st, self._rotation, self._repair, self._interval)
        self._sync.start_flusher(f"wal-flusher:{directory}")

    # --- recovery -------------------------------------------------------------------

    def replay(
        self, from_position: int | None = None
    ) -> Iterator[tuple[wal_fmt.WalEntry, int, int]]:
        """(entry, start, end) for every entry at or after ``from_position`` (default:
        the cursor), reading one file at a time.  Call before appending."""
        st = self._state
        pos = st.cursor if from_position is None else from_position
        with st.lock:
            spans = [*st.rotated, st.active_span]
            scans = {p: r for p, r, _ in st.scans}
            st.scans.clear()  # one replay uses them; later ones read the files
        yield from replay_spans(st.fs, spans, scans, pos, st.cfg_hash)

    def kept_scans(self) -> list[tuple[Path, int]]:
        """(path, bytes read) of the recovery scans kept for the first :meth:`replay`
        (bounded by 2 x rotation_target; none once replayed or appended to)."""
        with self._state.lock:
            return [(p, n) for p, _, n in self._state.scans]

    # --- appending ------------------------------------------------------------------

    @property
    def cursor(self) -> int:
        return self._state.cursor

    @property
    def end(self) -> int:
        """Logical position after the last written byte."""
        return self._state.written

    @property
    def durable_end(self) -> int:
        return self._state.durable

    @property
    def active_span(self) -> WalSpan:
        """The active (newest) file: its path and logical positions."""
        return self._state.active_span

    @property
    def fault(self) -> DiskError | None:
        """The disk error the WAL is living with (broken, or the last write failed)."""
        return self._state.broken or self._state.last_error

    @property
    def fsyncs(self) -> int:
        """Group-commit fdatasyncs done (metrics)."""
        return self._sync.fsyncs

    @property
    def fsync_ns(self) -> int:
        """Nanoseconds spent in them."""
        return self._sync.fsync_ns

    @property
    def recycled(self) -> int:
        """Rotations that reused a spare (metrics)."""
        return self._rotation.recycled

    def disk_bytes(self) -> int:
        with self._state.lock:
            return self._state.disk_bytes()

    def file_count(self) -> int:
        with self._state.lock:
            return len(self._state.rotated) + 1

    def advance_cursor(self, position: int) -> None:
        """Persist ``position`` as the earliest WAL data still needed, then delete
        rotated files that lie wholly before it.  Never moves backwards."""
        self._purge.advance_cursor(position)

    def reclaim(self) -> int:
        """Under disk pressure: if the cursor has passed part of the active file, rotate
        it so the covered part can be deleted, then purge.  Returns bytes freed."""
        return self._purge.reclaim()

    def append(
        self,
        parts: Sequence[bytes | memoryview],
        wait: bool = True,
        *,
        future: Future[Any] | None = None,
        result: Callable[[int, int], object] | None = None,
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
        st = self._state
        done: Done = []
        try:
            with st.lock:
                try:
                    start, end = self._append_locked(parts, n, fut, result)
                finally:
                    done, st.resolve_later = st.resolve_later, []
        finally:
            resolve(done)
        if wait:
            self.wait_durable(end)
        return WalAppend(start, end, fut)

    def _append_locked(
        self,
        parts: Sequence[bytes | memoryview],
        n: int,
        fut: Future[Any],
        result: Callable[[int, int], object] | None,
    ) -> tuple[int, int]:
        st = self._state
        if st.closing:
            raise ClosedError("WAL is closed")
        if st.broken is not None:
            st.resolve_later += self._repair.repair_locked()
        if st.scans:  # appending: recovery's scans are stale (and only memory)
            st.scans.clear()
        try:
            st.resolve_later += self._make_room(n)
        except OSError as e:  # a purge's unlink, or a spare's
            raise disk_error(e, "WAL purge", self.dir) from e
        start = st.written
        try:
            written = st.fs.write_all(st.active.fd, parts)
        except OSError as e:
            err = disk_error(e, "WAL write", st.active_span.path)
            st.last_error = err
            self._undo_partial_write(start, err)
            raise err from e
        assert written == n
        st.written += n
        st.active_span.end += n
        end = st.written
        st.pending.append((end, fut, end if result is None else result(start, end)))
        st.frames.append((end, parts))
        st.last_error = None
        st.cond.notify_all()
        return start, end

    def _undo_partial_write(self, start: int, err: DiskError) -> None:
        """A failed write must not leave half an entry for the next one to follow: cut
        it off, or (if even that fails) break and repair (stage/wal_repair.py)."""
        st = self._state
        off = st.active_span.header_size + start - st.active_span.start
        try:
            st.fs.ftruncate(st.active.fd, off)
            st.fs.lseek(st.active.fd, off, os.SEEK_SET)
        except OSError:
            self._repair.break_locked(err)

    def _make_room(self, n: int) -> Done:
        st = self._state
        purge = self._purge
        cfg = self.config
        if n + st.active_span.header_size > cfg.max_size:
            raise ValueError(f"a {n}-byte WAL entry can never fit wal.max_size={cfg.max_size}")
        done: Done = []
        active = st.active_span
        if active.end > active.start and active.end - active.start >= cfg.rotation_target:
            purge.purge_locked()
            if len(st.rotated) + 2 > cfg.max_rotated_files:
                raise WalFullError(
                    f"WAL rotation needed but {cfg.max_rotated_files} files are in use"
                )
            done += self._rotation.rotate()
        if st.disk_bytes() + n > cfg.max_size:
            st.drop_spares()
            purge.purge_locked()
            active = st.active_span
            if (
                st.disk_bytes() + n > cfg.max_size
                and st.cursor > active.start
                and len(st.rotated) + 2 <= cfg.max_rotated_files
            ):
                # make the covered part of the active file deletable
                done += self._rotation.rotate()
                purge.purge_locked()
            if st.disk_bytes() + n > cfg.max_size:
                raise WalFullError(
                    f"WAL holds {st.disk_bytes()} bytes; {n} more exceed max_size "
                    f"{cfg.max_size} until the cursor advances"
                )
        return done

    # --- durability -----------------------------------------------------------------

    def wait_durable(self, end: int) -> None:
        """With ``flush_interval == 0``: sync (or join a sync in progress) until ``end``
        is durable.  With a flusher thread this returns at once (use the futures)."""
        if self._interval > 0:
            return
        self._sync.wait_durable(end)

    def sync(self) -> None:
        """Make every written byte durable now (and commit a pending rotation)."""
        self._sync.wait_durable(self._state.written)
        if self._state.rotation is not None:
            self._sync.round()

    # --- shutdown -------------------------------------------------------------------

    def close(self) -> None:
        """Sync what was written, stop the flusher, close the file.  On a failing disk
        it still stops and closes everything (the appends it could not make durable
        fail with the typed error; recovery deals with the files at the next open)."""
        st = self._state
        with st.cond:
            if st.closing:
                return
        if st.broken is None:
            try:
                self.sync()
            except DiskError as e:
                log.warning("WAL: closing with unsynced appends: %s", e)
        with st.cond:
            st.closing = True
            st.cond.notify_all()
        self._sync.stop_flusher()
        with st.lock, contextlib.suppress(OSError):
            st.drop_spares()
        a = st.active
        if a.recycled and not a.closed and st.broken is None:
            try:  # drop the zero tail so a clean reopen finds no torn bytes
                st.fs.ftruncate(a.fd, st.active_span.file_size)
                st.fs.fdatasync(a.fd)
            except OSError as e:
                log.warning("WAL: cannot truncate %s at close: %s", st.active_span.path, e)
        files = [st.active] + ([st.rotation.old] if st.rotation is not None else [])
        for f in files:
            with f.sync_lock:
                if not f.closed:
                    with contextlib.suppress(OSError):
                        st.fs.close(f.fd)
                    f.closed = True
        with st.lock:
            left = [
                (fut, ClosedError("WAL closed before this append was durable"))
                for _, fut, _ in st.pending
            ]
            st.pending.clear()
        for fut, err in left:
            fut.set_exception(err)
