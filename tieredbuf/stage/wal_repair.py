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

import os
from collections.abc import Sequence
from pathlib import Path

from tieredbuf.format import wal as wal_fmt
from tieredbuf.stage._fs import FileSystem
from tieredbuf.stage.wal_recovery import ACTIVE_NAME, NEW_NAME, WalSpan, truncate


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
