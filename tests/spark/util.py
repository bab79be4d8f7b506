"""Helpers for the Spark tests: build buffers with known contents, read them back."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
from ulid import ULID

import tieredbuf
from tieredbuf import keys
from tieredbuf.format.batch import encode_batch
from tieredbuf.format.manifest import MetadataItem, NewEntry
from tieredbuf.format.segment import SegmentBundle, encode_segment

_pseq: dict[str, int] = {}


def append_records(
    buf: tieredbuf.Buffer, groups: list[list[bytes]], ts_ms: int, payload: bytes = b"m"
) -> int:
    """One .batch object of ``groups`` (one metadata item per group, all at ``ts_ms``),
    appended to the queue; returns its sequence."""
    records = [r for g in groups for r in g]
    items, at = [], 0
    for i, g in enumerate(groups):
        items.append(MetadataItem(at, ts_ms, payload + str(i).encode()))
        at += len(g)
    key = keys.data_key(ULID(), keys.BATCH_SUFFIX)
    buf.store.put(key, encode_batch(records), mode="create")
    return _append(buf, key, tuple(items))


def append_bundles(buf: tieredbuf.Buffer, batches: list[dict[int, pa.RecordBatch]],
                   ts_ms: int = 1_000) -> int:
    body = encode_segment(
        SegmentBundle(b, ts_ms * 1_000_000, i) for i, b in enumerate(batches)
    )
    key = keys.data_key(ULID(), keys.SEGMENT_SUFFIX)
    buf.store.put(key, body, mode="create")
    return _append(buf, key, (MetadataItem(0, ts_ms, b""),))


def _append(buf: tieredbuf.Buffer, key: str, items: tuple[MetadataItem, ...]) -> int:
    pid = f"test-{buf.url}"
    _pseq[pid] = _pseq.get(pid, 0) + 1
    (seq,) = buf.queue.append([NewEntry(key, items)], pid, _pseq[pid])
    assert seq is not None
    return seq


def rows(df: Any) -> list[tuple[Any, ...]]:
    return [tuple(r) for r in df.collect()]


def consume_all(buf: tieredbuf.Buffer) -> list[tuple[int, list[bytes]]]:
    """Everything in the queue, read with the plain fenced consumer."""
    out = []
    c = buf.consumer()
    c.initialize()
    try:
        while (b := c.next_batch()) is not None:
            out.append((b.sequence, b.entries))
    finally:
        c.close()
    return out
