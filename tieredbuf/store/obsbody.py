"""obstore response bodies streamed into place, and the checksum kept beside an object
(:mod:`tieredbuf.store.objstore`).

A GET's body collected by obstore (``GetResult.bytes()``) and then copied into a Python
``bytes`` is held twice for a moment: for a 64 MiB object, 128 MiB.  A body of at least
:data:`STREAM_AT` bytes is instead streamed, :data:`STREAM_CHUNK` bytes at a time, into
a buffer of the size the response declared -- the caller's (``read_into``) or a fresh
``bytes`` (:func:`tieredbuf.runtime.buffers.fresh_bytes`).
"""

from __future__ import annotations

from typing import Any

from tieredbuf import keys
from tieredbuf.errors import StoreError
from tieredbuf.runtime.buffers import finish, fresh_bytes

STREAM_CHUNK = 256 << 10
"""A streamed response body is copied into place this many bytes at a time (at least)."""
STREAM_AT = 1 << 20
"""A GET body at least this large is streamed into place."""


def whole(r: Any, key: str) -> bytes:
    """The whole body of the obstore GetResult ``r`` as bytes, streamed when large."""
    size = int(r.meta["size"])
    if size < STREAM_AT:
        return bytes(r.bytes())
    out, view = fresh_bytes(size)
    at = into(r, view, key)
    if at != size:
        raise StoreError(f"{key}: the store sent {at} of the {size} bytes it declared")
    return finish(out, view)


def into(r: Any, out: memoryview, key: str) -> int:
    """Stream the body of ``r`` into ``out``; the bytes written (StoreError when the
    body is longer than ``out``)."""
    at = 0
    for chunk in r.stream(min_chunk_size=STREAM_CHUNK):
        n = len(chunk)
        if at + n > len(out):
            raise StoreError(f"{key}: the store sent more than was asked for")
        out[at : at + n] = chunk
        at += n
    return at


def checksum(r: Any) -> int | None:
    """The CRC32 a data object's writer kept in its metadata (``KeepsChecksums``)."""
    value = r.attributes.get(keys.CHECKSUM_METADATA)
    return keys.parse_crc32(value) if isinstance(value, str) else None
