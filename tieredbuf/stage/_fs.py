"""Small durable-file helpers: the only place the stage spells out fsync ordering."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, parts: Iterable[bytes | memoryview | pa.Buffer]) -> int:
    """Write every part (handles short writes); returns the byte count."""
    total = 0
    for p in parts:
        view = memoryview(p)
        while view:
            n = os.write(fd, view)
            total += n
            view = view[n:]
    return total


def write_atomic(
    path: Path, parts: Iterable[bytes | memoryview | pa.Buffer], mode: int = 0o644
) -> int:
    """tmp -> fdatasync -> rename -> directory fsync: readers see the old or the new file."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        n = write_all(fd, parts)
        os.fdatasync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)
    fsync_dir(path.parent)
    return n


def read_if_exists(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
