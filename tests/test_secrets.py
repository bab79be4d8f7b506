"""No secret ever leaves tieredbuf: known S3 credentials (through keyword options and
through the AWS_* environment) and a known bearer token are set, then everything
tieredbuf emits is collected and scanned for them: stdout and stderr of produce,
consume, inspect (plain and --json), gc and serve with logging at DEBUG, every HTTP
answer of the service (good, unauthenticated, wrong-token, bad-body and failing
requests, /metrics), and the text, repr and full traceback of every exception the
Python API raises.

The failing paths matter most: an S3 server that refuses a signature echoes the
access key id and the canonical request -- with the session token in it -- in its
error body.  moto does not check signatures, so a small HTTP server here answers every
request the way S3 answers a bad signature (403 SignatureDoesNotMatch, the request's
own credentials quoted back); it stands in for AWS only for that answer, and the test
checks it really did quote the secrets, so the scan would see a leak if there were one.
"""

from __future__ import annotations

import http.server
import os
import re
import subprocess
import sys
import threading
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest

import tieredbuf
from tests.servers import serial_moto_server
from tests.service.server import Server, start_server
from tests.service.util import ndjson
from tieredbuf.errors import TieredBufError
from tieredbuf.runtime.redact import fingerprint
from tieredbuf.service.bodies import NDJSON
from tieredbuf.service.tokens import TOKENS_ENV

pytestmark = pytest.mark.s3

ACCESS_KEY = "AKIASCANTIEREDBUF0001"
SECRET_KEY = "scanSecretKey/0123456789abcdefGHIJKLmnop"
SESSION_TOKEN = "scanSessionToken-IQoJb3JpZ2luX2VjEFgaCXVzLWVhc3QtMSJHMEUCIQD"
BEARER = "scanBearerToken-5e6f7a8b9c0d1e2f3a4b"
SECRETS = (ACCESS_KEY, SECRET_KEY, SESSION_TOKEN, BEARER)
CRED_ENV = {
    "AWS_ACCESS_KEY_ID": ACCESS_KEY,
    "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
    "AWS_SESSION_TOKEN": SESSION_TOKEN,
    "AWS_REGION": "us-east-1",
}


class _Echo(http.server.BaseHTTPRequestHandler):
    """Answers every request as S3 answers a bad signature, quoting the request back."""

    seen: ClassVar[list[str]] = []

    def _answer(self) -> None:
        if self.headers.get("Content-Length"):
            self.rfile.read(int(self.headers["Content-Length"]))
        auth = self.headers.get("Authorization", "")
        token = self.headers.get("x-amz-security-token", "")
        _Echo.seen.append(auth + " " + token)
        key = re.search(r"Credential=([^/]+)/", auth)
        body = (
            '<?xml version="1.0" encoding="UTF-8"?><Error><Code>SignatureDoesNotMatch</Code>'
            "<Message>The request signature we calculated does not match the signature you "
            f"provided.</Message><AWSAccessKeyId>{key.group(1) if key else ''}</AWSAccessKeyId>"
            f"<CanonicalRequest>{self.command}\n{self.path}\n\nhost:{self.headers.get('Host')}"
            f"\nx-amz-security-token:{token}\n</CanonicalRequest>"
            f"<RequestId>0</RequestId></Error>"
        ).encode()
        self.send_response(403)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def echo_endpoint() -> Iterator[str]:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    _Echo.seen = []
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


class Emitted:
    """Everything tieredbuf emitted during the test, by where it came from."""

    def __init__(self) -> None:
        self.texts: list[tuple[str, str]] = []

    def add(self, where: str, text: str | bytes) -> None:
        self.texts.append(
            (where, text.decode("utf-8", "replace") if isinstance(text, bytes) else text)
        )

    def exception(self, where: str, e: BaseException) -> None:
        self.add(f"{where}: str", str(e))
        self.add(f"{where}: repr", repr(e))
        self.add(f"{where}: traceback", "".join(traceback.format_exception(e)))

    def assert_clean(self) -> None:
        for where, text in self.texts:
            for s in SECRETS:
                assert s not in text, f"a secret ({fingerprint(s)}) leaked in {where}"


def _cli(
    em: Emitted, *args: str, env: dict[str, str], ok: bool | None = True, stdin: str | None = None
) -> int:
    base = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and k != TOKENS_ENV}
    p = subprocess.run(
        [sys.executable, "-m", "tieredbuf.cli", *args],
        capture_output=True,
        text=True,
        timeout=180,
        input=stdin,
        env={**base, "TIEREDBUF_LOG_LEVEL": "DEBUG", **env},
    )
    em.add(f"tieredbuf {args[0]} stdout", p.stdout)
    em.add(f"tieredbuf {args[0]} stderr", p.stderr)
    if ok is not None:
        assert (p.returncode == 0) == ok, (args, p.returncode, p.stderr[-2000:])
    return p.returncode


def _serve(em: Emitted, tmp: Path, url: str, *args: str, env: dict[str, str]) -> Server:
    tmp.mkdir(parents=True, exist_ok=True)
    srv = start_server(url, tmp, *args, env={"TIEREDBUF_LOG_LEVEL": "DEBUG", **env}, token=BEARER)
    return srv


@pytest.mark.slow
def test_no_secret_in_any_output_of_the_cli_the_service_or_the_api(
    tmp_path: Path,
    echo_endpoint: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    em = Emitted()
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    with serial_moto_server() as moto:
        bucket = moto.new_bucket()
        url = f"s3://{bucket}/scan"
        s3 = ["--endpoint", moto.endpoint, "--region", "us-east-1", "--allow-http"]
        echo = ["--endpoint", echo_endpoint, "--region", "us-east-1", "--allow-http"]

        # 1. the CLI with the credentials in the environment, working and failing
        _cli(em, "produce", url, *s3, env=CRED_ENV, stdin="a\nb\nc\n")
        _cli(em, "inspect", url, *s3, env=CRED_ENV)
        _cli(em, "inspect", url, "--json", *s3, env=CRED_ENV)
        _cli(em, "consume", url, "--no-ack", *s3, env=CRED_ENV)
        _cli(em, "gc", url, "--json", "--grace", "1ms", *s3, env=CRED_ENV)
        for cmd in (
            ["inspect", url, "--json"],
            ["inspect", url],
            ["gc", url, "--json"],
            ["produce", url],
            ["consume", url],
        ):
            assert _cli(em, *cmd, *echo, env=CRED_ENV, ok=False, stdin="x\n") == 3, cmd

        # 2. the service: a token file, credentials in the environment, DEBUG logs
        tokens = tmp_path / "tokens"
        tokens.write_text(BEARER + "\n")
        tokens.chmod(0o600)
        srv = _serve(
            em,
            tmp_path / "svc",
            url,
            "--token-file",
            str(tokens),
            "--max-open-duration",
            "50ms",
            *s3,
            env=CRED_ENV,
        )
        body = ndjson([{"i": 1}])
        answers = [
            srv.request("POST", "/v1/produce?durability=remote", body, {"Content-Type": NDJSON}),
            srv.request("POST", "/v1/produce", body, {"Content-Type": NDJSON}, auth=False),
            srv.request(
                "POST",
                "/v1/produce",
                body,
                {"Content-Type": NDJSON, "Authorization": f"Bearer {BEARER[:-1]}x"},
                auth=False,
            ),
            srv.request("POST", "/v1/produce", b"{oops\n", {"Content-Type": NDJSON}),
            srv.request("GET", "/metrics"),
            srv.request("GET", "/healthz"),
        ]
        assert [a.status for a in answers] == [200, 401, 403, 400, 200, 200]
        assert srv.terminate() == 0
        em.add("serve log (moto)", srv.logs())

        # a service whose store refuses every signature refuses to start (exit 3, before
        # it binds), naming the store and the variables to check: that line is scanned too
        rc = _cli(
            em,
            "serve",
            f"s3://{bucket}/bad",
            "--staging",
            str(tmp_path / "svc-bad"),
            "--port",
            "0",
            "--token-file",
            str(tokens),
            *echo,
            env=CRED_ENV,
            ok=False,
        )
        assert rc == 3
        for a in answers:
            em.add(f"HTTP {a.status} body", a.body)
            em.add(f"HTTP {a.status} headers", repr(a.headers))
        assert fingerprint(BEARER) in srv.logs(), "the token is named by its fingerprint"

        # 3. the Python API with the credentials as keyword options
        caplog.set_level("DEBUG")
        opts = {
            "access_key_id": ACCESS_KEY,
            "secret_access_key": SECRET_KEY,
            "session_token": SESSION_TOKEN,
            "region": "us-east-1",
            "allow_http": True,
        }
        good = tieredbuf.open(url, endpoint=moto.endpoint, **opts)
        em.add("api inspect", repr(good.snapshot()))
        good.close()
        for step in ("snapshot", "gc", "produce", "consume"):
            try:
                buf = tieredbuf.open(f"s3://{bucket}/api", endpoint=echo_endpoint, **opts)
                if step == "snapshot":
                    buf.snapshot()
                elif step == "gc":
                    tieredbuf.ops.gc.run_once(buf)
                elif step == "produce":
                    with buf.producer() as p:
                        p.produce([b"r"]).wait(timeout=60)
                else:
                    buf.consumer().initialize()
            except TieredBufError as e:
                em.exception(f"api {step}", e)
            else:
                raise AssertionError(f"{step} against a refusing store succeeded")
        try:
            tieredbuf.open(url, endpoint="http://[::1", **opts)
        except TieredBufError as e:
            em.exception("api bad endpoint", e)
        em.add("python logs at DEBUG", caplog.text)

    # the refusing store really saw, and quoted back, the credentials
    assert any(ACCESS_KEY in s and SESSION_TOKEN in s for s in _Echo.seen)
    assert len(em.texts) > 40
    em.assert_clean()
