"""deploy/grafana/tieredbuf.json: every metric its queries name is one the code exports,
and it has the panels an operator looks at.

The exported names are collected from real roles -- a staged and a stateless producer,
a consumer, a work-queue worker, the buffer, a GC pass -- registered with
``tieredbuf.ops.metrics.register`` and scraped through a registry, plus the service's own
HTTP metrics: a renamed series fails here, not on a dashboard that silently shows
nothing.
"""

from __future__ import annotations

import json
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

import tieredbuf
import tieredbuf.ops.metrics

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "tieredbuf.json"
METRIC = re.compile(r"\btieredbuf_[a-z0-9_]+\b")


def exported_names(tmp_path: Path) -> set[str]:
    """Every sample name a scrape of a working buffer's roles shows."""
    from tieredbuf.ops.metrics import GcMetrics
    from tieredbuf.service.app import BACKPRESSURE, LATENCY, REQUESTS

    buf = tieredbuf.open(f"file://{tmp_path}/buf")
    registry = CollectorRegistry()
    staged = buf.producer(staging_dir=tmp_path / "stage")
    staged.produce([b"a"]).wait(tieredbuf.Durability.REMOTE, timeout=60)
    direct = buf.producer(flush_interval=timedelta(milliseconds=10))
    direct.produce([b"b"]).wait(tieredbuf.Durability.REMOTE, timeout=60)
    worker = buf.worker("jobs", lease=timedelta(seconds=30))
    got = worker.claim()
    assert got is not None
    worker.reject(got.sequence, reason=b"test")
    worker.flush()
    consumer = buf.consumer(subscriber="etl")
    consumer.initialize()
    gc = GcMetrics()
    gc.observe(tieredbuf.ops.gc.run_once(buf, dry_run=True), 0.1)
    registry.register(gc)
    for obj in (staged, direct, consumer, buf):
        tieredbuf.ops.metrics.register(
            obj, registry, labels={"role_of": type(obj).__name__}, min_interval=0
        )
    LATENCY.labels("local").observe(0.01)  # a histogram shows samples once observed
    for m in (REQUESTS, LATENCY, BACKPRESSURE):
        registry.register(m)
    try:
        text = generate_latest(registry).decode()
    finally:
        for m in (REQUESTS, LATENCY, BACKPRESSURE):
            registry.unregister(m)
        worker.close()
        consumer.close()
        staged.close()
        direct.close()
    return {
        line.split("{")[0].split(" ")[0]
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def _targets(dash: dict[str, Any]) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]


def test_every_query_names_a_metric_the_code_exports(tmp_path: Path) -> None:
    exported = exported_names(tmp_path)
    assert "tieredbuf_store_requests_total" in exported  # the scrape itself worked
    text = DASHBOARD.read_text("utf-8")
    named = set(METRIC.findall(text))  # queries, and the job variable's label_values()
    assert named, "the dashboard names no tieredbuf metric"
    unknown = sorted(named - exported)
    assert not unknown, f"the dashboard queries series no code exports: {unknown}"


def test_the_dashboard_has_the_panels_operators_look_at() -> None:
    dash = json.loads(DASHBOARD.read_text("utf-8"))
    assert dash["uid"] == "tieredbuf" and dash["panels"]
    queries = _targets(dash)
    assert all(expr.strip() for _, expr in queries)
    titles = " | ".join(p["title"].lower() for p in dash["panels"])
    for wanted in (
        "ingest rate",
        "local latency",
        "remote latency",
        "export backlog",
        "export failures",
        "subscriber lag (entries)",
        "subscriber lag (age)",
        "work-queue leases",
        "work-queue rejects",
        "requests per second by operation and object kind",
        "request cost this month",
    ):
        assert wanted in titles, f"no panel for {wanted!r}: {titles}"
    by_title: dict[str, list[str]] = {}
    for title, expr in queries:
        by_title.setdefault(title, []).append(expr)
    (req, _gc) = by_title["Requests per second by operation and object kind"]
    assert "by (op, kind)" in req and "tieredbuf_store_requests_total" in req
    (cost,) = by_title["Request cost this month (S3 prices)"]
    assert "$price_class_a" in cost and "$price_class_b" in cost
    consts = {v["name"]: v["query"] for v in dash["templating"]["list"] if v["type"] == "constant"}
    assert consts == {"price_class_a": "0.005", "price_class_b": "0.0004"}  # S3 Standard
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"
