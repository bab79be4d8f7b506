"""Hostile connections and operator mistakes against the real ``tieredbuf serve`` (a
subprocess):

* a certificate/key pair that does not match on SIGHUP keeps the old pair serving;
* a malformed ``Authorization`` header gets a 400 that quotes nothing (never the
  token) and no traceback in the log;
* IPv6 hosts bind (``::1``, and ``::`` which also takes IPv4);
* slow clients are cut off (``--header-timeout``, ``--body-timeout``) and
  connections beyond ``--max-connections`` are turned away;
* the stage is the owner's alone (files 0600, sealed segments 0400, directories
  0700);
* an unauthenticated ``/healthz`` names no stage path and no store endpoint.
"""

from __future__ import annotations

import http.client
import os
import shutil
import signal
import socket
import ssl
import stat
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.endpoint import S3Endpoint
from tests.service.server import Server
from tests.service.util import (
    FAST,
    consume_all,
    ndjson,
    octets,
    self_signed,
    settled_stage_files,
    worker_pids,
)
from tieredbuf.service.bodies import NDJSON, OCTET_STREAM

Serve = Callable[..., Server]
TOKEN = "hostile-test-token-0123456789"


def _until(cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"not reached in {timeout} s: {what}"
        time.sleep(0.05)  # polling the server against a deadline


def _token_file(tmp: Path) -> str:
    path = tmp / "tokens"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return str(path)


def _tls_get(port: int, client: ssl.SSLContext) -> int:
    conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=10, context=client)
    try:
        conn.request("GET", "/readyz")
        return conn.getresponse().status
    finally:
        conn.close()


def _refused(port: int, client: ssl.SSLContext) -> bool:
    try:
        _tls_get(port, client)
    except ssl.SSLError:
        return True
    return False


def _sighup_until(srv: Server, *says: str) -> None:
    """SIGHUP to the supervisor until the log holds every line of ``says`` after it
    (a worker drops a SIGHUP that arrives before it serves: it is sent again)."""
    start = len(srv.logs())
    deadline = time.monotonic() + 60
    while True:
        srv.proc.send_signal(signal.SIGHUP)
        resend = time.monotonic() + 2
        while time.monotonic() < resend:
            log = srv.logs()[start:]
            if all(s in log for s in says):
                return
            assert time.monotonic() < deadline, f"not logged: {says!r}:\n{log}"
            time.sleep(0.05)  # polling the log against a deadline


def _workers_ready(srv: Server, count: int) -> None:
    _until(
        lambda: srv.logs().count("ready: producer") >= count, f"{count} workers ready", timeout=60
    )


@pytest.mark.slow
def test_a_mismatched_certificate_and_key_on_sighup_keep_the_old_pair_serving(
    tmp_path: Path, serve: Serve
) -> None:
    """Writing the new certificate before the new key is the normal middle of a
    rotation: a SIGHUP then must change nothing (it broke every new connection), and
    a worker restarted then starts with the pair in use (it failed on the half-written
    pair, three times, and the supervisor gave up: the whole service stopped)."""
    cert, key, trusts_a = self_signed(tmp_path / "cert.pem", tmp_path / "key.pem")
    srv = serve(
        f"file://{tmp_path}/buf",
        "--tls-cert",
        str(cert),
        "--tls-key",
        str(key),
        workers=2,
        tls=trusts_a,
    )
    _workers_ready(srv, 2)
    b_cert, b_key, trusts_b = self_signed(tmp_path / "b-cert.pem", tmp_path / "b-key.pem")
    shutil.copyfile(b_cert, cert)  # the new certificate, the old key: a mismatch
    _sighup_until(
        srv,
        "certificate not reloaded",
        "worker 0: certificate reloaded",
        "worker 1: certificate reloaded",
    )
    for _ in range(20):  # both workers, new connections: still the old pair
        assert _tls_get(srv.port, trusts_a) == 200
    os.kill(worker_pids(srv.proc.pid)[0], signal.SIGKILL)  # restarted mid-rotation
    _workers_ready(srv, 3)
    for _ in range(20):
        assert _tls_get(srv.port, trusts_a) == 200
    shutil.copyfile(b_key, key)  # the rotation completes
    _sighup_until(
        srv,
        "certificate reloaded from",
        "worker 0: certificate reloaded",
        "worker 1: certificate reloaded",
    )
    for _ in range(20):
        assert _tls_get(srv.port, trusts_b) == 200
        assert _refused(srv.port, trusts_a), "the old certificate is no longer served"
    assert "giving up" not in srv.logs()
    assert srv.terminate() == 0


def _raw(host: str, port: int, data: bytes, timeout: float = 30.0) -> bytes:
    """Send ``data`` on a new connection; everything the server sends until it closes."""
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


@pytest.mark.slow
def test_a_malformed_authorization_header_is_a_400_that_quotes_nothing(
    tmp_path: Path, serve: Serve
) -> None:
    srv = serve(f"file://{tmp_path}/buf", "--token-file", _token_file(tmp_path), token=TOKEN)
    head = b"POST /v1/produce HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-ndjson\r\n"
    tail = b"Content-Length: 4\r\n\r\n{}\n\n"
    tok = TOKEN.encode()
    bad = [
        b"Authorization: Bearer " + tok + b"\x01\r\n",
        b"Authorization: Bearer " + tok + b"\x00x\r\n",
        b"Authorization: Bearer\r\n " + tok + b"\r\n",  # folded (obs-fold)
        b"Authorization: Bearer " + tok + b"\r\n folded\r\n",
        b"Authorization: Bearer " + tok + b"\x7f\r\n",
        b"Authorization: Bearer " + tok + b"\rX: y\r\n",
    ]
    for header in bad:
        answer = _raw("127.0.0.1", srv.port, head + header + tail)
        assert answer.split(b" ", 2)[1] == b"400", answer
        assert tok not in answer and b"Bearer" not in answer, answer
        assert b"malformed HTTP request" in answer, answer
    r = srv.post(ndjson([{"ok": 1}]), NDJSON, "local")
    assert r.status == 200, "the service still works"
    assert srv.terminate() == 0
    log = srv.logs()
    assert TOKEN not in log and "Traceback" not in log, log
    assert " ERROR " not in log, log
    assert log.count("malformed HTTP request") == len(bad), log


@pytest.mark.slow
@pytest.mark.parametrize("host", ["::1", "::"])
def test_ipv6_hosts_bind(tmp_path: Path, serve: Serve, host: str) -> None:
    """``--host ::1`` (loopback, no token needed) and ``--host :: --insecure`` (every
    interface, IPv4 too) failed with 'Unknown error -9'."""
    url = f"file://{tmp_path}/buf"
    srv = serve(url, "--host", host, *(["--insecure"] if host == "::" else []))
    assert srv.host == "::1"
    assert srv.post(octets([b"over-ipv6"]), OCTET_STREAM, "local").status == 200
    if host == "::":  # a dual-stack socket: IPv4 clients reach it too
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
        conn.request("POST", "/v1/produce", octets([b"over-ipv4"]), {"Content-Type": OCTET_STREAM})
        assert conn.getresponse().status == 200
        conn.close()
    assert srv.terminate() == 0
    records, _, _ = consume_all(url)
    assert sorted(records) == sorted([b"over-ipv6", *([b"over-ipv4"] if host == "::" else [])])


def _closed_by_server(sock: socket.socket, drip: bytes, deadline: float) -> bytes:
    """Send ``drip`` one byte per read timeout until the server closes; what it sent."""
    sock.settimeout(0.2)
    got = b""
    i = 0
    while time.monotonic() < deadline:
        if i < len(drip):
            try:
                sock.send(drip[i : i + 1])
            except (BrokenPipeError, ConnectionResetError):
                return got
            i += 1
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue  # paces the drip; the deadline bounds the loop
        except ConnectionResetError:
            return got
        if not chunk:
            return got
        got += chunk
    raise AssertionError(f"the server kept the connection past the deadline: {got!r}")


@pytest.mark.slow
def test_slow_clients_are_cut_off_by_the_header_and_body_timeouts(
    tmp_path: Path, serve: Serve
) -> None:
    srv = serve(f"file://{tmp_path}/buf", "--header-timeout", "1s", "--body-timeout", "1s")
    head = b"POST /v1/produce HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-ndjson\r\n"
    deadline = time.monotonic() + 30
    silent = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
    slow_head = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
    stalled = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
    try:
        stalled.sendall(head + b'Content-Length: 1000\r\n\r\n{"a":')
        assert _closed_by_server(silent, b"", deadline) == b""
        # a byte every 0.2 s: always sending, never finishing the head
        assert _closed_by_server(slow_head, head * 100, deadline) == b""
        answer = _closed_by_server(stalled, b"", deadline)
        assert answer.split(b" ", 2)[1] == b"408", answer
        assert b"body" in answer, answer
    finally:
        for s in (silent, slow_head, stalled):
            s.close()
    assert srv.post(ndjson([{"ok": 1}]), NDJSON, "local").status == 200
    assert srv.terminate() == 0


def _keep_alive(port: int) -> http.client.HTTPConnection:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/readyz")
    r = conn.getresponse()
    r.read()
    assert r.status == 200
    return conn


@pytest.mark.slow
def test_connections_past_max_connections_get_503_and_are_closed(
    tmp_path: Path, serve: Serve
) -> None:
    srv = serve(f"file://{tmp_path}/buf", "--max-connections", "3")
    held = [_keep_alive(srv.port) for _ in range(3)]
    try:
        answer = _raw("127.0.0.1", srv.port, b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert answer.split(b" ", 2)[1] == b"503", answer
        assert b"Retry-After: 1" in answer and b"too many connections" in answer, answer
        held.pop().close()

        def admitted() -> bool:
            try:
                _keep_alive(srv.port).close()
            except AssertionError:
                return False
            except (http.client.HTTPException, OSError):
                return False
            return True

        _until(admitted, "a connection admitted once one closed")
    finally:
        for c in held:
            c.close()
    assert "too many connections" in srv.logs()
    assert srv.terminate() == 0


@pytest.mark.slow
def test_the_stage_is_the_owners_alone(tmp_path: Path, serve: Serve) -> None:
    url = f"file://{tmp_path}/buf"
    srv = serve(url, *FAST, "--max-open-duration", "1h")
    assert srv.post(octets([b"staged"]), OCTET_STREAM, "local").status == 200
    assert srv.post(octets([b"sealed"]), OCTET_STREAM, "remote").status == 200
    worker = srv.stage / "worker-0"
    settled_stage_files(srv.stage)  # the REMOTE one's segment is released just after
    modes = {
        str(p.relative_to(srv.stage)): stat.S_IMODE(p.stat().st_mode)
        for p in [srv.stage, *worker.rglob("*")]
    }
    files = {p: m for p, m in modes.items() if not (srv.stage / p).is_dir()}
    dirs = {p: m for p, m in modes.items() if (srv.stage / p).is_dir()}
    assert any(p.endswith(".wal") for p in files) and any("segments" in p for p in dirs), modes
    assert all(m & 0o077 == 0 for m in files.values()), files
    assert all(m == 0o700 for m in dirs.values()), dirs
    assert srv.terminate() == 0
    records, _, _ = consume_all(url)
    assert records == [b"staged", b"sealed"]


def _quarantined_stage(stage: Path) -> None:
    """A stage for worker 0 holding one sealed segment with a flipped byte."""
    from datetime import timedelta

    from tieredbuf.config import SegmentConfig, StageConfig
    from tieredbuf.stage.stage import Stage

    st = Stage(
        stage / "worker-0",
        None,
        StageConfig(segment=SegmentConfig(max_open_duration=timedelta(seconds=60))),
    )
    try:
        st.append_records([b"doomed"]).result(10)
        (seg,) = st.seal_all()
    finally:
        st.close()
    os.chmod(seg.path, 0o600)
    with open(seg.path, "r+b") as f:
        f.seek(2)
        b = f.read(1)
        f.seek(2)
        f.write(bytes([b[0] ^ 0x01]))


@pytest.mark.slow
def test_unauthenticated_healthz_names_no_stage_path(tmp_path: Path, serve: Serve) -> None:
    _quarantined_stage(tmp_path / "stage")
    srv = serve(f"file://{tmp_path}/buf", "--token-file", _token_file(tmp_path), token=TOKEN)
    anyone = srv.request("GET", "/healthz", auth=False)
    assert anyone.status == 500 and "1 corrupt staged segment" in anyone.json()["error"]
    assert str(tmp_path) not in anyone.body.decode() and ".corrupt" not in anyone.body.decode()
    wrong = srv.request("GET", "/healthz", headers={"Authorization": "Bearer " + "x" * 20})
    assert wrong.status == 500 and str(tmp_path) not in wrong.body.decode()
    operator = srv.request("GET", "/healthz")
    assert operator.status == 500 and ".corrupt" in operator.json()["error"], operator.body
    assert str(tmp_path / "stage") in operator.json()["error"]
    srv.terminate()


@pytest.mark.slow
@pytest.mark.s3
def test_unauthenticated_healthz_names_no_store_endpoint(
    tmp_path: Path, serve: Serve, s3_endpoint: S3Endpoint
) -> None:
    # serve refuses to start against a missing bucket: it goes missing once serving
    bucket = s3_endpoint.new_bucket()
    env = {
        "AWS_ACCESS_KEY_ID": s3_endpoint.access_key_id,
        "AWS_SECRET_ACCESS_KEY": s3_endpoint.secret_access_key,
    }
    srv = serve(
        f"s3://{bucket}/svc",
        *FAST,
        "--endpoint",
        s3_endpoint.endpoint,
        "--region",
        s3_endpoint.region,
        "--allow-http",
        "--token-file",
        _token_file(tmp_path),
        env=env,
        token=TOKEN,
    )
    s3_endpoint.boto3_client().delete_bucket(Bucket=bucket)
    assert srv.post(ndjson([{"a": 1}]), NDJSON, "remote", timeout=60).status == 500
    _until(lambda: srv.request("GET", "/healthz").status == 500, "exports stopped")
    anyone = srv.request("GET", "/healthz", auth=False)
    text = anyone.body.decode()
    assert anyone.status == 500 and "exports stopped" in anyone.json()["error"], text
    for secret in (
        s3_endpoint.endpoint,
        s3_endpoint.endpoint.split("//", 1)[1],
        bucket,
        str(srv.stage),
    ):
        assert secret not in text, (secret, text)
    operator = srv.request("GET", "/healthz").body.decode()
    assert bucket in operator and str(srv.stage) in operator, operator
    srv.terminate()
