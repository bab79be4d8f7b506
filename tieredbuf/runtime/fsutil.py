"""Operating-system file helpers shared by the local store and the stage.

Both layers need the same durability step and neither may import the other; the
service's supervisor writes its owner-only snapshots (TLS pair, tokens) with
:func:`write_private`.
"""

from __future__ import annotations

import errno
import os

UNSYNCABLE_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.EINVAL})
"""A directory fsync that fails so says the directory is not one a process could have
just changed: not ours to open, read-only, or a file system without the call."""


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
