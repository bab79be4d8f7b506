"""``tieredbuf subscribers`` / ``inspect`` and the per-subscriber /metrics gauges."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

import tieredbuf
import tieredbuf.ops.metrics
from tests.subscriber_util import drain, fill
from tieredbuf.cli import EXIT_OK, EXIT_PARTIAL, EXIT_USAGE, main


def _run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return main(list(argv), out=out), out.getvalue()


def _setup(url: str) -> tieredbuf.Buffer:
    buf = tieredbuf.open(url)
    fill(buf, 6)
    w = buf.worker("jobs")
    w.initialize()  # registered before "etl" moves on: it starts at 0
    etl = buf.consumer("etl")
    etl.initialize()
    drain(etl, 4)
    etl.flush()
    got = [w.claim() for _ in range(3)]
    w.ack(got[0].sequence)  # type: ignore[union-attr]
    w.reject(got[1].sequence, reason=b"not json")  # type: ignore[union-attr]
    w.flush()
    return buf


@pytest.mark.slow
def test_subscribers_lists_positions_lag_and_rejected_entries(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/b"
    _setup(url)
    code, text = _run("subscribers", url)
    assert code == EXIT_OK
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["name", "kind", "next", "lag"]
    etl = next(ln for ln in lines if ln.startswith("etl "))
    assert etl.split()[1:4] == ["stream", "4", "2"]
    jobs = next(ln for ln in lines if ln.startswith("jobs "))
    assert jobs.split()[1:4] == ["shared", "2", "4"]
    assert "rejected 1 after 1 deliveries: not json" in text
    code, text = _run("subscribers", url, "--json")
    got = {s["name"]: s for s in json.loads(text)}
    assert got["etl"]["next_sequence"] == 4 and got["etl"]["lag_entries"] == 2
    assert got["etl"]["lag_bytes"] > 0 and got["etl"]["epoch"] == 1
    assert got["jobs"]["work"]["leased"] == 4  # claim_batch 8: all six leased, two resolved
    assert got["jobs"]["rejected"] == [
        {
            "sequence": 1,
            "time_ms": got["jobs"]["rejected"][0]["time_ms"],
            "deliveries": 1,
            "reason": "not json",
            "kept": True,
        }
    ]


@pytest.mark.slow
def test_inspect_shows_the_subscribers(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/b"
    _setup(url)
    code, text = _run("inspect", url, "--json")
    info = json.loads(text)
    assert code == EXIT_OK and set(info["subscribers"]) == {"etl", "jobs"}
    assert info["subscribers"]["etl"]["lag_entries"] == 2
    code, text = _run("inspect", url, "--quick")
    assert "etl (next 4, lag 2)" in text


@pytest.mark.slow
def test_subscribers_remove_releases_and_reports(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/b"
    buf = _setup(url)
    assert buf.snapshot().head == 1  # jobs' dead letter 1 is kept for a redrive
    code, text = _run("subscribers", "remove", url, "jobs")
    assert code == EXIT_OK and "removed 'jobs'" in text
    assert buf.snapshot().head == 4
    code, text = _run("subscribers", "remove", url, "jobs")
    assert code == EXIT_PARTIAL and "no such subscriber" in text
    assert _run("subscribers", "remove", url)[0] == EXIT_USAGE
    assert _run("subscribers", "remove", url, "bad/name")[0] == EXIT_USAGE
    assert _run("subscribers", f"file://{tmp_path}/typo")[0] == EXIT_USAGE  # no buffer


@pytest.mark.slow
def test_metrics_have_per_subscriber_lag(tmp_path: Path) -> None:
    buf = _setup(f"file://{tmp_path}/b")
    reg = CollectorRegistry()
    tieredbuf.ops.metrics.register(buf, reg, min_interval=0)
    lag = {
        s.labels["subscriber"]: s.value
        for fam in reg.collect()
        if fam.name == "tieredbuf_subscriber_lag_entries"
        for s in fam.samples
    }
    assert lag == {"etl": 2.0, "jobs": 4.0}
    rejected = reg.get_sample_value("tieredbuf_subscriber_rejected", {"subscriber": "jobs"})
    assert rejected == 1.0
    assert reg.get_sample_value("tieredbuf_subscriber_leases", {"subscriber": "jobs"}) == 4.0
