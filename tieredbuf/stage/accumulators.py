"""Open segments: what an append adds to until its segment is sealed.

One accumulator per stream is open at a time (stage/stage_state.py): records go to a
:class:`RecordsAccumulator` (sealed as a ``.batch``), Arrow bundles to a
:class:`BundleAccumulator` (sealed as a ``.qseg``).  Each remembers the sequences and
WAL range of its entries; SegmentDir.prepare (stage/segments.py) encodes it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import pyarrow as pa

from tieredbuf.format.batch import interleave_lengths
from tieredbuf.format.manifest import MetadataItem
from tieredbuf.format.segment import SegmentBuilder, SegmentBundle
from tieredbuf.stage.append_item import StageAck
from tieredbuf.stage.sealed_segment import BATCH, QSEG


@dataclass(slots=True)
class _Common:
    opened_at: float = field(default_factory=time.monotonic)
    seqs: list[int] = field(default_factory=list)
    wal_start: int | None = None
    wal_end: int | None = None
    futures: list[tuple[Future[StageAck], StageAck]] = field(default_factory=list)
    """segment_only: acks completed when this segment is sealed."""

    def note(self, seq: int, wal_start: int | None, wal_end: int | None) -> None:
        self.seqs.append(seq)
        if wal_start is not None and wal_end is not None:
            self.wal_start = wal_start if self.wal_start is None else self.wal_start
            self.wal_end = wal_end


@dataclass(slots=True)
class RecordsAccumulator(_Common):
    records: list[bytes] = field(default_factory=list)
    """Records of the add() calls that came without an encoded ``block``."""
    items: list[MetadataItem] = field(default_factory=list)
    blocks: list[bytes | memoryview | None] = field(default_factory=list)
    """Per add(): its records already laid out as ``u32 len, bytes`` pairs (a view of
    the WAL entry body, which holds exactly that: no second copy is kept), or None."""
    count: int = 0
    """Records in all."""
    nbytes: int = 0
    stream: str = BATCH

    def add(
        self,
        records: Sequence[bytes],
        metadata: bytes,
        ingestion_ts_nanos: int,
        nbytes: int | None = None,
        block: bytes | memoryview | None = None,
    ) -> None:
        """``nbytes``: the caller's precomputed ``sum(len(r) + 4) + len(metadata) + 16``;
        ``block``: ``records`` encoded as the batch format's uncompressed record block
        (only for segments sealed without compression)."""
        self.items.append(
            MetadataItem(self.count, ingestion_ts_nanos // 1_000_000, bytes(metadata))
        )
        self.count += len(records)
        self.blocks.append(block)
        if block is None:
            self.records.extend(records)
        if nbytes is None:
            nbytes = sum(len(r) + 4 for r in records) + len(metadata) + 16
        self.nbytes += nbytes

    def drop_buffers(self) -> None:
        """After the segment is written: release the records (seqs, items stay)."""
        self.records = []
        self.blocks = []

    def has_blocks(self) -> bool:
        return any(b is not None for b in self.blocks)

    def block_parts(self) -> list[bytes | memoryview]:
        """The uncompressed record block (every record as ``u32 len, bytes``) as
        buffers for ``writev``: one per add() that came with a block, two per record
        otherwise."""
        if not self.has_blocks():
            return interleave_lengths(self.records)
        out: list[bytes | memoryview] = []
        ends = [i.start_index for i in self.items[1:]] + [self.count]
        pos = 0
        for item, end, block in zip(self.items, ends, self.blocks, strict=True):
            if block is not None:
                out.append(block)
            else:
                n = end - item.start_index
                out += interleave_lengths(self.records[pos : pos + n])
                pos += n
        return out

    def __len__(self) -> int:
        return len(self.items)


@dataclass(slots=True)
class BundleAccumulator(_Common):
    builder: SegmentBuilder = field(default_factory=SegmentBuilder)
    stream: str = QSEG

    def add(
        self, bundle: Mapping[int, pa.RecordBatch], ingestion_ts_nanos: int, sequence: int
    ) -> None:
        self.builder.add(SegmentBundle(dict(bundle), ingestion_ts_nanos, sequence))

    @property
    def nbytes(self) -> int:
        return self.builder.nbytes

    def drop_buffers(self) -> None:
        """After the segment is written: release the batches."""
        self.builder = SegmentBuilder()

    def __len__(self) -> int:
        return len(self.builder)


Accumulator = RecordsAccumulator | BundleAccumulator
