"""Helpers for the Spark tests: build buffers with known contents, read them back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
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


def append_bundles(
    buf: tieredbuf.Buffer, batches: list[dict[int, pa.RecordBatch]], ts_ms: int = 1_000
) -> int:
    body = encode_segment(SegmentBundle(b, ts_ms * 1_000_000, i) for i, b in enumerate(batches))
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


LATE_WORKER = Path(__file__).with_name("late_worker.py")


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def after(t_ms: int, timeout_s: float = 5.0) -> int:
    """Wait until the wall clock is past ``t_ms`` (ingestion times are ms); returns now."""
    deadline = time.monotonic() + timeout_s
    while (now := now_ms()) <= t_ms:
        assert time.monotonic() < deadline, "the clock did not move"
        time.sleep(0.001)
    return now


def kill_after_local_acks(url: str, stage: Path, tag: str, n: int) -> list[bytes]:
    """A staged producer process acks ``n`` records LOCAL and is killed with SIGKILL
    before any of them reached the store; returns the acked records."""
    proc = subprocess.Popen(
        [sys.executable, str(LATE_WORKER), url, str(stage), tag, str(n)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    acked = []
    for line in proc.stdout:
        if line.startswith("ACK "):
            acked.append(line[4:].strip().encode())
        if line.strip() == "DONE":
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read() if proc.stderr else ""
    for f in (proc.stdin, proc.stdout, proc.stderr):
        if f is not None:
            f.close()
    assert len(acked) == n
    return acked


def drain_stage(buf: tieredbuf.Buffer, stage: Path) -> None:
    """``tieredbuf drain``: recover the dead producer's WAL and append it, now."""
    from tieredbuf.produce.staged import stage_producer_ids

    (pid,) = stage_producer_ids(stage)
    buf.drain_stage(stage, pid)


def record_times(buf: tieredbuf.Buffer) -> dict[bytes, int]:
    """Every record of the buffer's ``.batch`` objects and its ingestion time."""
    from tieredbuf.format.batch import decode_batch

    out = {}
    for e in buf.snapshot().iter_from(0):
        if not e.location.endswith(".batch"):
            continue
        items = sorted(e.metadata, key=lambda m: m.start_index)
        for i, r in enumerate(decode_batch(buf.read_object(e))):
            mine = [m for m in items if m.start_index <= i]
            out[r] = mine[-1].ingestion_time_ms
    return out


def bulk_fill(buf: tieredbuf.Buffer, n: int, m: int, t0_ms: int = 1_800_000_000_000) -> None:
    """``n`` entries (fake 1 MiB objects, entry i ingested at ``t0_ms + i``) written as
    ``n`` single appends with branching factor ``m`` would leave the tree, in one pass
    (bench/tree.py's bulk path): for planning tests, which never read the objects."""
    from tieredbuf.format.manifest import NewEntry as _New
    from tieredbuf.queue import tree

    entries = [
        _New(
            keys.data_key(ULID.from_timestamp((t0_ms + i) / 1000)),
            (MetadataItem(0, t0_ms + i, b""),),
            1 << 20,
        )
        for i in range(n)
    ]
    root = buf.queue.read().root.copy()
    tree.append_entries(root, entries, t0_ms)
    tree.rebalance(root, m, buf.queue.nodes.put)
    buf.store.put(keys.MANIFEST_KEY, root.encode(), mode="overwrite")
