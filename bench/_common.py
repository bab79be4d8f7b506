"""Small helpers shared by the bench scripts: percentiles, event windows, JSON results, a moto
S3 server.

Keep this module generic: anything specific to one benchmark belongs in its script.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (0..100) with linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """n, p50, p90, p99, max and mean of ``values``."""
    return {
        "n": len(values),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "max": max(values) if values else math.nan,
        "mean": sum(values) / len(values) if values else math.nan,
    }


def max_window(times: Sequence[float], width: float) -> int:
    """The most events in any window of ``width`` seconds (``times`` sorted)."""
    best, lo = 0, 0
    for hi, t in enumerate(times):
        while t - times[lo] >= width:
            lo += 1
        best = max(best, hi - lo + 1)
    return best


def machine_info() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def write_json(name: str, payload: dict[str, Any]) -> Path:
    """Write ``payload`` (plus machine info) to ``bench/results/<name>.json``."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    body = {"machine": machine_info(), **payload}
    path.write_text(json.dumps(body, indent=2, default=str, allow_nan=True) + "\n")
    return path


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Print rows as a left-aligned text table."""
    cells = [[str(h) for h in headers], *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for n, r in enumerate(cells):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))


@dataclass(frozen=True)
class S3Endpoint:
    endpoint: str
    region: str = "us-east-1"
    access_key_id: str = "testing"
    secret_access_key: str = "testing"

    def options(self) -> dict[str, Any]:
        """Keyword options for ``tieredbuf.open()``."""
        return {
            "endpoint": self.endpoint,
            "region": self.region,
            "access_key_id": self.access_key_id,
            "secret_access_key": self.secret_access_key,
            "allow_http": self.endpoint.startswith("http://"),
        }

    def boto3_client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=self.region,
            aws_access_key_id=self.access_key_id,
            aws_secret_access_key=self.secret_access_key,
        )

    def new_bucket(self, prefix: str = "bench") -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        self.boto3_client().create_bucket(Bucket=name)
        return name


_MOTO_CHILD = """
import sys
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print(server.get_host_and_port()[1], flush=True)
sys.stdin.read()
server.stop()
"""


@contextmanager
def moto_server(in_process: bool = False, child: str | None = None) -> Iterator[S3Endpoint]:
    """A moto S3 server on 127.0.0.1, port 0 (everything it stores lives in RAM).

    By default it runs in a child process, so the server's Python work does not share
    the benchmark's GIL; ``in_process=True`` runs it on a thread, as the tests do.
    ``child``: other code for that process (it prints its port, serves until stdin
    closes).
    """
    if in_process:
        from moto.server import ThreadedMotoServer

        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        try:
            host, port = server.get_host_and_port()
            yield S3Endpoint(f"http://{host}:{port}")
        finally:
            server.stop()
        return
    proc = subprocess.Popen(
        [sys.executable, "-c", child or _MOTO_CHILD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        if not line.isdigit():
            raise RuntimeError(f"moto server did not start (got {line!r})")
        yield S3Endpoint(f"http://127.0.0.1:{int(line)}")
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


_SERIAL_MOTO_CHILD = """
import sys, threading
from moto.moto_server.werkzeug_app import (DomainDispatcherApplication, MotoRequestHandler,
                                           create_backend_app)
from werkzeug.serving import make_server
inner = DomainDispatcherApplication(create_backend_app)
lock = threading.Lock()
def app(environ, start_response):
    if environ["REQUEST_METHOD"] in ("GET", "HEAD"):
        return list(inner(environ, start_response))  # reads run concurrently
    with lock:  # one write at a time: atomic conditional PUTs
        return list(inner(environ, start_response))
server = make_server("127.0.0.1", 0, app, True, request_handler=MotoRequestHandler)
print(server.server_address[1], flush=True)
threading.Thread(target=server.serve_forever, daemon=True).start()
sys.stdin.read()
server.shutdown()
"""


def serial_moto() -> Any:
    """moto in a child process, writes serialised (atomic conditional PUTs: moto 5.2.5 checks
    If-Match and then writes without a lock); reads run concurrently, as they do on S3."""
    return moto_server(child=_SERIAL_MOTO_CHILD)


def run_threads(n: int, target: Callable[[int, threading.Barrier], None]) -> float:
    """Run ``target(i, barrier)`` on ``n`` threads until all finish; returns the
    ``time.perf_counter()`` at which the barrier opened (the start of the timed work)."""
    barrier = threading.Barrier(n + 1)
    errors: list[BaseException] = []

    def wrap(i: int) -> None:
        try:
            target(i, barrier)
        except BaseException as e:
            errors.append(e)
            barrier.abort()

    ts = [threading.Thread(target=wrap, args=(i,), name=f"bench-{i}") for i in range(n)]
    for t in ts:
        t.start()
    barrier.wait()
    started = time.perf_counter()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]
    return started
