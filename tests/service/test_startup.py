"""A SIGTERM that reaches ``tieredbuf serve`` while its workers are still starting
(importing, recovering their stages) drains them like any other: exit 0, nothing lost
(I1).  Before, a worker that had not yet installed its handler died of the signal and
the service exited 1 with its stage not exported."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.service.server import Server
from tests.service.util import consume_all, octets
from tieredbuf.service.bodies import OCTET_STREAM


def _children(pid: int) -> set[int]:
    return {int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}


@pytest.mark.slow
def test_I1_sigterm_while_the_workers_start_drains_their_stages(
    tmp_path: Path, serve: Callable[..., Server]
) -> None:
    url = f"file://{tmp_path}/buf"
    # 1. records acknowledged LOCAL, then the whole service killed: they stay staged
    srv = serve(url, "--max-open-duration", "1h", workers=2)
    recs = [f"staged-{i}".encode() for i in range(20)]
    for i in range(0, 20, 5):
        assert srv.post(octets(recs[i : i + 5]), OCTET_STREAM, "local").status == 200
    workers = _children(srv.proc.pid)
    for pid in (srv.proc.pid, *workers):
        os.kill(pid, signal.SIGKILL)
    srv.proc.wait(30)
    # 2. a new service on that stage, stopped the moment it has bound its port
    cmd = [
        sys.executable,
        "-m",
        "tieredbuf.cli",
        "serve",
        url,
        "--staging",
        str(srv.stage),
        "--port",
        "0",
        "--workers",
        "2",
    ]
    with open(tmp_path / "second.log", "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
        assert proc.stdout is not None
        assert "listening on" in proc.stdout.readline()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(180)
        proc.stdout.close()
    log = (tmp_path / "second.log").read_text()
    assert rc == 0, log
    records, _, _ = consume_all(url)
    assert sorted(records) == sorted(recs), "recovered and exported by the drain"
