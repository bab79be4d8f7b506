"""A bounds-checked little-endian reader shared by the pure codecs (invariant I7).

Every read checks the remaining length first, so a decoder never allocates from
an unchecked length and every failure names the object and the byte offset.
"""

from __future__ import annotations

import struct

from tieredbuf.errors import CorruptError

_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")


class Reader:
    """Reads fields from ``buf[pos:end]``; errors name ``what`` and ``obj``."""

    __slots__ = ("buf", "end", "obj", "pos", "what")

    def __init__(
        self,
        buf: bytes | memoryview,
        what: str,
        obj: str | None,
        pos: int = 0,
        end: int | None = None,
    ) -> None:
        self.buf = memoryview(buf) if not isinstance(buf, memoryview) else buf
        self.what = what
        self.obj = obj
        self.pos = pos
        self.end = len(self.buf) if end is None else end

    def remaining(self) -> int:
        return self.end - self.pos

    def fail(self, detail: str, offset: int | None = None) -> CorruptError:
        return CorruptError(self.what, self.obj, self.pos if offset is None else offset, detail)

    def need(self, n: int, field: str) -> None:
        if n < 0 or n > self.end - self.pos:
            raise self.fail(f"truncated: {field} needs {n} bytes, {self.end - self.pos} remain")

    def _unpack(self, s: struct.Struct, field: str) -> int:
        self.need(s.size, field)
        (v,) = s.unpack_from(self.buf, self.pos)
        self.pos += s.size
        return int(v)

    def u8(self, field: str) -> int:
        return self._unpack(_U8, field)

    def u16(self, field: str) -> int:
        return self._unpack(_U16, field)

    def u32(self, field: str) -> int:
        return self._unpack(_U32, field)

    def u64(self, field: str) -> int:
        return self._unpack(_U64, field)

    def i64(self, field: str) -> int:
        return self._unpack(_I64, field)

    def take(self, n: int, field: str) -> memoryview:
        self.need(n, field)
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out


def pack_u32(v: int) -> bytes:
    return _U32.pack(v)
