"""Run ``tieredbuf serve`` as a real process on a loopback port and talk HTTP to it."""

from __future__ import annotations

import http.client
import json
import os
import signal
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

START_TIMEOUT_S = 60.0


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Server:
    proc: subprocess.Popen[str]
    port: int
    log: Path
    stage: Path
    _stopped: bool = field(default=False)
    token: str | None = None
    """Sent as ``Authorization: Bearer`` unless a request says otherwise."""
    tls: ssl.SSLContext | None = None
    """The client context for an HTTPS server (trusting its test certificate)."""
    host: str = "127.0.0.1"
    """Where requests go: the address it listens on (its family's loopback for an
    unspecified address)."""

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout: float = 30.0,
        auth: bool = True,
    ) -> Response:
        headers = dict(headers or {})
        if auth and self.token and "Authorization" not in headers:
            headers["Authorization"] = f"Bearer {self.token}"
        conn: http.client.HTTPConnection
        if self.tls is not None:
            conn = http.client.HTTPSConnection(
                self.host, self.port, timeout=timeout, context=self.tls
            )
        else:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            conn.request(method, path, body=body, headers=headers)
            r = conn.getresponse()
            return Response(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read())
        finally:
            conn.close()

    def post(
        self, body: bytes, content_type: str | None, durability: str | None = "local", **kw: Any
    ) -> Response:
        path = "/v1/produce" + (f"?durability={durability}" if durability else "")
        headers = {"Content-Type": content_type} if content_type else {}
        return self.request("POST", path, body, headers, **kw)

    def metrics(self) -> str:
        r = self.request("GET", "/metrics")
        assert r.status == 200
        return r.body.decode()

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                if self.request("GET", "/readyz", timeout=2).status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.05)  # polling a readiness endpoint against a deadline
        raise AssertionError(f"server not ready in {timeout} s:\n{self.logs()}")

    def terminate(self, timeout: float = 120.0) -> int:
        """SIGTERM (drain) and wait; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout)
        self._stopped = True
        if self.proc.stdout:
            self.proc.stdout.close()
        return rc

    def logs(self) -> str:
        return self.log.read_text() if self.log.exists() else ""


def start_server(
    url: str,
    tmp: Path,
    *args: str,
    workers: int = 1,
    env: dict[str, str] | None = None,
    token: str | None = None,
    tls: ssl.SSLContext | None = None,
) -> Server:
    stage = tmp / "stage"
    log = tmp / f"server-{time.monotonic_ns()}.log"
    cmd = [
        sys.executable,
        "-m",
        "tieredbuf.cli",
        "serve",
        url,
        "--staging",
        str(stage),
        "--port",
        "0",
        "--workers",
        str(workers),
        *args,
    ]
    with open(log, "w") as err:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=err, text=True, env={**os.environ, **(env or {})}
        )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        proc.wait()
        raise AssertionError(f"no listening line: {line!r}\n{log.read_text()}")
    scheme = "https" if tls is not None else "http"
    assert f"listening on {scheme}://" in line, line
    where, port_text = line.split("://", 1)[1].split()[0].rsplit(":", 1)
    host = where.strip("[]")
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    server = Server(proc, int(port_text), log, stage, token=token, tls=tls, host=host)
    server.wait_ready()
    return server
