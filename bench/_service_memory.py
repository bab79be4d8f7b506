"""``bench/service.py --memory``: a worker's peak memory for one request at the body
limit, per kind of body.

Each case runs on a fresh one-worker service (an allocator that kept the pages of an
earlier request would hide the next one's growth), warmed with one small request of
each content type, then: the worker's peak resident memory (``VmHWM``) is reset
through ``/proc/<pid>/clear_refs``, the request is sent, and the growth is
``VmHWM`` after it minus ``VmRSS`` before it.  The goal is at most 4x the body limit.
"""

from __future__ import annotations

import http.client
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

NDJSON = "application/x-ndjson"
OCTETS = "application/octet-stream"
ARROW = "application/vnd.apache.arrow.stream"
MAX_RECORDS = 100_000
"""The service's default --max-records (not passed: the baseline code has no such flag)."""


def _arrow(batch: pa.RecordBatch, compression: str | None) -> bytes:
    sink = pa.BufferOutputStream()
    opts = pa.ipc.IpcWriteOptions(compression=compression)
    with pa.ipc.new_stream(sink, batch.schema, options=opts) as w:
        w.write_batch(batch)
    return bytes(sink.getvalue().to_pybytes())


def cases(limit: int, bomb_factor: int) -> list[tuple[str, str, Callable[[], bytes]]]:
    """(name, content type, body maker) per case; every body is at most ``limit``."""
    rows = (limit - 4096) // 8
    line = (limit // MAX_RECORDS) - 3  # '"' + x * line + '"' + '\n' per record

    def small_ints() -> bytes:  # compresses about 8x: the body is far below the limit
        rng = np.random.default_rng(23)
        return _arrow(pa.record_batch([pa.array(rng.integers(0, 256, rows))], names=["v"]), "zstd")

    def one_row_batches() -> bytes:
        one = pa.record_batch([pa.array([1], pa.int64())], names=["v"])
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, one.schema) as w:
            while sink.tell() < limit - 400:
                w.write_batch(one)
        return bytes(sink.getvalue().to_pybytes())

    return [
        ("ndjson, 1-byte records, body at the limit", NDJSON, lambda: b"1\n" * (limit // 2)),
        (
            f"ndjson, {MAX_RECORDS} records, body at the limit",
            NDJSON,
            lambda: (b'"' + b"x" * line + b'"\n') * MAX_RECORDS,
        ),
        (
            "octet-stream, empty records, body at the limit",
            OCTETS,
            lambda: b"\x00\x00\x00\x00" * (limit // 4),
        ),
        (
            f"Arrow zstd bomb, decodes to {bomb_factor}x the limit",
            ARROW,
            lambda: _arrow(
                pa.record_batch(
                    [pa.nulls(bomb_factor * limit // 8, pa.int64()).fill_null(0)], names=["z"]
                ),
                "zstd",
            ),
        ),
        ("Arrow, one-row batches, body at the limit", ARROW, one_row_batches),
        ("Arrow zstd, decodes to the limit", ARROW, small_ints),
        (
            "Arrow uncompressed, body at the limit",
            ARROW,
            lambda: _arrow(pa.record_batch([pa.array(np.arange(rows))], names=["v"]), None),
        ),
    ]


def _kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} for pid {pid}")


def _post(port: int, ctype: str, body: bytes) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        conn.request("POST", "/v1/produce?durability=local", body, {"Content-Type": ctype})
        r = conn.getresponse()
        return r.status, r.read().decode(errors="replace")[:200]
    finally:
        conn.close()


def measure(port: int, worker: int, ctype: str, body: bytes) -> dict[str, Any]:
    """One request's status and the worker's peak memory growth for it."""
    for warm_type, warm in (
        (NDJSON, b'{"warm":1}\n'),
        (OCTETS, b"\x01\x00\x00\x00w"),
        (ARROW, _arrow(pa.record_batch([pa.array([1])], names=["v"]), "zstd")),
    ):
        _post(port, warm_type, warm)
    Path(f"/proc/{worker}/clear_refs").write_text("5")
    rss = _kib(worker, "VmRSS")
    t0 = time.perf_counter()
    status, answer = _post(port, ctype, body)
    seconds = time.perf_counter() - t0
    peak = _kib(worker, "VmHWM")
    return {
        "status": status,
        "answer": answer,
        "seconds": round(seconds, 2),
        "rss_before_mib": round(rss / 1024, 1),
        "peak_growth_mib": round((peak - rss) / 1024, 1),
    }
