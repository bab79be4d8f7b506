"""Is a sealed segment's file intact?  Its size and CRC against its sidecar (I7).

Checked when a stage opens (recovery) and before every export: bad bytes are
quarantined and reported, never uploaded (format-local.md, "Quarantine")."""

from __future__ import annotations

from pathlib import Path

from tieredbuf.format.crc import crc32
from tieredbuf.format.segment import SEGMENT_MAGIC, TRAILER_SIZE
from tieredbuf.stage.filesystem import FileSystem
from tieredbuf.stage.sealed_segment import QSEG, SealedSegment


def verify(seg: SealedSegment, data: bytes | memoryview | None = None) -> str | None:
    """None when ``seg``'s bytes (``data``, else read from its file) match its CRC;
    otherwise what is wrong."""
    if data is None:
        data = seg.path.read_bytes()
    view = memoryview(data)
    if len(view) != seg.size:
        return f"{len(view)} bytes, the sidecar says {seg.size}"
    if seg.stream == QSEG:
        if len(view) < TRAILER_SIZE or bytes(view[-12:-4]) != SEGMENT_MAGIC:
            return "no segment trailer"
        stored = int.from_bytes(view[-4:], "little")
        actual = crc32(view[:-4], 0)
    elif seg.crc32 is None:
        return None
    else:
        stored, actual = seg.crc32, crc32(view, 0)
    if stored != actual:
        return f"CRC mismatch: stored {stored:#010x}, computed {actual:#010x}"
    return None


def verify_file(fs: FileSystem, seg: SealedSegment, path: Path | None = None) -> str | None:
    """:func:`verify` over the file's pages in place (``path``, else ``seg.path``): no
    copy of its bytes in this process's memory."""
    with fs.read_view(seg.path if path is None else path) as view:
        return verify(seg, view)
