"""A ``bytes`` object filled in place: large objects assembled from parts without a copy.

A reader that fetches a large object as parallel ranged GETs must hand out one ``bytes``
(what ``ConsumedBatch.data`` is).  Joining the parts (``b"".join``) holds them and the
joined copy at once: twice the object.  :func:`fresh_bytes` allocates the ``bytes``
object first (CPython's ``PyBytes_FromStringAndSize(NULL, n)``, the way C code builds a
``bytes`` it fills itself) and gives a writable view of its contents; each part is
written into its place as it arrives and then dropped.  Nobody else can see the object
until its maker returns it, so its immutability is never observed being broken.

On another Python implementation it falls back to a ``bytearray`` copied once at the
end (:func:`finish`), which costs the copy this module exists to avoid.
"""

from __future__ import annotations

import ctypes
import platform
import sys

__all__ = ["fresh_bytes", "finish"]

_CPYTHON = platform.python_implementation() == "CPython"
_DATA_AT = sys.getsizeof(b"") - 1
"""Offset of a bytes object's first content byte (``ob_sval``) from its address."""

if _CPYTHON:
    _new = ctypes.pythonapi.PyBytes_FromStringAndSize
    _new.restype = ctypes.py_object
    _new.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)


def fresh_bytes(n: int) -> tuple[bytes | bytearray, memoryview]:
    """An ``n``-byte buffer and a writable view of its contents (to be filled completely
    before :func:`finish` hands it out)."""
    if n < 0:
        raise ValueError(f"negative size {n}")
    if not _CPYTHON or n == 0:
        out = bytearray(n)
        return out, memoryview(out)
    b: bytes = _new(None, n)
    view = memoryview((ctypes.c_char * n).from_address(id(b) + _DATA_AT)).cast("B")
    return b, view


def finish(buf: bytes | bytearray, view: memoryview) -> bytes:
    """The filled buffer as ``bytes`` (the same object on CPython)."""
    view.release()
    return buf if isinstance(buf, bytes) else bytes(buf)
