"""Chaos on GCS (fake-gcs-server): a missing bucket is permanent, named in one line, and
staged data survives it; an endpoint that goes away is retried, and ``tieredbuf drain``
(the CLI, with a gs:// URL) exports once it is back (invariant I1)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

import tieredbuf
from tests.endpoint import GCSEndpoint
from tests.tcp_proxy import TcpProxy
from tieredbuf import Durability, errors
from tieredbuf.config import RetryConfig

pytestmark = pytest.mark.gcs
FAST = {"max_open_duration": timedelta(milliseconds=20)}
QUICK_RECOVERY = {
    "failure_retry": RetryConfig(
        initial_backoff=timedelta(milliseconds=20), max_backoff=timedelta(milliseconds=200)
    ),
}


def _records(url: str, **opts: Any) -> list[bytes]:
    c = tieredbuf.open(url, **opts).consumer()
    c.initialize()
    out: list[bytes] = []
    while (b := c.next_batch()) is not None:
        out.extend(b.entries)
        c.ack(b.sequence)
    c.close()
    return out


def _poll(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)  # polling a condition against a deadline


def _cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    exe = shutil.which("tieredbuf") or str(Path(sys.executable).with_name("tieredbuf"))
    clean = {k: v for k, v in os.environ.items() if k != "STORAGE_EMULATOR_HOST"}
    return subprocess.Popen(
        [exe, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**clean, **(env or {})},
    )


def test_I1_missing_bucket_fails_remote_keeps_staged_data_and_recovers(
    gcs_endpoint: GCSEndpoint, tmp_path: Path
) -> None:
    bucket = f"tb-{uuid.uuid4().hex[:16]}"  # not created yet
    url = f"gs://{bucket}/b"
    opts = {**gcs_endpoint.options(), "max_retries": 0}
    p = tieredbuf.open(url, **opts).producer(
        staging_dir=tmp_path / "stage", **FAST, **QUICK_RECOVERY
    )
    h = p.produce([b"a", b"b"])
    h.wait(Durability.LOCAL, timeout=10)
    with pytest.raises(errors.BucketNotFoundError) as ei:
        h.wait(Durability.REMOTE, timeout=30)
    assert f"bucket {bucket!r} does not exist" in str(ei.value) and "\n" not in str(ei.value)
    assert p.stage.sealed_segments(), "the data stays staged"
    gcs_endpoint.create_bucket(bucket)  # someone fixes it
    _poll(lambda: h.watcher.level == Durability.REMOTE, 60, "REMOTE after recovery")
    p.close(timeout=60)
    assert _records(url, **gcs_endpoint.options()) == [b"a", b"b"]


def test_a_stateless_producer_on_a_missing_bucket_fails_its_handle_in_one_line(
    gcs_endpoint: GCSEndpoint,
) -> None:
    url = f"gs://tb-{uuid.uuid4().hex[:16]}/b"
    p = tieredbuf.open(url, **gcs_endpoint.options()).producer()
    h = p.produce([b"x"])
    with pytest.raises(errors.BucketNotFoundError) as ei:
        h.wait(Durability.REMOTE, timeout=30)
    assert "\n" not in str(ei.value)
    with pytest.raises(errors.TieredBufError):
        p.close(timeout=5)


@pytest.fixture
def proxy(gcs_endpoint: GCSEndpoint) -> Iterator[TcpProxy]:
    parts = urlsplit(gcs_endpoint.endpoint)
    assert parts.hostname is not None and parts.port is not None
    p = TcpProxy(parts.hostname, parts.port)
    yield p
    p.shut()


@pytest.mark.slow
def test_I1_unreachable_endpoint_is_retried_then_cli_drain_exports_once_it_is_back(
    gcs_endpoint: GCSEndpoint, proxy: TcpProxy, tmp_path: Path
) -> None:
    url = f"gs://{gcs_endpoint.new_bucket()}/b"
    opts = {"endpoint": proxy.endpoint, "max_retries": 0, "connect_timeout": 1, "timeout": 5}
    stage = tmp_path / "stage"
    p = tieredbuf.open(url, **opts).producer(staging_dir=stage, **FAST)
    p.produce([b"before"]).wait(Durability.REMOTE, timeout=30)

    proxy.shut()
    handles = [p.produce([f"r{i}".encode()]) for i in range(10)]
    for h in handles:
        h.wait(Durability.LOCAL, timeout=10)
    _poll(lambda: p.exporter.stats.get("store_transient_retries") >= 3, 60, "retries")
    assert p.exporter.error is None, "connection refused is transient, not permanent"
    assert isinstance(p.exporter.last_transient_error, errors.StoreUnreachableError)
    with pytest.raises(errors.FlushTimeoutError):
        p.close(timeout=0.5)

    drain = _cli("drain", str(stage), url, "--endpoint", proxy.endpoint, "--timeout", "120s")
    assert drain.stderr is not None
    first = drain.stderr.readline()  # blocks until the drain reports its first failure
    assert "failed, attempt 1" in first and "not sent" in first, first
    proxy.reopen()
    out, err = drain.communicate(timeout=120)
    assert drain.returncode == 0, first + err
    assert "stage empty" in out
    assert _records(url, **gcs_endpoint.options()) == [b"before"] + [
        f"r{i}".encode() for i in range(10)
    ]


@pytest.mark.slow
def test_cli_inspects_a_gcs_buffer_and_refuses_s3_flags_in_one_line(
    gcs_endpoint: GCSEndpoint,
) -> None:
    url = f"gs://{gcs_endpoint.new_bucket()}/b"
    with tieredbuf.open(url, **gcs_endpoint.options()).producer() as p:
        p.produce([b"one", b"two"]).wait(Durability.REMOTE, timeout=30)
    bad = _cli("inspect", url, "--region", "us-east-1", "--endpoint", gcs_endpoint.endpoint)
    out, err = bad.communicate(timeout=60)
    assert bad.returncode == 2 and err.count("\n") == 1 and "--region" in err, err
    ok = _cli("inspect", url, "--endpoint", gcs_endpoint.endpoint, "--json")
    out, err = ok.communicate(timeout=60)
    assert ok.returncode == 0, err
    info = json.loads(out)
    assert info["depth"] == 1 and info["missing_objects"] == 0, out


def test_cli_without_gcs_credentials_says_where_to_put_them_and_exits_2(tmp_path: Path) -> None:
    cli = _cli(
        "inspect",
        "gs://tb-some-bucket/b",
        env={
            "GOOGLE_APPLICATION_CREDENTIALS": "",
            "CLOUDSDK_CONFIG": str(tmp_path / "gcloud"),
            "NO_GCE_CHECK": "True",
        },
    )
    out, err = cli.communicate(timeout=60)
    assert cli.returncode == 2, (out, err)
    assert err.count("\n") == 1 and "no Google Cloud credentials" in err, err


@pytest.mark.slow
def test_I2_lost_answers_and_503s_on_gcs_land_every_record_once_in_order(
    gcs_endpoint: GCSEndpoint,
) -> None:
    """Through a proxy that forwards a write and drops its answer (a quarter of them) or
    refuses it with 503 (a tenth): the store retries, a conditional write that landed
    comes back as a conflict, and the queue recognises its own write (I2) -- every
    record once, in order (I3)."""
    from tests.latency_proxy import LatencyProxy

    url = f"gs://{gcs_endpoint.new_bucket()}/b"
    tieredbuf.open(url, **gcs_endpoint.options()).create()  # the probe, without chaos
    with LatencyProxy(
        gcs_endpoint.endpoint, {}, lose_responses=0.25, fail_writes=0.1, seed=7
    ) as chaos:
        opts = {"endpoint": chaos.endpoint, "max_retries": 5, "timeout": 10}
        with tieredbuf.open(url, **opts).producer(manifest_writes_per_s=0) as p:
            for i in range(30):
                p.produce([f"r{i}".encode()]).wait(Durability.REMOTE, timeout=60)
        assert chaos.counts["lost"] >= 5 and chaos.counts["refused"] >= 2, chaos.counts
    assert _records(url, **gcs_endpoint.options()) == [f"r{i}".encode() for i in range(30)]
