"""Failures surface: permanent store errors fail fast and loudly, transient ones are
retried, and staged data stays safe until ``tieredbuf drain`` exports it.

Real servers: moto (a missing bucket; an endpoint behind a TCP proxy that is shut
and reopened on the same port) and SeaweedFS (bad credentials: moto does not check
them).  The CLI runs as the installed console script, so "one line, no traceback" is
what a user sees.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import tieredbuf
from tests.endpoint import S3Endpoint
from tests.faults import CountingStore, FaultInjectingStore
from tests.tcp_proxy import TcpProxy
from tieredbuf import Durability, errors
from tieredbuf.config import RetryConfig
from tieredbuf.queue.manifest_queue import ManifestQueue
from tieredbuf.store import open_store

FAST = {"max_open_duration": timedelta(milliseconds=20)}
QUICK_RECOVERY = {
    "failure_retry": RetryConfig(
        initial_backoff=timedelta(milliseconds=20), max_backoff=timedelta(milliseconds=200)
    ),
}


def _records(url: str, **opts: Any) -> list[bytes]:
    buf = tieredbuf.open(url, **opts)
    c = buf.consumer()
    c.initialize()
    out: list[bytes] = []
    while (b := c.next_batch()) is not None:
        out.extend(b.entries)
        c.ack(b.sequence)
    c.flush()
    c.close()
    return out


def _cli(
    *argv: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("tieredbuf") or str(Path(sys.executable).with_name("tieredbuf"))
    return subprocess.run(
        [exe, *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def _poll(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)  # polling a condition against a deadline


def _s3_args(ep: S3Endpoint, endpoint: str | None = None) -> list[str]:
    return ["--endpoint", endpoint or ep.endpoint, "--region", ep.region]


def _creds(ep: S3Endpoint, secret: str | None = None) -> dict[str, str]:
    return {
        "AWS_ACCESS_KEY_ID": ep.access_key_id,
        "AWS_SECRET_ACCESS_KEY": secret or ep.secret_access_key,
    }


# --- permanent: a missing bucket (moto) ---------------------------------------------


@pytest.mark.s3
def test_I1_missing_bucket_fails_remote_waits_at_once_keeps_data_and_recovers(
    s3_endpoint: S3Endpoint, tmp_path: Path
) -> None:
    bucket = f"tb-{uuid.uuid4().hex[:16]}"  # not created yet
    url = f"s3://{bucket}/b"
    buf = tieredbuf.open(url, **s3_endpoint.options(), max_retries=0)
    p = buf.producer(staging_dir=tmp_path / "stage", **FAST, **QUICK_RECOVERY)
    h = p.produce([b"a", b"b"])
    h.wait(Durability.LOCAL, timeout=10)
    with pytest.raises(errors.BucketNotFoundError) as ei:
        h.wait(Durability.REMOTE, timeout=30)
    assert bucket in str(ei.value) and "\n" not in str(ei.value)
    assert h.wait(Durability.LOCAL, timeout=0).durability == Durability.LOCAL  # LOCAL holds
    assert isinstance(p.exporter.error, errors.BucketNotFoundError)
    with pytest.raises(errors.BucketNotFoundError):
        p.flush(timeout=30)
    # writes are still accepted LOCAL; their REMOTE wait fails at once, not after a timeout
    h2 = p.produce([b"c"])
    h2.wait(Durability.LOCAL, timeout=10)
    with pytest.raises(errors.BucketNotFoundError):
        h2.wait(Durability.REMOTE, timeout=30)
    stats = p.stats
    assert stats["export_failing"] == 1 and stats["store_permanent_errors"] >= 1
    assert p.stage.sealed_segments(), "the data stays staged"

    s3_endpoint.boto3_client().create_bucket(Bucket=bucket)  # someone fixes it
    # the failed handles stay registered: their segments reach REMOTE after recovery
    _poll(lambda: h2.watcher.level == Durability.REMOTE, 60, "REMOTE after recovery")
    assert h.wait(Durability.REMOTE, timeout=0).sequence is not None
    assert h2.wait(Durability.REMOTE, timeout=0).sequence is not None
    p.flush(timeout=60)
    assert p.exporter.error is None and p.stats["export_failing"] == 0
    p.close(timeout=60)
    assert _records(url, **s3_endpoint.options()) == [b"a", b"b", b"c"]


@pytest.mark.s3
def test_stateless_producer_fails_handles_flush_and_close_on_a_missing_bucket(
    s3_endpoint: S3Endpoint,
) -> None:
    buf = tieredbuf.open(
        f"s3://tb-{uuid.uuid4().hex[:16]}/b", **s3_endpoint.options(), max_retries=0
    )
    p = buf.producer(flush_interval=timedelta(milliseconds=10))
    h = p.produce([b"x"])
    with pytest.raises(errors.BucketNotFoundError):
        h.wait(Durability.REMOTE, timeout=30)
    with pytest.raises(errors.BucketNotFoundError):
        p.flush(timeout=30)
    with pytest.raises(errors.BucketNotFoundError):
        p.produce([b"y"])
    with pytest.raises(errors.BucketNotFoundError):
        p.close(timeout=30)
    assert p.stats.get("store_permanent_errors") >= 1


@pytest.mark.s3
def test_cli_on_a_missing_bucket_prints_one_line_and_exits_3(s3_endpoint: S3Endpoint) -> None:
    url = f"s3://tb-{uuid.uuid4().hex[:16]}/b"
    r = _cli("inspect", url, *_s3_args(s3_endpoint), env=_creds(s3_endpoint))
    assert r.returncode == 3, r.stderr
    assert r.stderr.count("\n") == 1 and "does not exist" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "Debug source" not in r.stderr


@pytest.mark.slow
def test_cli_usage_failures_are_one_line_and_exit_2(tmp_path: Path) -> None:
    env = {
        k: ""
        for k in (
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_WEB_IDENTITY_TOKEN_FILE",
            "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
            "AWS_CONTAINER_CREDENTIALS_FULL_URI",
            "TIEREDBUF_S3_INSTANCE_METADATA",
        )
    }
    cases = [
        (["inspect", "s4://bucket/p"], "unsupported store URL scheme"),
        (["inspect", "s3://bucket/p", "--endpoint", "127.0.0.1:9000"], "http:// or https://"),
        (["inspect", "s3://bucket/p", "--endpoint", "http://127.0.0.1:9"], "AWS_ACCESS_KEY_ID"),
        (["drain", str(tmp_path), "memory://x"], "no producer stage"),
        (["drain", str(tmp_path / "nope"), "memory://x"], "not a directory"),
    ]
    (tmp_path / "not-a-stage").mkdir()
    for argv, match in cases:
        r = _cli(*argv, env=env)
        assert r.returncode == 2, (argv, r.stderr)
        assert r.stderr.count("\n") == 1 and match in r.stderr, (argv, r.stderr)
    assert list((tmp_path / "not-a-stage").iterdir()) == [], "drain created nothing there"


# --- permanent: bad credentials (SeaweedFS checks them) ------------------------------


@pytest.mark.s3
@pytest.mark.slow
def test_I1_bad_credentials_keep_the_stage_and_drain_exports_it_with_good_ones(
    seaweedfs_endpoint: S3Endpoint, tmp_path: Path
) -> None:
    ep = seaweedfs_endpoint
    url = f"s3://{ep.new_bucket()}/b"
    bad = {**ep.options(), "secret_access_key": "not-the-secret", "max_retries": 0}
    stage = tmp_path / "stage"
    p = tieredbuf.open(url, **bad).producer(staging_dir=stage, **FAST)
    handles = [p.produce([f"r{i}".encode()]) for i in range(5)]
    for h in handles:
        h.wait(Durability.LOCAL, timeout=10)
    with pytest.raises(errors.CredentialsError) as ei:
        handles[0].wait(Durability.REMOTE, timeout=30)
    assert "SignatureDoesNotMatch" in str(ei.value) and "\n" not in str(ei.value)
    with pytest.raises(errors.CredentialsError) as ci:
        p.close(timeout=30)
    assert any(str(stage) in n for n in getattr(ci.value, "__notes__", [])), "says where"

    r = _cli("drain", str(stage), url, *_s3_args(ep), env=_creds(ep, "not-the-secret"))
    assert r.returncode == 3, r.stderr
    assert r.stderr.count("\n") == 1 and "CredentialsError" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    r = _cli("drain", str(stage), url, *_s3_args(ep), env=_creds(ep))
    assert r.returncode == 0, r.stderr
    assert "exported" in r.stdout
    assert _records(url, **ep.options()) == [f"r{i}".encode() for i in range(5)]


@pytest.mark.s3
def test_bad_credentials_stop_a_stateless_producer_with_a_credentials_error(
    seaweedfs_endpoint: S3Endpoint,
) -> None:
    ep = seaweedfs_endpoint
    url = f"s3://{ep.new_bucket()}/b"
    p = tieredbuf.open(url, **{**ep.options(), "access_key_id": "nobody"}, max_retries=0).producer(
        flush_interval=timedelta(milliseconds=10)
    )
    with pytest.raises(errors.CredentialsError, match="InvalidAccessKeyId"):
        p.produce([b"x"]).wait(Durability.REMOTE, timeout=30)
    with pytest.raises(errors.CredentialsError):
        p.close(timeout=30)


# --- permanent errors stop the CAS loops at once -----------------------------------


@pytest.mark.parametrize(
    "error", [errors.AccessDeniedError, errors.BucketNotFoundError, errors.CredentialsError]
)
def test_a_permanent_error_stops_every_manifest_loop_without_spinning(
    error: type[Exception],
) -> None:
    def make(key: str) -> Exception:
        if error is errors.BucketNotFoundError:
            return errors.BucketNotFoundError("b", f"injected on {key}")
        return error(f"injected on {key}")

    inner = FaultInjectingStore(open_store("memory://"))
    counted = CountingStore(inner)
    q = ManifestQueue(counted)
    q.append([_entry()], "p", 1)
    inner.arm("put", error=make, times=None, when="before")
    before = counted.counts["put"]
    with pytest.raises(error):
        q.append([_entry()], "p", 2)
    with pytest.raises(error):
        q.initialize("owner")
    assert counted.counts["put"] - before == 2, "one attempt each, no retry"
    inner.disarm()
    inner.arm("get", error=make, times=None, when="before")
    with pytest.raises(error):
        q.dequeue(0, 0)
    assert q.stats.get("permanent_errors") == 3 and q.stats.get("retries") == 0


def _entry() -> Any:
    from tieredbuf.format.manifest import NewEntry

    return NewEntry(f"data/{uuid.uuid4().hex}.batch", (), 1)


# --- transient: an endpoint that goes away and comes back ---------------------------


@pytest.fixture
def proxy(s3_endpoint: S3Endpoint) -> Any:
    host, port = s3_endpoint.endpoint.removeprefix("http://").rsplit(":", 1)
    p = TcpProxy(host, int(port))
    yield p
    p.shut()


@pytest.mark.s3
@pytest.mark.slow
def test_I1_unreachable_endpoint_is_retried_then_drain_exports_once_it_is_back(
    s3_endpoint: S3Endpoint, proxy: TcpProxy, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bucket = s3_endpoint.new_bucket()
    url = f"s3://{bucket}/b"
    opts = {
        **s3_endpoint.options(),
        "endpoint": proxy.endpoint,
        "max_retries": 0,
        "connect_timeout": 1,
        "timeout": 5,
    }
    stage = tmp_path / "stage"
    p = tieredbuf.open(url, **opts).producer(staging_dir=stage, **FAST)
    p.produce([b"before"]).wait(Durability.REMOTE, timeout=30)

    proxy.shut()
    caplog.set_level(logging.WARNING, logger="tieredbuf")
    handles = [p.produce([f"r{i}".encode()]) for i in range(20)]
    for h in handles:
        h.wait(Durability.LOCAL, timeout=10)
    _poll(lambda: p.exporter.stats.get("store_transient_retries") >= 5, 60, "retries")
    assert p.exporter.error is None, "connection refused is transient, not permanent"
    assert isinstance(p.exporter.last_transient_error, errors.StoreUnreachableError)
    assert "may have landed" not in str(p.exporter.last_transient_error)
    assert all(h.result() is None for h in handles), "waiting, not failed"
    retried = p.exporter.stats.get("store_transient_retries")
    logged = [r for r in caplog.records if "failed, attempt" in r.getMessage()]
    assert 1 <= len(logged) <= 2 < retried, "logged once per interval, not per attempt"
    with pytest.raises(errors.FlushTimeoutError) as ei:
        p.close(timeout=0.5)
    msg = str(ei.value)
    assert isinstance(ei.value, TimeoutError)
    assert str(stage / p.producer_id) in msg and "sealed segment" in msg and "drain" in msg
    assert "not sent" in msg, "names the last error"

    # `tieredbuf drain` while the endpoint is still down: it retries (one line per
    # interval on stderr); the endpoint comes back; it exports and exits 0.
    exe = shutil.which("tieredbuf") or str(Path(sys.executable).with_name("tieredbuf"))
    drain = subprocess.Popen(
        [
            exe,
            "drain",
            str(stage),
            url,
            *_s3_args(s3_endpoint, proxy.endpoint),
            "--timeout",
            "120s",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **_creds(s3_endpoint)},
    )
    assert drain.stderr is not None
    first = drain.stderr.readline()  # blocks until the drain reports its first failure
    assert "failed, attempt 1" in first and "not sent" in first, first
    proxy.reopen()
    out, err = drain.communicate(timeout=120)
    assert drain.returncode == 0, first + err
    assert "stage empty" in out
    assert _records(url, **s3_endpoint.options()) == [b"before"] + [
        f"r{i}".encode() for i in range(20)
    ]


@pytest.mark.slow
@pytest.mark.s3
def test_drain_times_out_with_one_line_naming_what_is_still_staged(
    s3_endpoint: S3Endpoint, proxy: TcpProxy, tmp_path: Path
) -> None:
    url = f"s3://{s3_endpoint.new_bucket()}/b"
    stage = tmp_path / "stage"
    opts = {**s3_endpoint.options(), "endpoint": proxy.endpoint, "max_retries": 0}
    proxy.shut()
    p = tieredbuf.open(url, **opts).producer(staging_dir=stage, **FAST)
    p.produce([b"x"]).wait(Durability.LOCAL, timeout=10)
    with pytest.raises(errors.FlushTimeoutError):
        p.close(timeout=0.2)
    r = _cli(
        "drain",
        str(stage),
        url,
        *_s3_args(s3_endpoint, proxy.endpoint),
        "--timeout",
        "1s",
        env=_creds(s3_endpoint),
    )
    assert r.returncode == 3, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert "FlushTimeoutError" in last and str(stage) in last and "still staged" in last
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) <= 3, "retry lines are rate-limited: " + r.stderr


@pytest.mark.s3
def test_stateless_close_timeout_says_how_much_is_dropped(
    s3_endpoint: S3Endpoint, proxy: TcpProxy
) -> None:
    url = f"s3://{s3_endpoint.new_bucket()}/b"
    proxy.shut()
    buf = tieredbuf.open(
        url, **{**s3_endpoint.options(), "endpoint": proxy.endpoint}, max_retries=0, probe=False
    )
    p = buf.producer(flush_interval=timedelta(milliseconds=10))
    hs = [p.produce([b"x" * 10]) for _ in range(3)]
    with pytest.raises(errors.FlushTimeoutError, match=r"3 produce\(\) call"):
        p.flush(timeout=0.3)
    with pytest.raises(errors.FlushTimeoutError, match="dropped") as ei:
        p.close(timeout=0.3)
    assert "not sent" in str(ei.value)
    for h in hs:
        with pytest.raises(errors.FlushTimeoutError):
            h.wait(Durability.REMOTE, timeout=10)


# --- the service: /healthz, REMOTE requests, metrics ---------------------------------


@pytest.mark.s3
@pytest.mark.slow
def test_service_healthz_500_with_the_reason_then_200_once_the_bucket_exists(
    s3_endpoint: S3Endpoint, serve: Any
) -> None:
    """A bucket missing at start is exit 3 before binding; one removed later is /healthz
    500 naming it, with writes held in the stage, until it is back."""
    from tests.service.util import FAST as SFAST
    from tests.service.util import ndjson, samples

    bucket = f"tb-{uuid.uuid4().hex[:16]}"
    with pytest.raises(AssertionError, match=f"BucketNotFoundError: bucket '{bucket}'"):
        serve(f"s3://{bucket}/svc", *SFAST, *_s3_args(s3_endpoint), env=_creds(s3_endpoint))
    s3 = s3_endpoint.boto3_client()
    s3.create_bucket(Bucket=bucket)
    srv = serve(f"s3://{bucket}/svc", *SFAST, *_s3_args(s3_endpoint), env=_creds(s3_endpoint))
    srv.wait_ready()
    assert s3.list_objects_v2(Bucket=bucket).get("KeyCount") == 0  # starting wrote nothing
    s3.delete_bucket(Bucket=bucket)
    r = srv.post(ndjson([{"a": 1}]), "application/x-ndjson", "remote", timeout=60)
    assert r.status == 500 and "BucketNotFoundError" in r.json()["error"], r.body
    assert srv.post(ndjson([{"b": 2}]), "application/x-ndjson", "local").status == 200
    h = srv.request("GET", "/healthz")
    assert h.status == 500 and bucket in h.json()["error"] and h.json()["staged_segments"] >= 1
    m = samples(srv.metrics())
    assert m["tieredbuf_export_failing"] == 1
    assert m["tieredbuf_store_permanent_errors_total{role=exporter}"] >= 1

    s3.create_bucket(Bucket=bucket)
    _poll(lambda: srv.request("GET", "/healthz").status == 200, 120, "healthz 200")
    r = srv.post(ndjson([{"c": 3}]), "application/x-ndjson", "remote", timeout=60)
    assert r.status == 200, r.body
    assert srv.terminate() == 0
    records = _records(f"s3://{bucket}/svc", **s3_endpoint.options())
    assert records == [b'{"a":1}', b'{"b":2}', b'{"c":3}']


@pytest.fixture
def serve(tmp_path: Path) -> Any:
    from tests.service.server import start_server

    started: list[Any] = []

    def _start(url: str, *args: str, env: dict[str, str] | None = None) -> Any:
        s = start_server(url, tmp_path, *args, workers=1, env=env)
        started.append(s)
        return s

    yield _start
    for s in started:
        if s.proc.poll() is None:
            s.terminate()


def test_retry_log_reports_once_per_interval_and_the_recovery(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from tieredbuf.runtime.retry import RetryLog

    now = [0.0]
    rl = RetryLog(logging.getLogger("tieredbuf.test"), interval=30, clock=lambda: now[0])
    caplog.set_level(logging.WARNING, logger="tieredbuf.test")
    for _ in range(10):
        rl.failed("upload", errors.StoreUnreachableError("refused"))
        now[0] += 1
    now[0] += 30
    rl.failed("upload", errors.StoreUnreachableError("refused"))
    rl.recovered("upload")
    rl.recovered("upload")  # nothing failed since: silent
    # only this logger: a producer an earlier test left timing out may still log
    msgs = [r.getMessage() for r in caplog.records if r.name == "tieredbuf.test"]
    assert len(msgs) == 3, msgs
    assert "attempt 1:" in msgs[0]
    assert "attempt 11 (9 more failed attempts since the last report)" in msgs[1]
    assert "succeeded after 11 failed attempts" in msgs[2]


def test_fenced_error_names_the_new_epoch_and_what_to_do() -> None:
    e = errors.FencedError(3, 4)
    assert "epoch 4" in str(e) and "initialize()" in str(e) and "stop this consumer" in str(e)
