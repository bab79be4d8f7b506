"""Helpers for the service tests: request bodies and reading a buffer back."""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

import tieredbuf
from tieredbuf.service.bodies import encode_length_prefixed

FAST = ("--max-open-duration", "50ms", "--wal-flush-interval", "2ms")
"""Seal quickly so durability=remote answers in tens of milliseconds."""


def ndjson(records: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(r, separators=(",", ":")).encode() + b"\n" for r in records)


def octets(records: list[bytes]) -> bytes:
    return encode_length_prefixed(records)


def arrow_stream(batches: list[pa.RecordBatch]) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batches[0].schema) as w:
        for b in batches:
            w.write_batch(b)
    return sink.getvalue().to_pybytes()


def consume_all(url: str, **opts: Any) -> tuple[list[bytes], list[pa.RecordBatch], list[Any]]:
    """(records, slot-0 record batches, consumed batches) of every queued entry, acked."""
    buf = tieredbuf.open(url, **opts)
    c = buf.consumer()
    c.initialize()
    records: list[bytes] = []
    bundles: list[pa.RecordBatch] = []
    seen = []
    while (b := c.next_batch()) is not None:
        seen.append(b)
        if b.location.endswith(".qseg"):
            bundles.extend(bd[0] for bd in b.bundles())
        else:
            records.extend(b.entries)
        c.ack(b.sequence)
    c.flush()
    c.close()
    buf.close()
    return records, bundles, seen


def stage_files(stage: Any) -> dict[str, int]:
    """Every file under a stage root with its size (what a bad request must not change)."""
    return {str(p.relative_to(stage)): p.stat().st_size
            for p in stage.rglob("*") if p.is_file() and ".prometheus" not in p.parts}


def samples(text: str) -> dict[str, float]:
    """Prometheus exposition -> {"name{a=1,b=2}": value} (no labels: just the name)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out
