"""/readyz while the stage's disk fails (I1): 503 with the reason, writes answered 503
with Retry-After (never acknowledged), and back to 200 once the disk works again."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from tests.service.server import Server
from tests.service.util import FAST, consume_all, octets
from tests.stage.simfs import SimFs
from tieredbuf.service.app import build_app
from tieredbuf.service.bodies import OCTET_STREAM
from tieredbuf.service.config import ServiceConfig
from tieredbuf.stage import filesystem

Serve = Callable[..., Server]


def _poll(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


@pytest.fixture
def tmpfs_stage(tmp_path: Path) -> Iterator[Path]:
    """``tmp_path/stage`` on a 4 MiB tmpfs (needs root to mount)."""
    mnt = tmp_path / "stage"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here ({r.stderr.strip()}); test_readyz_..._injected covers it"
        )
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(path: Path) -> None:
    with open(path, "wb") as f, contextlib.suppress(OSError):
        while True:
            f.write(bytes(64 << 10))
            f.flush()


@pytest.mark.slow
def test_I1_readyz_is_503_while_the_stage_disk_is_full(
    tmp_path: Path, tmpfs_stage: Path, serve: Serve
) -> None:
    """A real ``tieredbuf serve`` whose staging directory is on a tmpfs that fills up."""
    url = f"file://{tmp_path}/buf"
    srv = serve(url, *FAST)
    body = octets([b"before"])
    assert srv.post(body, OCTET_STREAM, "local").status == 200
    _fill(tmpfs_stage / "filler")
    codes: list[int] = []

    def refused() -> bool:
        r = srv.post(octets([b"full-%d" % len(codes)]), OCTET_STREAM, "local")
        codes.append(r.status)
        return r.status == 503 and "stage disk failing" in r.json()["error"]

    _poll(refused)
    r = srv.post(octets([b"refused"]), OCTET_STREAM, "local")
    assert r.status == 503 and r.headers["retry-after"] == "1", r.body
    ready = srv.request("GET", "/readyz")
    assert ready.status == 503 and "DiskFullError" in ready.json()["error"], ready.body
    (tmpfs_stage / "filler").unlink()
    _poll(lambda: srv.post(octets([b"after"]), OCTET_STREAM, "local").status == 200)
    _poll(lambda: srv.request("GET", "/readyz").status == 200)
    assert srv.terminate() == 0
    records, _, _ = consume_all(url)
    assert b"before" in records and b"after" in records and b"refused" not in records
    acked_full = [b"full-%d" % i for i, c in enumerate(codes) if c == 200]
    assert set(acked_full) <= set(records)


def test_I1_readyz_is_503_while_the_stage_disk_fails_injected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same in one process, the stage on the simulated file layer (an EIO cannot be
    made on a real disk here): a failing WAL fdatasync makes /readyz 503 and writes 503;
    when the fault clears both recover."""
    sim = SimFs()
    stage = sim.makedirs_durable(tmp_path / "stage")
    cfg = ServiceConfig(
        url=f"file://{tmp_path}/buf",
        staging_dir=str(stage),
        producer_options={"flush_interval": 0.001},
    )

    async def run() -> None:
        async with TestClient(TestServer(build_app(cfg, 0))) as client:
            assert (await client.get("/readyz")).status == 200
            sim.fail("fdatasync", errno.EIO, path_contains="/wal/", times=None)
            r = await client.post(
                "/v1/produce?durability=local",
                data=octets([b"x"]),
                headers={"Content-Type": OCTET_STREAM},
            )
            assert r.status == 503 and r.headers["Retry-After"] == "1"
            assert "DiskIOError" in (await r.json())["error"]
            r = await client.get("/readyz")
            assert r.status == 503 and "stage disk failing" in (await r.json())["error"]
            sim.heal()
            deadline = time.monotonic() + 30
            while True:
                r = await client.post(
                    "/v1/produce?durability=local",
                    data=octets([b"y"]),
                    headers={"Content-Type": OCTET_STREAM},
                )
                if r.status == 200:
                    break
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            assert (await client.get("/readyz")).status == 200

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    with filesystem.installed(sim):
        asyncio.run(run())
