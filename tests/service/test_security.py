"""The locked service, on the real ``tieredbuf serve`` (a subprocess): bearer tokens
(401 without, 403 wrong, rotation by file change and by SIGHUP with no restart, tokens
from the environment), HTTPS with --tls-cert/--tls-key (a self-signed certificate made
here with ``cryptography``), and the refusal to expose an unauthenticated port."""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.service.server import Server
from tests.service.util import consume_all, ndjson, self_signed
from tieredbuf.service.bodies import NDJSON
from tieredbuf.service.tokens import TOKENS_ENV

Serve = Callable[..., Server]
OLD = "old-token-0123456789abcdef"
NEW = "new-token-fedcba9876543210"


def _tokens(path: Path, *tokens: str) -> Path:
    """Write the token file the way an operator's tooling should: a new file renamed
    over the old one (so a reader never sees half of it)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text("# service tokens\n" + "".join(f"{t}\n" for t in tokens))
    tmp.chmod(0o600)
    tmp.replace(path)
    return path


def _post(srv: Server, token: str | None, rec: int = 0) -> int:
    headers = {"Content-Type": NDJSON}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return srv.request("POST", "/v1/produce", ndjson([{"r": rec}]), headers, auth=False).status


def _children(pid: int) -> set[int]:
    """The supervisor's worker processes (Linux /proc)."""
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return {int(p) for p in text.split()}


def _workers_ready(srv: Server, n: int) -> None:
    """Until ``n`` workers have said they serve (the fixture waits for the first)."""
    _until(lambda: srv.logs().count(" ready: producer ") >= n)


def _until(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)  # polling the server against a deadline


@pytest.mark.slow
def test_produce_needs_a_token_401_without_403_wrong_and_health_stays_open(
    tmp_path: Path, serve: Serve
) -> None:
    url = f"file://{tmp_path}/buf"
    srv = serve(url, "--token-file", str(_tokens(tmp_path / "tokens", OLD)), token=OLD)
    r = srv.request("POST", "/v1/produce", ndjson([{"r": 1}]), {"Content-Type": NDJSON}, auth=False)
    assert r.status == 401 and r.headers["www-authenticate"].startswith("Bearer")
    for bad in ("Basic dXNlcjpwYXNz", "Bearer", "Bearer "):
        assert (
            srv.request(
                "POST",
                "/v1/produce",
                b"{}\n",
                {"Content-Type": NDJSON, "Authorization": bad},
                auth=False,
            ).status
            == 401
        ), bad
    assert _post(srv, NEW) == 403
    assert _post(srv, OLD[:-1]) == 403 and _post(srv, OLD + "x") == 403
    r = srv.request(
        "POST",
        "/v1/produce",
        b"{}\n",
        {"Content-Type": NDJSON, "Authorization": f"Bearer {NEW}"},
        auth=False,
    )
    assert NEW not in r.body.decode() and OLD not in r.body.decode()
    assert _post(srv, OLD, 7) == 200
    for path in ("/healthz", "/readyz", "/metrics"):
        assert srv.request("GET", path, auth=False).status == 200, path
    assert srv.terminate() == 0
    records, _, _ = consume_all(url)
    assert records == [b'{"r":7}'], "only the authenticated request was staged"


@pytest.mark.slow
def test_metrics_and_health_can_be_protected(tmp_path: Path, serve: Serve) -> None:
    srv = serve(
        f"file://{tmp_path}/buf",
        "--token-file",
        str(_tokens(tmp_path / "tokens", OLD)),
        "--protect-metrics",
        "--protect-health",
        token=OLD,
    )
    for path in ("/healthz", "/readyz", "/metrics"):
        assert srv.request("GET", path, auth=False).status == 401, path
        assert srv.request("GET", path, headers={"Authorization": f"Bearer {NEW}"}).status == 403, (
            path
        )
        assert srv.request("GET", path).status == 200, path
    assert srv.terminate() == 0


@pytest.mark.slow
def test_tokens_rotate_on_file_change_and_on_sighup_without_a_restart(
    tmp_path: Path, serve: Serve
) -> None:
    tokens = _tokens(tmp_path / "tokens", OLD)
    srv = serve(f"file://{tmp_path}/buf", "--token-file", str(tokens), workers=2, token=OLD)
    workers = _children(srv.proc.pid)
    assert len(workers) == 2
    _workers_ready(srv, 2)  # a worker still starting would read the file of step 2
    # 1. add the new token: picked up on a later request once the file changed
    _tokens(tokens, OLD, NEW)
    _until(lambda: all(_post(srv, NEW) == 200 for _ in range(6)))
    assert _post(srv, OLD) == 200, "both valid during the rollover"
    # 2. a broken file keeps the tokens in use (never locks everyone out)
    tokens.write_text("short\n")
    # requests trigger the (once a second) check; every worker reads the bad file and
    # logs it, and meanwhile both tokens keep working
    _until(
        lambda: (
            _post(srv, OLD) == 200
            and _post(srv, NEW) == 200
            and all(
                f"worker-{i} ERROR tieredbuf.service.auth: token file not reloaded" in srv.logs()
                for i in (0, 1)
            )
        )
    )
    assert "short" not in srv.logs().split("token file not reloaded", 1)[1]
    # 3. retire the old token with a SIGHUP to the supervisor (passed to the workers)
    _tokens(tokens, NEW)
    srv.proc.send_signal(signal.SIGHUP)
    _until(lambda: all(_post(srv, OLD) == 403 for _ in range(6)))
    assert _post(srv, NEW) == 200
    assert _children(srv.proc.pid) == workers, f"a worker was restarted:\n{srv.logs()}"
    assert "SIGHUP, reloading" in srv.logs()
    assert srv.terminate() == 0


@pytest.mark.slow
def test_a_worker_restarted_while_the_token_file_is_broken_serves_with_the_last_good_tokens(
    tmp_path: Path, serve: Serve
) -> None:
    """A worker that starts in the middle of an edit of the token file does not exit
    (three fast exits stop the whole service): it serves with the tokens the
    supervisor last found good, and takes the file again once it changes."""
    tokens = _tokens(tmp_path / "tokens", OLD)
    srv = serve(f"file://{tmp_path}/buf", "--token-file", str(tokens), workers=2, token=OLD)
    _workers_ready(srv, 2)
    tokens.write_text("short\n")
    victim = min(_children(srv.proc.pid))
    os.kill(victim, signal.SIGKILL)

    def restarted() -> bool:
        assert srv.proc.poll() is None, f"the service stopped:\n{srv.logs()}"
        return srv.logs().count(" ready: producer ") >= 3

    _until(restarted)
    assert victim not in _children(srv.proc.pid)
    assert "serving with the 1 token(s) the supervisor last checked" in srv.logs()
    assert all(_post(srv, OLD) == 200 for _ in range(8)), "both workers take the old token"
    _tokens(tokens, NEW)  # the edit is done: every worker takes the file again
    _until(lambda: all(_post(srv, NEW) == 200 and _post(srv, OLD) == 403 for _ in range(4)))
    assert srv.terminate() == 0


@pytest.mark.slow
def test_tokens_from_the_environment(tmp_path: Path, serve: Serve) -> None:
    srv = serve(f"file://{tmp_path}/buf", env={TOKENS_ENV: f"{OLD}, {NEW}"}, token=NEW)
    assert _post(srv, OLD) == 200 and _post(srv, NEW) == 200
    assert _post(srv, None) == 401 and _post(srv, "x" * 20) == 403
    assert srv.terminate() == 0


@pytest.mark.slow
def test_https_with_tls_cert_and_key(tmp_path: Path, serve: Serve) -> None:
    cert, key, client = self_signed(tmp_path / "cert.pem", tmp_path / "key.pem")
    url = f"file://{tmp_path}/buf"
    srv = serve(
        url,
        "--tls-cert",
        str(cert),
        "--tls-key",
        str(key),
        "--token-file",
        str(_tokens(tmp_path / "tokens", OLD)),
        token=OLD,
        tls=client,
    )
    assert _post(srv, None) == 401 and _post(srv, NEW) == 403
    assert _post(srv, OLD, 3) == 200
    r = srv.request("GET", "/healthz", auth=False)
    assert r.status == 200
    # plain HTTP to the TLS port is not answered as HTTP
    import http.client

    plain = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    with pytest.raises((http.client.HTTPException, ConnectionError, OSError)):
        plain.request("GET", "/healthz")
        plain.getresponse().read()
    plain.close()
    # a client that does not trust the certificate refuses it
    untrusting = ssl.create_default_context()
    with pytest.raises(ssl.SSLError):
        http.client.HTTPSConnection("127.0.0.1", srv.port, timeout=10, context=untrusting).request(
            "GET", "/healthz"
        )
    assert srv.terminate() == 0
    records, _, _ = consume_all(url)
    assert records == [b'{"r":3}']


def _serve_exit(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> tuple[int, str, str]:
    """Run ``tieredbuf serve`` expected to refuse to start: its exit code and output."""
    cmd = [
        sys.executable,
        "-m",
        "tieredbuf.cli",
        "serve",
        f"file://{tmp_path}/buf",
        "--staging",
        str(tmp_path / "stage"),
        "--port",
        "0",
        "--workers",
        "1",
        *args,
    ]
    environ = {k: v for k, v in os.environ.items() if k != TOKENS_ENV}
    p = subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, env={**environ, **(env or {})}
    )
    return p.returncode, p.stdout, p.stderr


@pytest.mark.slow
def test_an_exposed_port_without_tokens_is_refused_unless_insecure(
    tmp_path: Path, serve: Serve
) -> None:
    code, out, err = _serve_exit(tmp_path, "--host", "0.0.0.0")
    assert code == 2 and "listening" not in out
    assert "refusing to serve on 0.0.0.0 without authentication" in err and "--insecure" in err
    srv = serve(f"file://{tmp_path}/buf", "--host", "0.0.0.0", "--insecure")
    assert _post(srv, None) == 200, "--insecure: the operator said so"
    assert "WITHOUT authentication (--insecure)" in srv.logs()
    assert srv.terminate() == 0
    tokens = _tokens(tmp_path / "tokens", OLD)
    srv = serve(
        f"file://{tmp_path}/buf2", "--host", "0.0.0.0", "--token-file", str(tokens), token=OLD
    )
    assert _post(srv, None) == 401 and _post(srv, OLD) == 200
    assert "clear text" in srv.logs()
    assert srv.terminate() == 0


@pytest.mark.slow
@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("missing token file", "cannot read token file"),
        ("empty token file", "holds no token"),
        ("short token", "at least 16 characters"),
        ("both sources", "use one"),
        ("cert without key", "--tls-cert and --tls-key go together"),
        ("unreadable cert", "cannot load --tls-cert"),
    ],
)
def test_bad_security_settings_exit_2_before_binding(
    tmp_path: Path, setup: str, message: str
) -> None:
    tokens = tmp_path / "tokens"
    args: list[str] = ["--token-file", str(tokens)]
    env: dict[str, str] = {}
    if setup == "empty token file":
        tokens.write_text("# nothing yet\n\n")
    elif setup == "short token":
        tokens.write_text(f"{OLD}\nshort-secret\n")
    elif setup == "both sources":
        _tokens(tokens, OLD)
        env = {TOKENS_ENV: NEW}
    elif setup == "cert without key":
        _tokens(tokens, OLD)
        args += ["--tls-cert", str(tmp_path / "cert.pem")]
    elif setup == "unreadable cert":
        _tokens(tokens, OLD)
        (tmp_path / "cert.pem").write_text("not a certificate")
        args += ["--tls-cert", str(tmp_path / "cert.pem"), "--tls-key", str(tmp_path / "k")]
    code, out, err = _serve_exit(tmp_path, *args, env=env)
    assert code == 2 and "listening" not in out, (out, err)
    assert message in err
    assert "short-secret" not in err and OLD not in err and NEW not in err
