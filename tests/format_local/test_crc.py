"""format/crc.py computes zlib's CRC32 (IEEE), whichever implementation it uses: every
WAL entry, segment trailer and ``.batch`` sidecar CRC stays readable by plain zlib."""

from __future__ import annotations

import os
import zlib

import pyarrow as pa
import pytest

from tieredbuf.format import crc


@pytest.mark.parametrize("n", [0, 1, 7, 64, 1000, 4096, 65_537, 1 << 20])
def test_crc32_is_zlibs(n: int) -> None:
    data = os.urandom(n)
    assert crc.crc32(data, 0) == zlib.crc32(data)
    assert crc.crc32(memoryview(data)[n // 3 :], 0) == zlib.crc32(data[n // 3 :])
    assert crc.crc32(pa.py_buffer(data), 0) == zlib.crc32(data)


def test_crc32_chains_like_zlib() -> None:
    parts = [os.urandom(n) for n in (5, 1024, 70_001, 3)]
    value = 0
    for p in parts:
        value = crc.crc32(p, value)
    assert value == zlib.crc32(b"".join(parts))
    assert crc.crc32(b"abc", 0xDEADBEEF) == zlib.crc32(b"abc", 0xDEADBEEF)


def test_the_fast_implementation_is_installed() -> None:
    """isal is a runtime dependency (pyproject.toml); zlib is only its fallback."""
    assert crc.implementation == "isal"
