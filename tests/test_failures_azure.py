"""The failure tests that fit Azure Blob, on Azurite: a missing container is permanent
and staged data survives it; an endpoint that goes away is retried and ``tieredbuf
drain`` (the CLI, with an az:// URL) exports once it is back (invariant I1)."""

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
from tests.endpoint import AzureEndpoint
from tests.tcp_proxy import TcpProxy
from tieredbuf import Durability, errors
from tieredbuf.config import RetryConfig

pytestmark = pytest.mark.azure
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


def _cli(*argv: str, env: dict[str, str]) -> subprocess.Popen[str]:
    exe = shutil.which("tieredbuf") or str(Path(sys.executable).with_name("tieredbuf"))
    return subprocess.Popen(
        [exe, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )


def _env(ep: AzureEndpoint) -> dict[str, str]:
    return {
        "AZURE_STORAGE_ACCOUNT_NAME": ep.account_name,
        "AZURE_STORAGE_ACCOUNT_KEY": ep.account_key,
    }


def test_I1_missing_container_fails_remote_keeps_staged_data_and_recovers(
    azurite_endpoint: AzureEndpoint, tmp_path: Path
) -> None:
    container = f"tb-{uuid.uuid4().hex[:16]}"  # not created yet
    url = f"az://{container}/b"
    opts = {**azurite_endpoint.options(), "max_retries": 0}
    p = tieredbuf.open(url, **opts).producer(
        staging_dir=tmp_path / "stage", **FAST, **QUICK_RECOVERY
    )
    h = p.produce([b"a", b"b"])
    h.wait(Durability.LOCAL, timeout=10)
    with pytest.raises(errors.BucketNotFoundError) as ei:
        h.wait(Durability.REMOTE, timeout=30)
    assert f"container {container!r}" in str(ei.value) and "\n" not in str(ei.value)
    assert p.stage.sealed_segments(), "the data stays staged"
    azurite_endpoint.create_container(container)  # someone fixes it
    _poll(lambda: h.watcher.level == Durability.REMOTE, 60, "REMOTE after recovery")
    p.close(timeout=60)
    assert _records(url, **azurite_endpoint.options()) == [b"a", b"b"]


@pytest.fixture
def proxy(azurite_endpoint: AzureEndpoint) -> Iterator[TcpProxy]:
    parts = urlsplit(azurite_endpoint.endpoint)
    assert parts.hostname is not None and parts.port is not None
    p = TcpProxy(parts.hostname, parts.port)
    yield p
    p.shut()


@pytest.mark.slow
def test_I1_unreachable_endpoint_is_retried_then_cli_drain_exports_once_it_is_back(
    azurite_endpoint: AzureEndpoint, proxy: TcpProxy, tmp_path: Path
) -> None:
    url = f"az://{azurite_endpoint.new_container()}/b"
    endpoint = f"{proxy.endpoint}/{azurite_endpoint.account_name}"
    opts = {
        **azurite_endpoint.options(),
        "endpoint": endpoint,
        "max_retries": 0,
        "connect_timeout": 1,
        "timeout": 5,
    }
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

    drain = _cli(
        "drain",
        str(stage),
        url,
        "--endpoint",
        endpoint,
        "--timeout",
        "120s",
        env=_env(azurite_endpoint),
    )
    assert drain.stderr is not None
    first = drain.stderr.readline()  # blocks until the drain reports its first failure
    assert "failed, attempt 1" in first and "not sent" in first, first
    proxy.reopen()
    out, err = drain.communicate(timeout=120)
    assert drain.returncode == 0, first + err
    assert "stage empty" in out
    assert _records(url, **azurite_endpoint.options()) == [b"before"] + [
        f"r{i}".encode() for i in range(10)
    ]


@pytest.mark.slow
def test_cli_inspects_an_azure_buffer_and_refuses_s3_flags_in_one_line(
    azurite_endpoint: AzureEndpoint,
) -> None:
    url = f"az://{azurite_endpoint.new_container()}/b"
    with tieredbuf.open(url, **azurite_endpoint.options()).producer() as p:
        p.produce([b"one", b"two"]).wait(Durability.REMOTE, timeout=30)
    bad = _cli("inspect", url, "--region", "us-east-1", env=_env(azurite_endpoint))
    out, err = bad.communicate(timeout=60)
    assert bad.returncode == 2 and err.count("\n") == 1 and "--region" in err, err
    ok = _cli(
        "inspect",
        url,
        "--endpoint",
        azurite_endpoint.endpoint,
        "--json",
        env=_env(azurite_endpoint),
    )
    out, err = ok.communicate(timeout=60)
    assert ok.returncode == 0, err
    info = json.loads(out)
    assert info["depth"] == 1 and info["missing_objects"] == 0, out
