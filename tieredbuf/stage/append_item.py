"""What one append carries into the stage (and the ack it gets back), and the stage
directory's own files.

An append's WAL entry body and CRC are encoded before the stage lock is taken (only
the 17-byte head is framed under it); a records segment sealed without compression
reuses the body's record block instead of laying the records out again.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
from ulid import ULID

from tieredbuf import keys
from tieredbuf.config import Compression
from tieredbuf.errors import StageLockedError
from tieredbuf.format import wal as wal_fmt
from tieredbuf.stage.filesystem import FileSystem

PRODUCER_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True, slots=True)
class StageAck:
    """A LOCAL ack: the entry's per-core sequence and (``wal`` durability) WAL range."""

    sequence: int
    wal_start: int | None
    wal_end: int | None


@dataclass(frozen=True, slots=True)
class BundleOrRecords:
    records: Sequence[bytes] = ()
    metadata: bytes = b""
    bundle: Mapping[int, pa.RecordBatch] | None = None
    entry: wal_fmt.EntryBody | None = None
    """The WAL entry's body and CRC, encoded outside the stage lock."""
    size: int | None = None
    """Records: the accumulator's byte count for them, computed outside the lock."""
    block: memoryview | None = None
    """Records: the record block inside ``entry`` (see RecordsAccumulator.blocks)."""

    def encode(self, seq: int, ts: int) -> list[bytes | memoryview]:
        assert self.entry is not None
        return wal_fmt.frame_entry(seq, ts, self.entry)


def lock_stage(fs: FileSystem, path: Path) -> int:
    try:
        fd = fs.lock(path)
    except BlockingIOError as e:
        raise StageLockedError(f"{path.parent} is locked by another process") from e
    fs.ftruncate(fd, 0)
    fs.write_all(fd, [f"{os.getpid()}\n".encode()])
    return fd


def default_producer_id(fs: FileSystem, root: Path) -> str:
    """The id kept in ``<staging_dir>/producer.id`` (a new ULID the first time)."""
    p = root / keys.STAGE_ID_NAME
    raw = fs.read_if_exists(p)
    if raw is not None and PRODUCER_ID_RE.match(raw.decode(errors="replace").strip()):
        return raw.decode().strip()
    pid = str(ULID())
    fs.write_atomic(p, [pid.encode() + b"\n"])
    return pid


def records_item(
    records: Sequence[bytes], metadata: bytes, wal: bool, compression: Compression
) -> tuple[BundleOrRecords, int]:
    """A ``produce(entries, metadata)`` call, encoded for the WAL when ``wal``; returns
    it with the bytes it counts against the caps."""
    size = sum(map(len, records)) + 4 * len(records) + len(metadata)
    entry = wal_fmt.records_body(records, metadata) if wal else None
    # the segment reuses the WAL body's record block instead of interleaving the
    # records again at seal (only without compression: a compressed segment needs
    # the records)
    block = (
        wal_fmt.records_block(entry, metadata)
        if entry is not None and compression == Compression.NONE
        else None
    )
    item = BundleOrRecords(
        records=records, metadata=metadata, entry=entry, size=size + 16, block=block
    )
    return item, size + 64


def bundle_item(bundle: Mapping[int, pa.RecordBatch], wal: bool) -> tuple[BundleOrRecords, int]:
    """One Arrow bundle (slot id 0..63 -> RecordBatch), encoded for the WAL when ``wal``."""
    for slot in bundle:
        if not 0 <= slot < wal_fmt.MAX_SLOTS:
            raise ValueError(f"slot id {slot} outside 0..{wal_fmt.MAX_SLOTS - 1}")
    n = sum(b.get_total_buffer_size() for b in bundle.values()) + 64
    entry = (
        wal_fmt.entry_body(wal_fmt.ENTRY_RECORD_BUNDLE, wal_fmt.bundle_body(bundle))
        if wal
        else None
    )
    return BundleOrRecords(bundle=bundle, entry=entry), n
