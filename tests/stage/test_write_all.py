"""FileSystem.write_all: every byte in order, in writev calls of at most WRITE_CHUNK
bytes (a big part is cut into views), whatever mix of part sizes and types."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pyarrow as pa
import pytest

from tieredbuf.stage.filesystem import WRITE_CHUNK, FileSystem


class _Recording(FileSystem):
    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def writev(self, fd: int, buffers: list[object]) -> int:  # type: ignore[override]
        n = os.writev(fd, buffers)  # type: ignore[arg-type]
        self.sizes.append(n)
        return n


@pytest.mark.slow
def test_write_all_keeps_bytes_and_order_in_bounded_writes(tmp_path: Path) -> None:
    rnd = random.Random(7)
    sizes = [0, 1, 100, 4096, WRITE_CHUNK - 1, WRITE_CHUNK, WRITE_CHUNK + 1, 3 * WRITE_CHUNK]
    for trial in range(60):
        parts: list[bytes | pa.Buffer] = []
        for _ in range(rnd.randint(0, 30)):
            n = rnd.choice([*sizes, rnd.randint(0, 5 * WRITE_CHUNK)])
            b = bytes([rnd.randrange(256)]) * n if n > 4096 else os.urandom(n)
            parts.append(pa.py_buffer(b) if rnd.random() < 0.3 else b)
        fs = _Recording()
        path = tmp_path / f"f{trial}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            written = fs.write_all(fd, parts)
        finally:
            os.close(fd)
        expected = b"".join(bytes(p) for p in parts)
        assert written == len(expected)
        assert path.read_bytes() == expected
        assert all(s <= WRITE_CHUNK for s in fs.sizes), (trial, max(fs.sizes))
