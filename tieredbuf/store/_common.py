"""Small helpers shared by the store backends: key checks and range arithmetic."""

from __future__ import annotations

import errno

from tieredbuf.errors import (
    AccessDeniedError,
    InvalidKeyError,
    PermanentStoreError,
    StoreError,
    TransientStoreError,
)

_DENIED = {errno.EACCES, errno.EPERM, errno.EROFS}
_PERMANENT = {errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG, errno.ELOOP}


def os_error(e: OSError, what: str) -> StoreError:
    """A local directory store's OSError on the error tree: permission and a read-only
    filesystem are permanent (AccessDeniedError), a broken layout too; anything else
    (a full disk, I/O errors) is transient."""
    msg = f"{what}: {e}"
    if e.errno in _DENIED:
        return AccessDeniedError(msg)
    if e.errno in _PERMANENT:
        return PermanentStoreError(msg)
    return TransientStoreError(msg)


def check_key(key: str) -> str:
    """Reject keys no backend may see: empty, absolute, '.'/'..' or empty segments, NUL.

    The same rule on every backend, so a key that works on memory works on S3 and on a
    local directory (where '..' would escape the root).
    """
    if not isinstance(key, str) or not key:
        raise InvalidKeyError(f"invalid object key {key!r}: must be a non-empty string")
    if key.startswith("/") or key.endswith("/"):
        raise InvalidKeyError(f"invalid object key {key!r}: leading or trailing '/'")
    if "\x00" in key or "\\" in key:
        raise InvalidKeyError(f"invalid object key {key!r}: NUL or backslash")
    for part in key.split("/"):
        if part in ("", ".", ".."):
            raise InvalidKeyError(f"invalid object key {key!r}: empty, '.' or '..' segment")
    return key


def check_prefix(prefix: str) -> str:
    """A list prefix: '' (everything) or a key-like string, optionally ending in '/'."""
    if prefix == "":
        return prefix
    check_key(prefix.rstrip("/") if prefix.endswith("/") else prefix)
    if prefix.endswith("//"):
        raise InvalidKeyError(f"invalid prefix {prefix!r}")
    return prefix


def check_range(start: int, end: int) -> None:
    if start < 0 or end < start:
        raise ValueError(f"invalid byte range [{start}, {end})")


def prefix_dir(prefix: str) -> str:
    """The directory part of a list prefix: 'a/b/c' -> 'a/b/', 'a/' -> 'a/', 'ab' -> ''."""
    cut = prefix.rfind("/")
    return prefix[: cut + 1] if cut >= 0 else ""
