"""The CLI error table: for each mistake a newcomer makes, the real ``tieredbuf``
executable exits 2 (usage, configuration, no such buffer) or 3 (the store or the data
failed) with one line on stderr, never a traceback, a Rust debug dump or a hang.

The same table is in docs/getting-started.md ("When something is wrong"); the last
test checks the two agree."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.endpoint import S3Endpoint

EXE = shutil.which("tieredbuf") or str(Path(sys.executable).with_name("tieredbuf"))
ROOT = Path(__file__).resolve().parent.parent
AWS_VARS = [k for k in os.environ if k.startswith("AWS_")]


def tb(
    argv: list[str], cwd: Path, env: dict[str, str] | None = None, stdin: str = ""
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    base["HOME"] = str(cwd)  # no ~/.aws of the machine's
    return subprocess.run(
        [EXE, *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={**base, **(env or {})},
        input=stdin,
    )


def _check(r: subprocess.CompletedProcess[str], code: int, first: str) -> None:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert len(lines) == 1, f"not one line:\n{r.stderr}"
    assert "Traceback" not in r.stderr and "Debug" not in r.stderr
    assert re.search(first, lines[0]), lines[0]


# (what, argv, exit code, a pattern of the one stderr line); {buf} is a buffer holding one
# record, {dir} the test's directory
TABLE = [
    ("a wrong scheme", ["consume", "ftp://host/x"], 2, r"unsupported store URL scheme 'ftp'"),
    (
        "a mistyped buffer URL",
        ["consume", "file://{dir}/typo"],
        2,
        r"no tieredbuf buffer at file://.*/typo",
    ),
    (
        "inspect on a mistyped path",
        ["inspect", "file://{dir}/typo"],
        2,
        r"no tieredbuf buffer at file://.*/typo",
    ),
    ("missing credentials", ["inspect", "s3://bucket/prefix"], 2, r"no S3 credentials for s3://"),
    (
        "an input file that does not exist",
        ["produce", "{buf}", "nope.txt"],
        2,
        r"input file 'nope.txt' does not exist",
    ),
    (
        "an input file given as the URL",
        ["produce", "events.json"],
        2,
        r"events.json is a file, not a buffer",
    ),
    (
        "pretty-printed JSON as input",
        ["produce", "{buf}", "events.json"],
        2,
        r"pretty-printed JSON.*--format json",
    ),
    (
        "a bad --after",
        ["consume", "{buf}", "--after", "x"],
        2,
        r"argument --after: bad sequence 'x'",
    ),
    (
        "a negative --after",
        ["consume", "{buf}", "--after", "-1"],
        2,
        r"argument --after: bad sequence '-1'",
    ),
    (
        "an --after past the tail",
        ["consume", "{buf}", "--after", "5"],
        2,
        r"--after 5 is past the queue's last sequence \(0\)",
    ),
    ("--from without --no-ack", ["consume", "{buf}", "--from", "0"], 2, r"--from needs --no-ack"),
    ("a bad duration", ["gc", "{buf}", "--grace", "ten"], 2, r"bad duration 'ten'"),
    ("an unknown command", ["consum", "{buf}"], 2, r"invalid choice: 'consum'"),
    (
        "drain on a directory with no stage",
        ["drain", "{dir}", "{buf}"],
        2,
        r"no producer stage under",
    ),
    (
        "drain on a path that is not a directory",
        ["drain", "{dir}/none", "{buf}"],
        2,
        r"is not a directory",
    ),
    (
        "gc with an unreachable push gateway",
        ["gc", "{buf}", "--pushgateway", "127.0.0.1:9"],
        1,
        r"metrics not written to 127\.0\.0\.1:9: Connection refused$",  # no Python repr
    ),
    (
        "gc with a metrics file in a missing folder",
        ["gc", "{buf}", "--metrics-file", "{dir}/no/such/gc.prom"],
        1,
        r"metrics not written: the folder of --metrics-file .* does not exist",
    ),
]


@pytest.fixture
def buf(tmp_path: Path) -> str:
    url = f"file://{tmp_path}/buf"
    r = tb(["produce", url], tmp_path, stdin="one\n")
    assert r.returncode == 0, r.stderr
    return url


@pytest.mark.slow
@pytest.mark.parametrize(("what", "argv", "code", "first"), TABLE, ids=[t[0] for t in TABLE])
def test_cli_error_table(
    tmp_path: Path, buf: str, what: str, argv: list[str], code: int, first: str
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "events.json").write_text('[\n  {"id": 1}\n]\n')
    r = tb([a.format(buf=buf, dir=work) for a in argv], work)
    _check(r, code, first)
    if code == 1:  # gc: the summary still prints on stdout
        assert r.stdout.startswith("listed "), r.stdout


def test_a_port_already_in_use(tmp_path: Path, buf: str) -> None:
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
        r = tb(["serve", buf, "--staging", str(tmp_path / "s"), "--port", str(port)], tmp_path)
    _check(r, 2, rf"cannot listen on 127.0.0.1:{port}: Address already in use")


@pytest.mark.s3
def test_a_missing_bucket(tmp_path: Path, s3_endpoint: S3Endpoint) -> None:
    env = {
        "AWS_ACCESS_KEY_ID": s3_endpoint.access_key_id,
        "AWS_SECRET_ACCESS_KEY": s3_endpoint.secret_access_key,
    }
    r = tb(
        [
            "inspect",
            "s3://no-such-bucket-tb/prefix",
            "--endpoint",
            s3_endpoint.endpoint,
            "--region",
            s3_endpoint.region,
        ],
        tmp_path,
        env,
    )
    assert r.returncode in (2, 3)
    _check(r, r.returncode, r"(?i)bucket")


def test_a_first_ctrl_c_on_consume_follow_ends_it_with_a_summary(tmp_path: Path, buf: str) -> None:
    """A first Ctrl-C on consume --follow ends it with a summary (exit 0)."""
    p = subprocess.Popen(
        [EXE, "consume", buf, "--no-ack", "--follow"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None
    assert p.stdout.readline() == "one\n"
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 0 and err.startswith("interrupted: consumed 1 batch, 1 record"), err


def test_the_table_in_getting_started_matches(tmp_path: Path) -> None:
    doc = (ROOT / "docs" / "getting-started.md").read_text("utf-8")
    for what, _argv, code, _first in TABLE:
        row = re.search(rf"^\| {re.escape(what)} \|.*\| {code} \|", doc, re.M)
        assert row, f"docs/getting-started.md has no row for {what!r} with exit {code}"


@pytest.mark.slow
def test_a_second_ctrl_c_on_serve_forces_the_exit(tmp_path: Path) -> None:
    """The store is unreachable, so the drain after the first Ctrl-C would retry until
    --drain-timeout (5 min); the second Ctrl-C kills the workers and exits 130.  The
    record stays staged (LOCAL) for the next start or tieredbuf drain."""
    import json as _json
    import time
    import urllib.request

    env = {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}
    base = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    stage = tmp_path / "stage"
    p = subprocess.Popen(
        [
            EXE,
            "serve",
            "s3://bucket/p",
            "--staging",
            str(stage),
            "--port",
            "0",
            "--workers",
            "1",
            "--endpoint",
            "http://127.0.0.1:9",
            "--region",
            "us-east-1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**base, **env},
    )
    try:
        assert p.stdout is not None and p.stderr is not None
        line = p.stdout.readline()
        m = re.search(r"http://[0-9.]+:\d+", line)
        assert m, line
        url = m.group(0)
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/readyz", timeout=5):
                    break
            except OSError:
                assert time.monotonic() < deadline, "never ready"
                time.sleep(0.1)
        req = urllib.request.Request(
            f"{url}/v1/produce?durability=local",
            data=b'{"n": 1}\n',
            headers={"Content-Type": "application/x-ndjson"},
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            assert _json.load(r)["records"] == 1
        p.send_signal(signal.SIGINT)
        seen = []
        while not seen or "Ctrl-C again" not in seen[-1]:  # the workers' log lines too
            seen.append(p.stderr.readline())
            assert seen[-1], f"no stopping line: {seen}"
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130, err
    assert "second Ctrl-C: killing the workers" in err and "stopped (exit 130)" in out
    assert list(stage.glob("worker-0/*/wal/*")), "the record stays staged"
