"""The tail of a Quiver segment alone: footer, stream directory and batch manifest
parsed from a suffix GET, and single streams decoded from ranged GETs (otel-arrow's
Quiver; the layout is in :mod:`tieredbuf.format.segment`).  Pure codec: no I/O."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import pyarrow as pa

from tieredbuf.errors import CorruptError, UnsupportedVersionError
from tieredbuf.format.segment import (
    FOOTER,
    FOOTER_V1_SIZE,
    SEGMENT_MAGIC,
    SEGMENT_VERSION,
    TRAILER_HEAD,
    TRAILER_SIZE,
    U32,
    WHAT,
    StreamInfo,
    directory_rows,
    manifest_rows,
    read_section,
)
from tieredbuf.format.wal import describe_error, schema_fingerprint

SEGMENT_TAIL_GUESS = 64 << 10
"""A first suffix GET of this many bytes holds a typical segment's whole tail."""
_IPC_FILE_MAGIC = b"ARROW1\x00\x00"
_IPC_CONTINUATION = 0xFFFFFFFF
_I32 = struct.Struct("<i")


@dataclass(frozen=True, slots=True)
class TailBundle:
    """One batch manifest row: its ``(slot, stream_id, chunk_index)`` refs (ingestion
    time and sequence are None when the manifest has only Quiver's two columns)."""

    refs: tuple[tuple[int, int, int], ...]
    ingestion_ts_nanos: int | None
    sequence: int | None


@dataclass(frozen=True, slots=True)
class SegmentTail:
    """What the last :attr:`size` - :attr:`tail_offset` bytes of a segment say."""

    size: int
    """The segment's total size in bytes."""
    tail_offset: int
    """Where the tail (stream directory, batch manifest, footer, trailer) starts."""
    streams: tuple[StreamInfo, ...]
    bundles: tuple[TailBundle, ...]
    obj: str | None = None
    """The object named in errors."""

    def stream_bundles(self, stream_id: int) -> tuple[int, ...]:
        """The bundle index of each chunk of ``stream_id``, in chunk order."""
        return chunk_bundles(self, stream_id, self.obj)


def _tail_footer(
    tail: bytes | memoryview, obj: str | None, file_size: int | None
) -> tuple[int, int, int, int, int, int, int, int]:
    """(size, f_at, stream_count, bundle_count, dir_off, dir_len, man_off, man_len), with
    f_at and the offsets absolute in the segment."""
    view = memoryview(tail)
    n = len(view)
    # Until the footer is read, an offset is absolute when file_size is known, else
    # negative: counted from the end of the segment (-16 is the trailer's first byte).
    end = 0 if file_size is None else file_size
    if n < TRAILER_SIZE + FOOTER_V1_SIZE:
        raise CorruptError(
            WHAT,
            obj,
            max(end - n, 0) if file_size is not None else -n,
            f"truncated: {n} bytes cannot hold footer and trailer",
        )
    t_rel = n - TRAILER_SIZE
    footer_size, magic = TRAILER_HEAD.unpack_from(view, t_rel)
    if magic != SEGMENT_MAGIC:
        raise CorruptError(WHAT, obj, end - TRAILER_SIZE + 4, f"bad trailer magic {magic!r}")
    if not 2 <= footer_size <= t_rel:
        raise CorruptError(WHAT, obj, end - TRAILER_SIZE, f"footer_size {footer_size} out of range")
    f_rel = t_rel - footer_size
    (version,) = struct.unpack_from("<H", view, f_rel)
    if version != SEGMENT_VERSION:
        raise UnsupportedVersionError(
            WHAT, obj, end - TRAILER_SIZE - footer_size, f"unknown footer version {version}"
        )
    if footer_size < FOOTER_V1_SIZE:
        raise CorruptError(
            WHAT, obj, end - TRAILER_SIZE, f"footer_size {footer_size} < {FOOTER_V1_SIZE}"
        )
    (_, scount, bcount, dir_off, dir_len, man_off, man_len) = FOOTER.unpack_from(view, f_rel)
    if file_size is None:
        f_at = man_off + man_len  # SegmentBuilder writes the manifest right before the footer
        size = f_at + footer_size + TRAILER_SIZE
    else:
        size = file_size
        f_at = size - TRAILER_SIZE - footer_size
        if f_at < 0:
            raise CorruptError(WHAT, obj, 0, f"file_size {size} cannot hold the footer")
    for name, off, length, field_at in (
        ("stream directory", dir_off, dir_len, 10),
        ("batch manifest", man_off, man_len, 22),
    ):
        if off + length > f_at:  # named at the footer field that says so
            raise CorruptError(
                WHAT, obj, f_at + field_at, f"{name} [{off}, {off + length}) runs past {f_at}"
            )
    return size, f_at, scount, bcount, dir_off, dir_len, man_off, man_len


def segment_tail_size(
    tail: bytes | memoryview, obj: str | None = None, file_size: int | None = None
) -> int:
    """How many trailing bytes of the segment :func:`parse_segment_tail` needs, read from
    ``tail``: its last bytes (at least ``TRAILER_SIZE + FOOTER_V1_SIZE`` of them).

    Two ranged GETs at most: a suffix of :data:`SEGMENT_TAIL_GUESS` bytes, then -- only
    when this says more -- a suffix of exactly this many.  ``file_size`` (when known)
    is the segment's size; without it the manifest is taken to end at the footer, as
    :class:`SegmentBuilder` writes it.  Raises CorruptError on bad bytes."""
    size, _, _, _, dir_off, _, man_off, _ = _tail_footer(tail, obj, file_size)
    return size - min(dir_off, man_off)


def parse_segment_tail(
    tail: bytes | memoryview, obj: str | None = None, file_size: int | None = None
) -> SegmentTail:
    """The stream directory and batch manifest of a segment, from its last bytes only
    (at least :func:`segment_tail_size` of them).  Pure codec, no I/O; the same checks
    as :class:`SegmentReader` except the CRC (which covers the whole file).  Raises
    CorruptError (UnsupportedVersionError for an unknown footer version) naming
    ``obj`` and the absolute offset."""
    view = memoryview(tail)
    size, _, scount, bcount, dir_off, dir_len, man_off, man_len = _tail_footer(view, obj, file_size)
    base = size - len(view)
    if min(dir_off, man_off) < base:
        raise CorruptError(
            WHAT, obj, max(base, 0), f"tail of {len(view)} bytes misses the sections before {base}"
        )
    d = read_section(
        pa.py_buffer(view[dir_off - base : dir_off - base + dir_len]),
        dir_off,
        obj,
        "stream directory",
        scount,
    )
    streams = directory_rows(d, dir_off, obj)
    m = read_section(
        pa.py_buffer(view[man_off - base : man_off - base + man_len]),
        man_off,
        obj,
        "batch manifest",
        bcount,
    )
    bundles = [TailBundle(*row) for row in manifest_rows(m, streams, man_off, obj)]
    return SegmentTail(size, min(dir_off, man_off), streams, tuple(bundles), obj)


def chunk_bundles(tail: SegmentTail, stream_id: int, obj: str | None = None) -> tuple[int, ...]:
    """The bundle index of each chunk of stream ``stream_id``, in chunk order;
    CorruptError unless the manifest refers to every chunk exactly once."""
    return bundles_by_stream(tail, obj, only=stream_id)[stream_id]


def bundles_by_stream(
    tail: SegmentTail, obj: str | None = None, only: int | None = None
) -> dict[int, tuple[int, ...]]:
    """:func:`chunk_bundles` of every stream (or of stream ``only``), in one pass."""
    obj = tail.obj if obj is None else obj
    out = {
        s.stream_id: [-1] * s.chunk_count
        for s in tail.streams
        if only is None or s.stream_id == only
    }
    for b, bundle in enumerate(tail.bundles):
        for _, sid, chunk in bundle.refs:
            chunks = out.get(sid)
            if chunks is not None:
                if chunks[chunk] != -1:
                    raise CorruptError(
                        WHAT, obj, tail.tail_offset, f"stream {sid} chunk {chunk} is in two bundles"
                    )
                chunks[chunk] = b
    for sid, chunks in out.items():
        if -1 in chunks:
            raise CorruptError(
                WHAT,
                obj,
                tail.tail_offset,
                f"stream {sid} chunk {chunks.index(-1)} is in no bundle",
            )
    return {sid: tuple(chunks) for sid, chunks in out.items()}


def stream_schema_size(head: bytes | memoryview, stream: StreamInfo, obj: str | None = None) -> int:
    """How many leading bytes of ``stream`` hold its schema message, from its first 16
    (fewer only when the stream is that short)."""
    view = memoryview(head)
    at = stream.byte_offset
    if len(view) < 16 or bytes(view[:8]) != _IPC_FILE_MAGIC:
        raise CorruptError(WHAT, obj, at, f"stream {stream.stream_id}: no Arrow file magic")
    (cont,) = U32.unpack_from(view, 8)
    if cont == _IPC_CONTINUATION:
        n: int = _I32.unpack_from(view, 12)[0]
        need = 16 + n
    else:
        n = _I32.unpack_from(view, 8)[0]
        need = 12 + n
    if n <= 0 or need > stream.byte_length:
        raise CorruptError(
            WHAT, obj, at + 8, f"stream {stream.stream_id}: schema message length {n} out of range"
        )
    return need


def parse_stream_schema(
    head: bytes | memoryview, stream: StreamInfo, obj: str | None = None
) -> pa.Schema:
    """``stream``'s schema from its first :func:`stream_schema_size` bytes (or more);
    CorruptError unless it decodes and matches the directory's fingerprint."""
    need = stream_schema_size(head, stream, obj)
    view = memoryview(head)
    if len(view) < need:
        raise CorruptError(
            WHAT,
            obj,
            stream.byte_offset,
            f"stream {stream.stream_id}: {len(view)} bytes, schema needs {need}",
        )
    try:
        schema = pa.ipc.read_schema(pa.py_buffer(view[8:need]))
        ok = schema_fingerprint(schema) == stream.schema_fingerprint
    except Exception as e:  # any failure decoding untrusted Arrow bytes (I7)
        raise CorruptError(
            WHAT, obj, stream.byte_offset, f"stream {stream.stream_id} schema: {describe_error(e)}"
        ) from e
    if not ok:
        raise CorruptError(
            WHAT,
            obj,
            stream.byte_offset,
            f"stream {stream.stream_id} schema disagrees with its fingerprint",
        )
    return schema


def decode_stream(
    data: pa.Buffer | bytes | memoryview, stream: StreamInfo, obj: str | None = None
) -> list[pa.RecordBatch]:
    """The chunks of one stream from exactly its bytes (``[byte_offset, byte_offset +
    byte_length)`` of the segment), fully validated (no CRC covers a ranged read)."""
    buf = data if isinstance(data, pa.Buffer) else pa.py_buffer(data)
    at = stream.byte_offset
    if buf.size != stream.byte_length:
        raise CorruptError(
            WHAT,
            obj,
            at,
            f"stream {stream.stream_id}: {buf.size} bytes, directory says {stream.byte_length}",
        )
    try:
        f = pa.ipc.open_file(buf)
        ok = (
            f.num_record_batches == stream.chunk_count
            and schema_fingerprint(f.schema) == stream.schema_fingerprint
        )
        batches = [f.get_batch(i) for i in range(f.num_record_batches)] if ok else []
        for b in batches:
            b.validate(full=True)
    except Exception as e:  # any failure decoding untrusted Arrow bytes (I7)
        raise CorruptError(WHAT, obj, at, f"stream {stream.stream_id}: {describe_error(e)}") from e
    if not ok:
        raise CorruptError(WHAT, obj, at, f"stream {stream.stream_id} disagrees with the directory")
    return batches
