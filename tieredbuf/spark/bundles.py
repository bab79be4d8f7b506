"""A slot's representative schema, read with small ranged GETs (no data on the driver).

For each ``.qseg`` object: the trailer and footer (the last 50 bytes), the stream
directory, and -- once per schema fingerprint seen -- the head of one stream's
Arrow IPC file, where its schema message sits.  The layout is the one documented
in :mod:`tieredbuf.format.segment`; nothing but those bytes is fetched.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

import pyarrow as pa

from tieredbuf import keys
from tieredbuf.errors import CorruptError
from tieredbuf.format.manifest import ManifestEntry
from tieredbuf.store.base import Store

_TRAILER = struct.Struct("<I8s")  # footer_size, magic (then crc32 u32)
_FOOTER_V1 = struct.Struct("<HIIQIQI")
_MAGIC = b"QUIVER\x00S"
_TRAILER_SIZE = 16
_HEAD_GUESS = 64 << 10
_IPC_FILE_MAGIC_LEN = 8  # b"ARROW1\0\0"


def _stream_rows(store: Store, loc: str) -> list[tuple[int, bytes, int, int]]:
    """(slot_id, fingerprint, byte_offset, byte_length) of every stream of one object."""
    tail = store.get_suffix(loc, _TRAILER_SIZE + _FOOTER_V1.size)
    if len(tail) < _TRAILER_SIZE + _FOOTER_V1.size:
        raise CorruptError("segment", loc, 0, "truncated: no room for footer and trailer")
    t_at = len(tail) - _TRAILER_SIZE
    footer_size, magic = _TRAILER.unpack_from(tail, t_at)
    if magic != _MAGIC:
        raise CorruptError("segment", loc, -_TRAILER_SIZE + 4, f"bad trailer magic {magic!r}")
    if footer_size != _FOOTER_V1.size:
        tail = store.get_suffix(loc, _TRAILER_SIZE + footer_size)
        t_at = len(tail) - _TRAILER_SIZE
    (_, _, _, dir_off, dir_len, _, _) = _FOOTER_V1.unpack_from(tail, t_at - footer_size)
    raw = store.get_range(loc, dir_off, dir_off + dir_len)
    try:
        table = pa.ipc.open_stream(raw).read_all()
        slots = table.column("slot_id").to_pylist()
        fps = table.column("schema_fingerprint").to_pylist()
        offs = table.column("byte_offset").to_pylist()
        lens = table.column("byte_length").to_pylist()
    except (pa.ArrowException, KeyError) as e:
        raise CorruptError("segment", loc, dir_off, f"stream directory: {e}") from e
    return list(zip(slots, fps, offs, lens, strict=True))


def _stream_schema(store: Store, loc: str, off: int, length: int) -> pa.Schema:
    n = min(length, _HEAD_GUESS)
    for _ in range(2):
        head = store.get_range(loc, off, off + n)
        try:
            return pa.ipc.read_schema(pa.py_buffer(head[_IPC_FILE_MAGIC_LEN:]))
        except pa.ArrowException as e:
            if n >= length:
                raise CorruptError("segment", loc, off, f"stream schema: {e}") from e
            n = length
    raise AssertionError("unreachable")


def slot_schemas(store: Store, entries: Iterable[ManifestEntry], slot: int) -> list[pa.Schema]:
    """Every distinct schema ``slot`` takes in the ``.qseg`` objects of ``entries``."""
    seen: dict[bytes, pa.Schema] = {}
    for e in entries:
        if not e.location.endswith(keys.SEGMENT_SUFFIX):
            continue
        for s, fp, off, length in _stream_rows(store, e.location):
            if s == slot and fp not in seen:
                seen[fp] = _stream_schema(store, e.location, off, length)
    return list(seen.values())
