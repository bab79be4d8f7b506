"""What the WAL does after a failed write or fdatasync (docs/failure-modes.md).

After a failed fdatasync the page cache cannot be trusted (PostgreSQL's "fsyncgate"):
Linux may have dropped the dirty pages, or marked them clean, so a second fdatasync
can return success for data that never reached the disk.  So the WAL never
fdatasyncs the same data again to acknowledge it.  Instead it *repairs*:

1. The committed file that holds the durable position D (everything before D was
   acknowledged after an fdatasync that returned) is truncated to D and fdatasynced:
   the region whose state is unknown is cut off (and a recycled file's zero tail,
   whose truncation may not have been made durable).  If it is the active file it becomes
   ``quiver.wal.N``.  An uncommitted ``quiver.wal.new`` is deleted.
2. Every frame written since D but not acknowledged -- the writer keeps their buffers
   until their fdatasync returns -- is written again into a fresh file whose header
   starts at D, so every WAL position stays what it was; it is fdatasynced, the
   directory fsynced, renamed ``quiver.wal`` and the directory fsynced again.
3. Those appends are acknowledged now (they are durable in the new file).

The writer tries the repair at once; if the disk still fails, the waiting appends
fail with DiskFullError / DiskIOError (not acknowledged; their records may still be
exported, as after an outcome-unknown write) and every new append tries the repair
again first, failing with the same typed error until the disk works.  A failed write
whose partial bytes cannot be truncated away is handled the same way.  Every step is
idempotent, so a repair that fails half way is simply tried again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tieredbuf.errors import DiskError
from tieredbuf.format import wal as wal_fmt
from tieredbuf.stage.filesystem import FileSystem, disk_error
from tieredbuf.stage.wal_recovery import ACTIVE_NAME, NEW_NAME, WalSpan, truncate

if TYPE_CHECKING:
    from tieredbuf.stage.wal import _Rotation

log = logging.getLogger("tieredbuf.stage.wal")


@dataclass(slots=True)
class OpenFile:
    """An open WAL file."""

    fd: int
    sync_lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False
    recycled: bool = False
    """A reused spare: zeros (allocated blocks) may follow the last entry."""


def holder_of(spans: Sequence[WalSpan], durable: int) -> WalSpan | None:
    """The newest committed WAL file (not ``quiver.wal.new``) starting at or before the
    durable position: the file a repair cuts back to it."""
    out = None
    for s in spans:
        if s.path.name != NEW_NAME and s.start <= durable:
            out = s
    return out


def rewrite(fs: FileSystem, directory: Path, cfg_hash: bytes, holder: WalSpan | None,
            durable: int, frames: Sequence[bytes | memoryview], rotated_path: Path,
            rotation_id: int) -> tuple[int, WalSpan]:
    """Steps 1 and 2 above (I/O only; ``holder`` is updated in place as each step
    lands).  Returns the new active file's fd (positioned at its end) and span."""
    if holder is not None and fs.exists(holder.path):  # (a purge may have taken it)
        # always: besides unsynced frames, the file may end in a partial write, or in
        # the zeros of a recycled file whose truncation (a rotation's) never became
        # durable -- a rotated file must end at its last entry
        truncate(fs, holder.path, holder.header_size + durable - holder.start)
        holder.end = durable
        if holder.rotation_id is None:  # the active file becomes quiver.wal.N
            fs.rename(holder.path, rotated_path)
            holder.path, holder.rotation_id = rotated_path, rotation_id
    tmp = directory / NEW_NAME
    fs.unlink(tmp, missing_ok=True)
    header = wal_fmt.encode_header(cfg_hash, durable)
    fd = fs.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        n = fs.write_all(fd, [header, *frames])
        fs.fdatasync(fd)
        fs.fsync_dir(directory)  # the holder's rename first (see WalWriter._commit_rotation)
        fs.rename(tmp, directory / ACTIVE_NAME)
        fs.fsync_dir(directory)
    except BaseException:
        fs.close(fd)
        raise
    return fd, WalSpan(directory / ACTIVE_NAME, None, durable, durable + n - len(header),
                       len(header))


class WalRepairMixin:
    """WalWriter's failure handling (the module doc); WalWriter holds the state."""

    if TYPE_CHECKING:
        dir: Path
        last_error: DiskError | None
        _fs: FileSystem
        _cfg_hash: bytes
        _lock: threading.Lock
        _cond: threading.Condition
        _broken: DiskError | None
        _broken_at: WalSpan | None
        _epoch: int
        _rotation: _Rotation | None
        _rotating: bool
        _rotated: list[WalSpan]
        _active: OpenFile
        _active_span: WalSpan
        _durable: int
        _written: int
        _next_rotation: int
        _pending: deque[tuple[int, Future[Any], object]]
        _frames: deque[tuple[int, Sequence[bytes | memoryview]]]
        _resolve_later: list[tuple[Future[Any], object]]

        def _pop_durable(self) -> list[tuple[Future[Any], object]]: ...

        @staticmethod
        def _resolve(done: list[tuple[Future[Any], object]]) -> None: ...

    def _break_locked(self, err: DiskError) -> None:
        """Under the lock: a write or fdatasync failed.  Stop trusting the open files
        (a sync round already under way will not ack), note the file to cut back."""
        self.last_error = err
        if self._broken is None:
            self._broken_at = holder_of(
                [*self._rotated, self._active_span], self._durable)
        self._broken = err
        self._epoch += 1
        rot, self._rotation = self._rotation, None
        self._rotating = False
        for f in [self._active] + ([rot.old] if rot is not None else []):
            with f.sync_lock:
                if not f.closed:
                    with contextlib.suppress(OSError):
                        self._fs.close(f.fd)
                    f.closed = True
        self._cond.notify_all()

    def _repair_locked(self) -> list[tuple[Future[Any], object]]:
        """Under the lock: cut the durable file back, write the unacknowledged frames
        again into a new active file, and ack them; raises the typed DiskError (and
        stays broken) if the disk still fails."""
        assert self._broken is not None
        holder = self._broken_at
        rid = self._next_rotation
        frames = [p for _, parts in self._frames for p in parts]
        try:
            fd, span = rewrite(self._fs, self.dir, self._cfg_hash, holder,
                                          self._durable, frames,
                                          self.dir / f"{ACTIVE_NAME}.{rid}", rid)
        except OSError as e:
            self._broken = self.last_error = disk_error(e, "WAL repair", self.dir)
            raise self._broken from e
        finally:
            if holder is not None and holder.rotation_id == rid:  # renamed just now
                self._next_rotation += 1
        assert span.end == self._written, (span, self._written)
        if holder is not None and holder.rotation_id is not None and all(
                s is not holder for s in self._rotated):
            # the holder was the active file (or one a rotation renamed, then broke):
            # a rotated file now; until this point it was still _active_span only
            self._rotated.append(holder)
        log.warning("WAL repaired after %s: %d unacknowledged bytes rewritten to a new %s",
                    self._broken, span.end - span.start, ACTIVE_NAME)
        self._rotated = [s for s in self._rotated if s.path.name != NEW_NAME]
        self._active, self._active_span = OpenFile(fd), span
        self._broken = self._broken_at = self.last_error = None
        self._durable = self._written
        return self._pop_durable()

    def _fail_locked(self, err: DiskError) -> list[tuple[Future[Any], object]]:
        """Under the lock: break, try the repair at once; if the disk still fails, the
        appends waiting for their fdatasync fail with the typed error."""
        self._break_locked(err)
        try:
            return self._repair_locked()
        except DiskError as e:
            failed = list(self._pending)
            self._pending.clear()
            self._cond.notify_all()
            return [(fut, e) for _, fut, _ in failed]

    def _fail_pending_and_raise(self, err: DiskError) -> None:
        """Under the lock, in an append: break and try the repair; raise ``err`` if it
        failed (the appends waiting for their fdatasync fail with it too).  The caller
        resolves ``_resolve_later`` after releasing the lock."""
        self._resolve_later += self._fail_locked(err)
        if self._broken is not None:
            raise err

    def _fail(self, e: OSError, epoch: int | None = None) -> None:
        """An fdatasync (or a rotation's rename / directory fsync) failed: after a failed
        fdatasync the page cache cannot be trusted (fsyncgate), so the data is never
        synced again to be acked; the WAL repairs instead (stage/wal_repair.py).
        ``epoch``: the round's; if the WAL broke (and maybe was repaired) since, this
        round's files are already out of use and its error is moot."""
        with self._lock:
            if epoch is not None and epoch != self._epoch:
                return
            done = self._fail_locked(disk_error(e, "WAL fdatasync", self._active_span.path))
        self._resolve(done)
