"""What the local directory store keeps in a file's extended attributes (Linux user xattrs).

* ``user.tieredbuf.etag``: the content hash computed while the file was written, with
  the size and mtime it describes (``digest:size:mtime_ns``), so a CAS's compare, a
  ``get`` and a ``head`` read it back instead of hashing the file
  (:mod:`tieredbuf.store.localdir`); stale once the size or mtime moved.
* ``user.tieredbuf.crc32`` (:data:`tieredbuf.keys.CHECKSUM_XATTR`): a data object's
  CRC32 as its writer computed it (``KeepsChecksums``), 8 hex digits.

A filesystem without user xattrs keeps neither: each ``keep_*`` then says so (False),
and each ``kept_*`` answers None.
"""

from __future__ import annotations

import errno
import os

from tieredbuf import keys

ETAG_XATTR = "user.tieredbuf.etag"
"""Where a file keeps the content hash computed when it was written."""
NO_XATTR_ERRNOS = {errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EPERM}


def keep_etag(fd: int, digest: str) -> bool:
    """Keep ``digest`` with the (fully written) file; False when the filesystem has no
    user xattrs.  Rename and link keep both the attribute and the mtime it records."""
    st = os.fstat(fd)
    try:
        os.setxattr(fd, ETAG_XATTR, f"{digest}:{st.st_size}:{st.st_mtime_ns}".encode())
    except OSError as e:
        if e.errno not in NO_XATTR_ERRNOS:
            raise
        return False
    return True


def kept_etag(fd: int, st: os.stat_result | None = None) -> str | None:
    """The etag the file's writer kept, if it still describes the file."""
    try:
        raw = os.getxattr(fd, ETAG_XATTR)
    except OSError:
        return None  # ENODATA (no attribute), ENOTSUP (no xattrs here)
    digest, _, rest = raw.decode("ascii", "replace").partition(":")
    size, _, mtime = rest.partition(":")
    st = st or os.fstat(fd)
    if size != str(st.st_size) or mtime != str(st.st_mtime_ns) or len(digest) != 32:
        return None  # changed in place since it was written: hash it
    return digest


def keep_checksum(file: int | str, crc32: int) -> bool:
    """Keep a data object's CRC32 with its file (an fd, or a path: a hard link's second
    name); False when this filesystem, or this file for this process, takes none."""
    try:
        os.setxattr(file, keys.CHECKSUM_XATTR, keys.format_crc32(crc32).encode())
    except OSError as e:
        if e.errno not in NO_XATTR_ERRNOS and e.errno != errno.EACCES:
            raise
        return False
    return True


def kept_checksum(fd: int) -> int | None:
    """The CRC32 kept with the file, if any."""
    try:
        return keys.parse_crc32(os.getxattr(fd, keys.CHECKSUM_XATTR))
    except OSError:
        return None  # ENODATA (none kept), ENOTSUP (no xattrs here)
