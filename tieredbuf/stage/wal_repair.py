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
from collections.abc import Sequence
from pathlib import Path

from tieredbuf.errors import DiskError
from tieredbuf.format import wal as wal_fmt
from tieredbuf.stage.filesystem import FileSystem, disk_error
from tieredbuf.stage.wal_recovery import ACTIVE_NAME, NEW_NAME, WalSpan, truncate
from tieredbuf.stage.wal_state import Done, OpenFile, WalState, resolve

log = logging.getLogger(__name__)


def holder_of(spans: Sequence[WalSpan], durable: int) -> WalSpan | None:
    """The newest committed WAL file (not ``quiver.wal.new``) starting at or before the
    durable position: the file a repair cuts back to it."""
    out = None
    for s in spans:
        if s.path.name != NEW_NAME and s.start <= durable:
            out = s
    return out


def rewrite(
    fs: FileSystem,
    directory: Path,
    cfg_hash: bytes,
    holder: WalSpan | None,
    durable: int,
    frames: Sequence[bytes | memoryview],
    rotated_path: Path,
    rotation_id: int,
) -> tuple[int, WalSpan]:
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
        fs.fsync_dir(directory)  # the holder's rename first (see WalRotation.commit)
        fs.rename(tmp, directory / ACTIVE_NAME)
        fs.fsync_dir(directory)
    except BaseException:
        fs.close(fd)
        raise
    return fd, WalSpan(
        directory / ACTIVE_NAME, None, durable, durable + n - len(header), len(header)
    )


class WalRepair:
    """The writer's failure handling (the module doc), on the writer's state."""

    def __init__(self, state: WalState) -> None:
        self.state = state

    def break_locked(self, err: DiskError) -> None:
        """Under the lock: a write or fdatasync failed.  Stop trusting the open files
        (a sync round already under way will not ack), note the file to cut back."""
        st = self.state
        st.last_error = err
        if st.broken is None:
            st.broken_at = holder_of([*st.rotated, st.active_span], st.durable)
        st.broken = err
        st.epoch += 1
        rot, st.rotation = st.rotation, None
        st.rotating = False
        for f in [st.active] + ([rot.old] if rot is not None else []):
            with f.sync_lock:
                if not f.closed:
                    with contextlib.suppress(OSError):
                        st.fs.close(f.fd)
                    f.closed = True
        st.cond.notify_all()

    def repair_locked(self) -> Done:
        """Under the lock: cut the durable file back, write the unacknowledged frames
        again into a new active file, and ack them; raises the typed DiskError (and
        stays broken) if the disk still fails."""
        st = self.state
        assert st.broken is not None
        holder = st.broken_at
        rid = st.next_rotation
        frames = [p for _, parts in st.frames for p in parts]
        try:
            fd, span = rewrite(
                st.fs,
                st.dir,
                st.cfg_hash,
                holder,
                st.durable,
                frames,
                st.dir / f"{ACTIVE_NAME}.{rid}",
                rid,
            )
        except OSError as e:
            st.broken = st.last_error = disk_error(e, "WAL repair", st.dir)
            raise st.broken from e
        finally:
            if holder is not None and holder.rotation_id == rid:  # renamed just now
                st.next_rotation += 1
        assert span.end == st.written, (span, st.written)
        if (
            holder is not None
            and holder.rotation_id is not None
            and all(s is not holder for s in st.rotated)
        ):
            # the holder was the active file (or one a rotation renamed, then broke):
            # a rotated file now; until this point it was still active_span only
            st.rotated.append(holder)
        log.warning(
            "WAL repaired after %s: %d unacknowledged bytes rewritten to a new %s",
            st.broken,
            span.end - span.start,
            ACTIVE_NAME,
        )
        st.rotated = [s for s in st.rotated if s.path.name != NEW_NAME]
        st.active, st.active_span = OpenFile(fd), span
        st.broken = st.broken_at = st.last_error = None
        st.durable = st.written
        return st.pop_durable()

    def fail_locked(self, err: DiskError) -> Done:
        """Under the lock: break, try the repair at once; if the disk still fails, the
        appends waiting for their fdatasync fail with the typed error."""
        self.break_locked(err)
        try:
            return self.repair_locked()
        except DiskError as e:
            st = self.state
            failed = list(st.pending)
            st.pending.clear()
            st.cond.notify_all()
            return [(fut, e) for _, fut, _ in failed]

    def fail_pending_and_raise(self, err: DiskError) -> None:
        """Under the lock, in an append: break and try the repair; raise ``err`` if it
        failed (the appends waiting for their fdatasync fail with it too).  The caller
        resolves ``resolve_later`` after releasing the lock."""
        st = self.state
        st.resolve_later += self.fail_locked(err)
        if st.broken is not None:
            raise err

    def fail(self, e: OSError, epoch: int | None = None) -> None:
        """An fdatasync (or a rotation's rename / directory fsync) failed: after a failed
        fdatasync the page cache cannot be trusted (fsyncgate), so the data is never
        synced again to be acked; the WAL repairs instead (the module doc).
        ``epoch``: the round's; if the WAL broke (and maybe was repaired) since, this
        round's files are already out of use and its error is moot."""
        st = self.state
        with st.lock:
            if epoch is not None and epoch != st.epoch:
                return
            done = self.fail_locked(disk_error(e, "WAL fdatasync", st.active_span.path))
        resolve(done)
