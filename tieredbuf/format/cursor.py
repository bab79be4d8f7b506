"""Quiver cursor sidecar (``wal/quiver.wal.cursor``, docs/format-local.md), plus a same-shaped
sequence sidecar tieredbuf uses to keep the per-core sequence monotonic across
cleanup and restart (Quiver issue #4024).

Cursor sidecar v1, 24 bytes, little-endian::

    magic        [u8;8]  b"QUIVER\\0T"
    version      u16     1
    size         u16     24 (total encoded size; a v1 reader skips unknown trailing bytes)
    wal_position u64     earliest WAL position still needed for crash recovery
    crc32        u32     IEEE CRC32 over magic..wal_position

The CRC is the last 4 bytes of ``size`` and covers everything before it (for v1 that is
exactly magic..wal_position).  The sequence sidecar is the same struct with magic
``b"TBUF\\0SEQ"`` and the next per-core sequence in place of the position.
"""

from __future__ import annotations

import struct
import zlib

from tieredbuf.errors import CorruptError, UnsupportedVersionError
from tieredbuf.format._reader import Reader

CURSOR_MAGIC = b"QUIVER\x00T"
SEQUENCE_MAGIC = b"TBUF\x00SEQ"
SIDECAR_VERSION = 1
SIDECAR_SIZE = 24
_BODY = struct.Struct("<8sHHQ")
_CRC = struct.Struct("<I")


def _encode(magic: bytes, value: int) -> bytes:
    body = _BODY.pack(magic, SIDECAR_VERSION, SIDECAR_SIZE, value)
    return body + _CRC.pack(zlib.crc32(body))


def _decode(data: bytes | memoryview, magic: bytes, what: str, obj: str | None) -> int:
    r = Reader(data, what, obj)
    got = bytes(r.take(8, "magic"))
    if got != magic:
        raise CorruptError(what, obj, 0, f"bad magic {got!r}")
    version = r.u16("version")
    size = r.u16("size")
    if size < SIDECAR_SIZE:
        raise CorruptError(what, obj, 10, f"size {size} < {SIDECAR_SIZE}")
    if size > len(r.buf):
        raise CorruptError(what, obj, 10, f"truncated: size {size}, {len(r.buf)} bytes present")
    stored = _CRC.unpack_from(r.buf, size - 4)[0]
    actual = zlib.crc32(r.buf[: size - 4])
    if stored != actual:
        raise CorruptError(
            what, obj, size - 4, f"CRC mismatch: stored {stored:#010x}, computed {actual:#010x}"
        )
    if version < SIDECAR_VERSION:
        raise UnsupportedVersionError(what, obj, 8, f"unknown version {version}")
    return r.u64("value")


def encode_cursor(wal_position: int) -> bytes:
    return _encode(CURSOR_MAGIC, wal_position)


def decode_cursor(data: bytes | memoryview, obj: str | None = None) -> int:
    """The persisted ``wal_position``; CorruptError on bad magic / size / CRC."""
    return _decode(data, CURSOR_MAGIC, "WAL cursor", obj)


def encode_sequence(next_sequence: int) -> bytes:
    return _encode(SEQUENCE_MAGIC, next_sequence)


def decode_sequence(data: bytes | memoryview, obj: str | None = None) -> int:
    return _decode(data, SEQUENCE_MAGIC, "sequence sidecar", obj)
