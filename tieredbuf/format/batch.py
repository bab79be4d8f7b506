"""RFC 0001 data batch format (``data/<ULID>.batch``), byte for byte.

::

    record block (zstd: tieredbuf writes one level-3 frame with its content size and
                  content checksum, reads any RFC 8878 frames):
        record i: [len: u32 LE][data]
    footer (7 bytes, never compressed):
        compression_type : u8      0x00 none, 0x01 zstd
        record_count     : u32 LE
        version          : u16 LE  (= 1)
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

import zstandard

from tieredbuf.config import Compression
from tieredbuf.errors import CorruptError, UnsupportedVersionError
from tieredbuf.format._reader import Reader

if TYPE_CHECKING:
    import pyarrow as pa

BATCH_VERSION = 1
FOOTER_SIZE = 7
ZSTD_LEVEL = 3
_FOOTER = struct.Struct("<BIH")
_LEN = struct.Struct("<I")
MAX_RECORD_LEN = 0xFFFF_FFFF
# Decompressed size cap: a corrupt or hostile frame must not make us allocate
# without bound (I7).  Batches are flushed at ~flush_size_bytes (64 MiB default).
MAX_DECOMPRESSED = 1 << 31


def interleave_lengths(records: Sequence[bytes | memoryview]) -> list[bytes | memoryview]:
    """``[u32 len(r0), r0, u32 len(r1), r1, ...]``: the record block as parts, without a
    Python loop per record (the WAL's records entry uses the same layout)."""
    parts: list[bytes | memoryview] = [b""] * (2 * len(records))
    try:
        parts[0::2] = map(_LEN.pack, map(len, records))
    except struct.error as e:
        raise ValueError("a record exceeds the u32 length field") from e
    parts[1::2] = records
    return parts


def encode_footer(record_count: int, compression: Compression = Compression.NONE) -> bytes:
    """The 7-byte footer."""
    return _FOOTER.pack(int(compression), record_count, BATCH_VERSION)


def encode_records(records: Sequence[bytes | memoryview]) -> bytes:
    """The uncompressed record block."""
    return b"".join(interleave_lengths(records))


def _compressor() -> zstandard.ZstdCompressor:
    """Level 3, with the frame's content checksum (XXH64 of the records, RFC 8878 section
    3.1.1): a decoder checks it, so a changed byte is a CorruptError, never a wrong
    record.  A compressor is not safe to share between threads: one per call."""
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True)


def encode_batch_parts(
    records: Sequence[bytes | memoryview], compression: Compression = Compression.NONE
) -> list[bytes | memoryview]:
    """The data batch as a list of parts (uncompressed: the records themselves, no copy),
    for writers that can write a vector of buffers."""
    if len(records) > 0xFFFF_FFFF:
        raise ValueError("too many records for one batch")
    footer = encode_footer(len(records), compression)
    if compression == Compression.ZSTD:
        block = _compressor().compress(encode_records(records))
        return [block, footer]
    if compression != Compression.NONE:
        raise ValueError(f"unknown compression {compression!r}")
    return [*interleave_lengths(records), footer]


def encode_batch(
    records: Sequence[bytes | memoryview], compression: Compression = Compression.NONE
) -> bytes:
    """Encode ``records`` as one data batch."""
    return b"".join(encode_batch_parts(records, compression))


def decode_batch(data: bytes | memoryview, obj: str | None = None) -> list[bytes]:
    """Decode a data batch into its records; CorruptError names ``obj`` and the offset."""
    view = memoryview(data)
    if len(view) < FOOTER_SIZE:
        raise CorruptError("data batch", obj, 0, f"truncated: {len(view)} bytes, footer is 7")
    foot_at = len(view) - FOOTER_SIZE
    ctype, count, version = _FOOTER.unpack_from(view, foot_at)
    if version != BATCH_VERSION:
        raise UnsupportedVersionError("data batch", obj, foot_at + 5, f"unknown version {version}")
    block: bytes | memoryview = view[:foot_at]
    if ctype == Compression.ZSTD:
        block = _decompress(block, obj)
    elif ctype != Compression.NONE:
        raise CorruptError("data batch", obj, foot_at, f"unknown compression type {ctype}")
    # Each record costs at least 4 bytes: reject an impossible count before allocating.
    if count * 4 > len(block):
        raise CorruptError(
            "data batch",
            obj,
            foot_at + 1,
            f"record_count {count} cannot fit in a {len(block)}-byte block",
        )
    try:
        return _records(block, count, obj)
    except CorruptError as e:
        if ctype != Compression.ZSTD:
            raise
        # an offset in the decompressed bytes is not one in the object (I7): name the
        # compressed block, and where in its decompressed bytes the fault lies
        raise CorruptError(
            "data batch", obj, 0, f"decompressed block, at its offset {e.offset}: {e.detail}"
        ) from None


def _records(block: bytes | memoryview, count: int, obj: str | None) -> list[bytes]:
    r = Reader(block, "data batch", obj)
    out: list[bytes] = []
    for i in range(count):
        n = r.u32(f"record {i} length")
        out.append(bytes(r.take(n, f"record {i} data")))
    if r.remaining():
        raise r.fail(f"{r.remaining()} trailing bytes after {count} records")
    return out


_ZSTD_MAGIC = 0xFD2FB528
_SKIPPABLE_MAGIC, _SKIPPABLE_MASK = 0x184D2A50, 0xFFFFFFF0
_BLOCK_HEAD = 3
_BLOCK_RLE, _BLOCK_RESERVED = 1, 3


def _decompress(block: bytes | memoryview, obj: str | None) -> bytes:
    """The record block of a zstd batch, frame by frame (RFC 8878: a zstd stream is a
    sequence of frames; skippable frames are skipped).

    A frame that declares its content size is decoded in one call once the running total
    is known to stay under :data:`MAX_DECOMPRESSED`; a frame without one (a streaming
    encoder's) is fed to a streaming decompressor one zstd block at a time, so the
    output never runs more than one block (128 KiB) past the cap before it is refused.
    Every error names the offset of the frame (or block) it is about (I7)."""
    view = memoryview(block)
    out: list[bytes] = []
    total = 0
    if not len(view):
        raise CorruptError("data batch", obj, 0, "zstd block holds no frame")
    for start, blocks, content_size, end in _zstd_frames(view, obj):
        if blocks is None:
            continue  # skippable frame
        try:
            if content_size != zstandard.CONTENTSIZE_UNKNOWN:
                if total + content_size > MAX_DECOMPRESSED:
                    raise CorruptError(
                        "data batch",
                        obj,
                        start,
                        f"zstd frame declares {content_size} bytes: the block would "
                        f"exceed {MAX_DECOMPRESSED}",
                    )
                piece: bytes = zstandard.ZstdDecompressor().decompress(view[start:end])
                if len(piece) != content_size:
                    raise CorruptError(
                        "data batch",
                        obj,
                        start,
                        f"zstd frame gave {len(piece)} of {content_size} bytes",
                    )
                out.append(piece)
                total += len(piece)
                continue
            dobj = zstandard.ZstdDecompressor().decompressobj()
            at = start
            for cut in blocks:
                piece = dobj.decompress(view[at:cut])
                at = cut
                total += len(piece)
                if total > MAX_DECOMPRESSED:
                    raise CorruptError(
                        "data batch",
                        obj,
                        start,
                        f"zstd frame inflates past {MAX_DECOMPRESSED} bytes",
                    )
                out.append(piece)
            if not dobj.eof:
                raise CorruptError("data batch", obj, start, "zstd frame does not end")
        except zstandard.ZstdError as e:
            raise CorruptError("data batch", obj, start, f"zstd frame: {e}") from e
    return out[0] if len(out) == 1 else b"".join(out)


def _zstd_frames(view: memoryview, obj: str | None) -> list[tuple[int, list[int] | None, int, int]]:
    """``(start, block_ends, content_size, end)`` of every frame in ``view``, from the
    frame and block headers alone (``block_ends`` is None for a skippable frame).  A frame
    that runs past the block, a reserved block type or a trailing partial frame is
    refused with the offset where it starts."""
    frames: list[tuple[int, list[int] | None, int, int]] = []
    pos, n = 0, len(view)
    while pos < n:
        if n - pos < 8:
            raise CorruptError(
                "data batch", obj, pos, f"{n - pos} trailing bytes cannot hold a zstd frame"
            )
        (magic,) = _LEN.unpack_from(view, pos)
        if magic & _SKIPPABLE_MASK == _SKIPPABLE_MAGIC:
            (size,) = _LEN.unpack_from(view, pos + 4)
            if size > n - pos - 8:
                raise CorruptError(
                    "data batch",
                    obj,
                    pos,
                    f"skippable zstd frame of {size} bytes runs past the block",
                )
            frames.append((pos, None, 0, pos + 8 + size))
            pos += 8 + size
            continue
        if magic != _ZSTD_MAGIC:
            raise CorruptError("data batch", obj, pos, f"not a zstd frame (magic {magic:#010x})")
        head = bytes(view[pos : pos + 18])
        try:
            params = zstandard.get_frame_parameters(head)
            at = pos + zstandard.frame_header_size(head)
        except zstandard.ZstdError as e:
            raise CorruptError("data batch", obj, pos, f"zstd frame header: {e}") from e
        if params.dict_id:
            raise CorruptError(
                "data batch", obj, pos, f"zstd frame needs dictionary {params.dict_id}"
            )
        ends: list[int] = []
        while True:
            if n - at < _BLOCK_HEAD:
                raise CorruptError("data batch", obj, pos, "zstd frame runs past the block")
            word = view[at] | view[at + 1] << 8 | view[at + 2] << 16
            last, kind, size = word & 1, (word >> 1) & 3, word >> 3
            if kind == _BLOCK_RESERVED:
                raise CorruptError("data batch", obj, at, "zstd block of reserved type 3")
            at += _BLOCK_HEAD + (1 if kind == _BLOCK_RLE else size)
            if at > n:
                raise CorruptError("data batch", obj, pos, "zstd frame runs past the block")
            ends.append(at)
            if last:
                break
        if params.has_checksum:
            at += 4
            if at > n:
                raise CorruptError(
                    "data batch", obj, pos, "zstd frame checksum runs past the block"
                )
            ends[-1] = at
        frames.append((pos, ends, params.content_size, at))
        pos = at
    return frames


# Above this size the vectorised decoder falls back to decode_batch (int32 offsets).
_ARROW_FAST_LIMIT = 1 << 30


def decode_batch_arrow(data: bytes | memoryview, obj: str | None = None) -> pa.Array:
    """The records of a data batch as one Arrow ``binary`` array.

    No Python object per record: the length prefixes are walked once and the record
    bytes gathered with one vectorised mask.  Checks exactly what :func:`decode_batch`
    checks and raises the same CorruptError; compressed or >1 GiB batches go through it.
    """
    import numpy as np
    import pyarrow as pa

    view = memoryview(data)
    if len(view) < FOOTER_SIZE or len(view) > _ARROW_FAST_LIMIT:
        return pa.array(decode_batch(data, obj=obj), pa.binary())
    foot_at = len(view) - FOOTER_SIZE
    ctype, count, version = _FOOTER.unpack_from(view, foot_at)
    if version != BATCH_VERSION or ctype != Compression.NONE or count * 4 > foot_at:
        return pa.array(decode_batch(data, obj=obj), pa.binary())  # raises or decompresses
    if count:
        fixed = _fixed_width(view, foot_at, count)
        if fixed is not None:
            return fixed
    starts_list: list[int] = []
    append = starts_list.append
    pos = 0
    unpack = _LEN.unpack_from
    try:
        for _ in range(count):  # the one per-record Python step: ~0.19 us a record
            append(pos)
            pos += 4 + unpack(view, pos)[0]
    except struct.error:
        pos = foot_at + 1  # a length prefix ran past the block: decode_batch names it
    if pos != foot_at:
        decode_batch(data, obj=obj)  # raises the precise CorruptError
        raise CorruptError("data batch", obj, pos, "record lengths do not add up")
    starts = np.array(starts_list, dtype=np.int64)
    lens = np.diff(starts, append=foot_at) - 4
    raw = np.frombuffer(view, dtype=np.uint8, count=foot_at)
    keep = np.ones(foot_at, dtype=bool)
    keep[(starts[:, None] + np.arange(4)).ravel()] = False
    offsets = np.zeros(count + 1, dtype=np.int32)
    np.cumsum(lens, out=offsets[1:])
    return pa.Array.from_buffers(
        pa.binary(), count, [None, pa.py_buffer(offsets), pa.py_buffer(raw[keep])]
    )


def _fixed_width(view: memoryview, foot_at: int, count: int) -> pa.Array | None:
    """The records as an Arrow array when all ``count`` have the first one's length
    (one reshape instead of walking the prefixes); None otherwise."""
    import numpy as np
    import pyarrow as pa

    (k,) = _LEN.unpack_from(view, 0)
    if count * (k + 4) != foot_at:
        return None
    rows = np.frombuffer(view, dtype=np.uint8, count=foot_at).reshape(count, k + 4)
    if not (rows[:, :4] == rows[0, :4]).all():
        return None
    values = np.ascontiguousarray(rows[:, 4:]).reshape(-1)
    offsets = np.arange(count + 1, dtype=np.int32) * np.int32(k)
    return pa.Array.from_buffers(
        pa.binary(), count, [None, pa.py_buffer(offsets), pa.py_buffer(values)]
    )
