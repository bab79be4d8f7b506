"""Operating-system file helpers shared by the local store and the stage.

Both layers need the same durability step and neither may import the other; the
service's supervisor writes its owner-only snapshots (TLS pair, tokens) with
:func:`write_private`.
"""

from __future__ import annotations

import errno
import os


def may_pass_over(e: OSError, parent: str | os.PathLike[str]) -> bool:
    """Whether a refused fsync of ``parent`` -- the directory holding one this process
    found there, not one it made -- may be passed over: read-only (EROFS), a file system
    without the call (EINVAL), or a directory this process could not have added an
    entry to (EACCES or EPERM, and no write and search permission on it)."""
    if e.errno in (errno.EROFS, errno.EINVAL):
        return True
    return e.errno in (errno.EACCES, errno.EPERM) and not os.access(parent, os.W_OK | os.X_OK)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory, so a rename or create inside it survives a crash."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_private(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path``, created owner-only (0600) or truncated: a temporary
    file that is then checked and renamed into place by the caller."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
