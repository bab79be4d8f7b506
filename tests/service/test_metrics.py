"""Prometheus metrics: scraped from a running service, and registered as a library."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

import tieredbuf
import tieredbuf.ops.metrics
from tests.service.server import Server
from tests.service.util import FAST, ndjson, samples
from tieredbuf.service.bodies import NDJSON


def _scrape_until(
    srv: Server, ok: Callable[[dict[str, float]], bool], timeout: float = 30
) -> dict[str, float]:
    """Scrape until ``ok`` holds (workers mirror their counters every second)."""
    deadline = time.monotonic() + timeout
    while True:
        got = samples(srv.metrics())
        if ok(got) or time.monotonic() > deadline:
            return got
        time.sleep(0.1)  # polling the metrics endpoint against a deadline


def _files(stage: Path, pattern: str) -> int:
    return sum(p.stat().st_size for p in stage.glob(pattern) if p.is_file())


@pytest.mark.slow
def test_metrics_endpoint_after_a_run_has_the_key_series(
    tmp_path: Path, serve: Callable[..., Server]
) -> None:
    srv = serve(f"file://{tmp_path}/buf", *FAST, workers=2)
    for i in range(10):
        dur = "remote" if i % 2 else "local"
        r = srv.post(ndjson([{"i": i, "j": j} for j in range(5)]), NDJSON, dur)
        assert r.status == 200
    sent = sum(len(ndjson([{"i": i, "j": j}])) - 1 + 4 for i in range(10) for j in range(5))
    assert srv.post(b"nope", "text/plain").status == 415
    wal_glob = "worker-*/*/wal/quiver.wal*"

    def settled(m: dict[str, float]) -> bool:
        """Every record in, every sealed segment exported and appended, the buffer
        gauges caught up (they re-read the manifest at most every 5 s), the WAL gauge
        mirrored, and the other worker's store requests mirrored with its uploads: a
        scrape is no snapshot, and can land while that worker's mirror has copied its
        producer's counters but not yet its buffer's request counters."""
        return (
            m.get("tieredbuf_store_requests_total{kind=data,op=put_conditional}", 0)
            >= m.get("tieredbuf_uploads_total", 0)
            and m.get("tieredbuf_store_requests_total{kind=root,op=put_conditional}", 0)
            >= m.get("tieredbuf_manifest_commits_total", 0)
            and m.get("tieredbuf_producer_records_in_total") == 50
            and m.get("tieredbuf_stage_sealed_segments") == 0
            and m.get("tieredbuf_segments_sealed_total")
            == m.get("tieredbuf_segments_exported_total")
            == m.get("tieredbuf_manifest_entries_appended_total")
            == m.get("tieredbuf_queue_depth")
            and m.get("tieredbuf_exported_bytes_total") == m.get("tieredbuf_queue_bytes")
            and m.get("tieredbuf_stage_disk_bytes", 0)
            >= _files(srv.stage, wal_glob) - _files(srv.stage, "worker-*/*/wal/*.cursor")
        )

    m = _scrape_until(srv, settled, timeout=60)
    assert settled(m), m
    assert m["tieredbuf_producer_records_in_total"] == 50, "summed over both workers"
    # records plus their u32 framing, plus the stage's fixed 64-byte estimate of each
    # call's entry framing (what the stage caps count; stage/append_item.py)
    assert m["tieredbuf_producer_bytes_in_total"] == sent + 10 * 64
    assert m["tieredbuf_http_requests_total{code=200,route=/v1/produce}"] == 10
    assert m["tieredbuf_http_requests_total{code=415,route=/v1/produce}"] == 1
    assert m["tieredbuf_http_request_duration_seconds_count{durability=remote}"] == 5
    assert m["tieredbuf_http_request_duration_seconds_count{durability=local}"] == 5
    assert m["tieredbuf_wal_fsyncs_total"] >= 1
    assert 0 < m["tieredbuf_wal_fsync_seconds_total"] < 60
    # five remote requests each waited for an export: at least one segment per worker
    # that took one; every exported segment is one queue entry and one upload
    assert m["tieredbuf_segments_exported_total"] >= 1
    assert m["tieredbuf_uploads_total"] == m["tieredbuf_segments_exported_total"]
    assert m["tieredbuf_uploaded_bytes_total"] == m["tieredbuf_exported_bytes_total"] > 0
    assert m["tieredbuf_upload_seconds_total"] > 0
    # fan-in: one commit carries every segment uploaded meanwhile: commits <= entries
    assert 1 <= m["tieredbuf_manifest_commits_total"] <= m["tieredbuf_segments_exported_total"]
    # a local directory never answers "outcome unknown" or a transient error, so every
    # manifest retry is a CAS lost to the other worker
    assert m["tieredbuf_manifest_unknown_outcomes_total"] == 0
    assert m["tieredbuf_manifest_transient_errors_total"] == 0
    assert m["tieredbuf_manifest_retries_total"] == m["tieredbuf_manifest_cas_conflicts_total"]
    assert m["tieredbuf_queue_tree_levels"] == 1, "a handful of entries stay in the root"
    assert m["tieredbuf_service_backpressure_rejections_total"] == 0
    assert m["tieredbuf_dropped_records_total"] == 0
    # WAL plus sealed segments: no rotation happened, so at least each worker's WAL file
    # (every request is in it), and no more than every byte the stages hold
    stage_bytes = sum(p.stat().st_size for p in srv.stage.glob("worker-*/**/*") if p.is_file())
    assert m["tieredbuf_stage_disk_bytes"] >= sent
    assert m["tieredbuf_stage_disk_bytes"] <= stage_bytes
    # every data object and every append CAS is a request, counted by op and kind
    uploads = m["tieredbuf_store_requests_total{kind=data,op=put_conditional}"]
    assert uploads >= m["tieredbuf_uploads_total"] >= 1
    assert (
        m["tieredbuf_store_requests_total{kind=root,op=put_conditional}"]
        >= m["tieredbuf_manifest_commits_total"]
    )
    assert m["tieredbuf_store_requests_total{kind=root,op=get}"] >= 1
    assert m["tieredbuf_store_requests_total{kind=data,op=list}"] == 0
    assert "tieredbuf_store_conflicts_total{kind=root}" in m
    assert srv.terminate() == 0


def test_register_a_producer_buffer_and_consumer_as_a_library(tmp_path: Path) -> None:
    buf = tieredbuf.open(f"file://{tmp_path}/buf")
    reg = CollectorRegistry()
    producer = buf.producer(
        staging_dir=tmp_path / "stage", max_open_duration=timedelta(milliseconds=20)
    )
    tieredbuf.ops.metrics.register(producer, reg, labels={"producer": "p1"})
    tieredbuf.ops.metrics.register(buf, reg, min_interval=0)
    for _ in range(3):
        producer.produce([b"a" * 10, b"b"], metadata=b"m").wait(
            tieredbuf.Durability.REMOTE, timeout=30
        )
    get = reg.get_sample_value
    assert get("tieredbuf_producer_records_in_total", {"producer": "p1"}) == 6
    assert get("tieredbuf_wal_fsyncs_total", {"producer": "p1"}) >= 1
    assert get("tieredbuf_segments_exported_total", {"producer": "p1"}) >= 1
    assert get("tieredbuf_queue_depth") == get("tieredbuf_manifest_commits_total") >= 1
    cas = {"op": "put_conditional", "kind": "root"}
    assert (
        get("tieredbuf_store_requests_total", cas)
        == buf.requests.total("put_conditional", "root")
        >= get("tieredbuf_manifest_commits_total")
    )
    assert get("tieredbuf_store_requests_total", {"op": "delete", "kind": "group"}) == 0
    producer.close()

    consumer = buf.consumer()
    tieredbuf.ops.metrics.register(consumer, reg, min_interval=0)
    consumer.initialize()
    depth = get("tieredbuf_queue_depth")
    assert get("tieredbuf_consumer_lag_sequences") == depth
    # the age of the oldest unacked entry: its earliest metadata time, seen from "now"
    snap = buf.snapshot()
    oldest = min(md.ingestion_time_ms for md in next(iter(snap.iter_from(snap.head))).metadata)
    before_ms = time.time_ns() // 1_000_000
    lag = get("tieredbuf_consumer_lag_seconds")
    after_ms = time.time_ns() // 1_000_000
    assert (before_ms - oldest) / 1000 <= lag <= (after_ms - oldest) / 1000
    b = consumer.next_batch()
    assert b is not None
    consumer.ack(b.sequence)
    assert get("tieredbuf_consumer_lag_sequences") == depth - 1
    assert get("tieredbuf_consumer_acks_total") == 1
    consumer.close()

    stateless = buf.producer()
    tieredbuf.ops.metrics.register(stateless, reg, labels={"producer": "direct"})
    stateless.produce([b"x"]).wait(timeout=30)
    stateless.close()
    assert get("tieredbuf_producer_records_in_total", {"producer": "direct"}) == 1
    assert get("tieredbuf_batches_flushed_total", {"producer": "direct"}) == 1
