"""The newcomer's first hour on the command line: nothing hangs, and the CLI speaks in
CLI terms.  Every test runs the real ``tieredbuf`` executable; a hang fails it through
the subprocess deadline (``subprocess.TimeoutExpired``), never by waiting forever.

The store that cannot be reached is a loopback port nothing listens on; credentials
checks run against SeaweedFS (moto accepts any key).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tieredbuf
from tests.endpoint import S3Endpoint

EXE = shutil.which("tieredbuf") or str(Path(sys.executable).with_name("tieredbuf"))
DEADLINE = 60.0
"""No command here may take longer (a hang fails the test)."""


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def env_for(home: Path, **extra: str) -> dict[str, str]:
    """The environment without AWS_* and with HOME in the test's directory: nothing of
    the machine's own ~/.aws or AWS settings leaks in."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    return {**base, "HOME": str(home), **extra}


def tb(
    argv: list[str],
    cwd: Path,
    *,
    env: dict[str, str] | None = None,
    stdin: str = "",
    timeout: float = DEADLINE,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [EXE, *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        input=stdin,
        timeout=timeout,
        env=env or env_for(cwd),
    )


KEYS = {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}


def no_traceback(r: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in r.stderr and "Debug source" not in r.stderr, r.stderr


# --- nothing hangs --------------------------------------------------------------------


@pytest.mark.slow
def test_produce_to_an_unreachable_store_gives_up_at_timeout_naming_what_was_not_stored(
    tmp_path: Path,
) -> None:
    r = tb(
        [
            "produce",
            "s3://bucket/p",
            "--endpoint",
            f"http://127.0.0.1:{closed_port()}",
            "--region",
            "us-east-1",
            "--timeout",
            "2s",
        ],
        tmp_path,
        env=env_for(tmp_path, **KEYS),
        stdin="a\nb\nc\n",
    )
    assert r.returncode == 3, r.stderr
    no_traceback(r)
    lines = r.stderr.strip().splitlines()
    assert len(lines) <= 3, "retries are reported once per interval: " + r.stderr
    last = lines[-1]
    assert "still failed after --timeout 2s" in last and "connection refused" in last, last
    assert "3 of 3 records not stored" in last and "input records #1..#3" in last, last
    assert r.stdout == ""


@pytest.mark.slow
def test_produce_with_a_stage_names_what_is_still_staged_and_how_to_export_it(
    tmp_path: Path,
) -> None:
    stage = tmp_path / "stage"
    r = tb(
        [
            "produce",
            "s3://bucket/p",
            "--staging",
            str(stage),
            "--timeout",
            "2s",
            "--endpoint",
            f"http://127.0.0.1:{closed_port()}",
            "--region",
            "us-east-1",
        ],
        tmp_path,
        env=env_for(tmp_path, **KEYS),
        stdin="a\nb\n",
    )
    assert r.returncode == 3, r.stderr
    no_traceback(r)
    last = r.stderr.strip().splitlines()[-1]
    assert f"2 records still staged in {stage}" in last, last
    assert f"tieredbuf drain {stage} s3://bucket/p" in last, last
    assert list(stage.glob("*/wal/*")), "the records are on disk in the stage"


@contextlib.contextmanager
def moto_failing_object_puts() -> Iterator[str]:
    """An S3 endpoint (moto's app, the session server's state) that answers every object
    PUT with 503 SlowDown: reads work, writes keep failing transiently."""
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    inner = DomainDispatcherApplication(create_backend_app)

    def app(environ: dict[str, Any], start_response: Any) -> Any:
        if environ["REQUEST_METHOD"] == "PUT" and environ["PATH_INFO"].strip("/").count("/"):
            start_response("503 Service Unavailable", [("Content-Type", "application/xml")])
            return [b"<Error><Code>SlowDown</Code><Message>test: PUTs fail</Message></Error>"]
        return inner(environ, start_response)

    server = make_server("127.0.0.1", 0, app, True, request_handler=MotoRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        thread.join()


@pytest.mark.s3
@pytest.mark.slow
def test_a_write_command_gives_up_at_timeout_and_names_the_flag(
    tmp_path: Path,
    s3_endpoint: S3Endpoint,
) -> None:
    """``grace URL 20m`` reads the buffer, then its write keeps failing (503): it gives up
    at --timeout with one line naming the flag, instead of retrying for ever."""
    url = f"s3://{s3_endpoint.new_bucket()}/b"
    tieredbuf.open(url, **s3_endpoint.options()).create()
    env = env_for(
        tmp_path,
        AWS_ACCESS_KEY_ID=s3_endpoint.access_key_id,
        AWS_SECRET_ACCESS_KEY=s3_endpoint.secret_access_key,
    )
    with moto_failing_object_puts() as endpoint:
        r = tb(
            [
                "grace",
                url,
                "20m",
                "--timeout",
                "2s",
                "--endpoint",
                endpoint,
                "--region",
                s3_endpoint.region,
            ],
            tmp_path,
            env=env,
        )
    assert r.returncode == 3, r.stderr
    no_traceback(r)
    lines = r.stderr.strip().splitlines()
    assert "failed, attempt 1" in lines[0] and "retrying" in lines[0], lines  # WARNING
    assert "gave up after" in lines[-1] and "(--timeout 2s)" in lines[-1], lines[-1]
    assert len(lines) <= 3, lines


@pytest.mark.slow
def test_every_command_that_writes_has_a_timeout_with_a_default(tmp_path: Path) -> None:
    for cmd in ("produce", "consume", "work", "grace", "retention", "subscribers", "gc", "drain"):
        r = tb([cmd, "--help"], tmp_path)
        assert r.returncode == 0, r.stderr
        text = " ".join(r.stdout.split())
        assert re.search(r"--timeout DURATION .*\(default \d+[smh]\)", text), (cmd, text)


@pytest.mark.slow
def test_a_regular_file_as_the_url_exits_2_at_once(tmp_path: Path) -> None:
    """``echo x | tieredbuf produce events.json``: the URL left out, the input file taken
    for a local store; it used to retry 'File exists' forever."""
    f = tmp_path / "events.json"
    f.write_text('{"n": 1}\n')
    for url in ("events.json", "file://./events.json", f"file://{f}"):
        r = tb(["produce", url], tmp_path, stdin="x\n")
        assert r.returncode == 2, (url, r.stderr)
        no_traceback(r)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "is a file, not a buffer" in lines[0], lines
        assert "tieredbuf produce URL" in lines[0]
    assert f.read_text() == '{"n": 1}\n'


@pytest.mark.slow
def test_one_ctrl_c_stops_produce_without_a_traceback(tmp_path: Path) -> None:
    """The first Ctrl-C used to print a KeyboardInterrupt traceback from producer.close
    and leave the process alive."""
    p = subprocess.Popen(
        [
            EXE,
            "produce",
            "s3://bucket/p",
            "--endpoint",
            f"http://127.0.0.1:{closed_port()}",
            "--region",
            "us-east-1",
            "--timeout",
            "10m",
        ],
        cwd=tmp_path,
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env_for(tmp_path, **KEYS),
    )
    try:
        assert p.stdin is not None and p.stderr is not None
        p.stdin.write("a\nb\n")
        p.stdin.close()
        first = p.stderr.readline()  # the store is being retried: the command is stuck
        assert "failed, attempt 1" in first, first
        p.send_signal(signal.SIGINT)
        p.wait(timeout=DEADLINE)
        err = p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("tieredbuf: interrupted: 2 of 2 records not confirmed stored"), last


# --- the CLI speaks in CLI terms -------------------------------------------------------


@pytest.mark.slow
def test_messages_name_flags_and_environment_variables_not_python_keywords(
    tmp_path: Path,
) -> None:
    url = f"file://{tmp_path}/buf"
    assert tb(["produce", url], tmp_path, stdin="x\n").returncode == 0
    r = tb(["grace", url, "1m"], tmp_path)
    assert r.returncode == 2 and "pass --force only" in r.stderr, r.stderr
    assert "force=True" not in r.stderr
    r = tb(["inspect", "s3://bucket/prefix"], tmp_path)
    assert r.returncode == 2, r.stderr
    line = r.stderr.strip()
    for said in ("AWS_ACCESS_KEY_ID", "--instance-metadata", "--skip-signature", "AWS_PROFILE"):
        assert said in line, (said, line)
    for python in ("instance_metadata=", "skip_signature=", "access_key_id=", "=True"):
        assert python not in line, (python, line)


@pytest.mark.slow
@pytest.mark.s3
def test_options_and_positionals_come_in_any_order(tmp_path: Path, s3_endpoint: S3Endpoint) -> None:
    url = f"s3://{s3_endpoint.new_bucket()}/b"
    env = env_for(
        tmp_path,
        AWS_ACCESS_KEY_ID=s3_endpoint.access_key_id,
        AWS_SECRET_ACCESS_KEY=s3_endpoint.secret_access_key,
    )
    ep = ["--endpoint", s3_endpoint.endpoint]
    r = tb(["produce", *ep, url, "--region", s3_endpoint.region], tmp_path, env=env, stdin="x\n")
    assert r.returncode == 0, r.stderr
    # the issue's own example: grace URL --endpoint X 1m ("unrecognized arguments: 1m")
    r = tb(["grace", url, *ep, "10m", "--region", s3_endpoint.region], tmp_path, env=env)
    assert (r.returncode, r.stdout) == (0, "0:10:00\n"), r.stderr
    r = tb(["subscribers", "--json", *ep, url], tmp_path, env=env)
    assert (r.returncode, r.stdout) == (0, "[]\n"), r.stderr


def _aws_files(home: Path, ep: S3Endpoint, *, default_secret: str) -> None:
    (home / ".aws").mkdir()
    (home / ".aws" / "credentials").write_text(
        f"[default]\naws_access_key_id = {ep.access_key_id}\n"
        f"aws_secret_access_key = {default_secret}\n\n"
        f"[tb]\naws_access_key_id = {ep.access_key_id}\n"
        f"aws_secret_access_key = {ep.secret_access_key}\n"
    )
    (home / ".aws" / "config").write_text(f"[profile tb]\nregion = {ep.region}\n")


@pytest.mark.s3
@pytest.mark.slow
def test_credentials_come_from_a_profile_in_aws_files(
    tmp_path: Path, seaweedfs_endpoint: S3Endpoint
) -> None:
    """``~/.aws/credentials`` and ``AWS_PROFILE`` are read as the aws CLI reads them:
    the profile's keys are the ones sent (SeaweedFS rejects the default profile's)."""
    ep = seaweedfs_endpoint
    bucket = ep.new_bucket()
    home = tmp_path / "home"
    home.mkdir()
    _aws_files(home, ep, default_secret="wrong-secret")
    argv = ["produce", f"s3://{bucket}/b", "--endpoint", ep.endpoint]
    r = tb(argv, tmp_path, env=env_for(home, AWS_PROFILE="tb"), stdin="x\n")
    assert r.returncode == 0, r.stderr  # the profile's region too: no --region given
    r = tb(argv, tmp_path, env=env_for(home, AWS_REGION=ep.region), stdin="y\n")
    assert r.returncode == 3, r.stderr  # the default profile: its secret is wrong
    assert "credentials" in r.stderr.lower(), r.stderr
    # the files where AWS_SHARED_CREDENTIALS_FILE / AWS_CONFIG_FILE say
    moved = tmp_path / "elsewhere"
    shutil.move(str(home / ".aws"), moved)
    r = tb(
        ["inspect", f"s3://{bucket}/b", "--endpoint", ep.endpoint, "--quick"],
        tmp_path,
        env=env_for(
            home,
            AWS_PROFILE="tb",
            AWS_SHARED_CREDENTIALS_FILE=str(moved / "credentials"),
            AWS_CONFIG_FILE=str(moved / "config"),
        ),
    )
    assert r.returncode == 0 and "depth" in r.stdout, r.stderr
    r = tb(
        ["inspect", f"s3://{bucket}/b", "--endpoint", ep.endpoint],
        tmp_path,
        env=env_for(
            home,
            AWS_PROFILE="nope",
            AWS_SHARED_CREDENTIALS_FILE=str(moved / "credentials"),
            AWS_CONFIG_FILE=str(moved / "config"),
        ),
    )
    assert r.returncode == 2 and "profile 'nope'" in r.stderr, r.stderr


@pytest.mark.slow
def test_pretty_printed_json_is_refused_with_the_fix(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/buf"
    pretty = '[\n  {"id": 1},\n  {"id": 2}\n]\n'
    (tmp_path / "events.json").write_text(pretty)
    for argv, stdin in (([url, "events.json"], ""), ([url], pretty)):
        r = tb(["produce", *argv], tmp_path, stdin=stdin)
        assert r.returncode == 2, r.stderr
        line = r.stderr.strip()
        assert "pretty-printed JSON" in line and "--format json" in line and "jq -c" in line
        assert not tieredbuf.open(url).exists(), "nothing produced"
    r = tb(["produce", url, "events.json", "--format", "json"], tmp_path)
    assert r.returncode == 0, r.stderr
    buf = tieredbuf.open(url)
    got = [
        r
        for e in buf.reader()
        for r in tieredbuf.ConsumedBatch(
            e.sequence, e.location, e.metadata, buf.read_object(e)
        ).entries
    ]
    assert got == [b'{"id":1}', b'{"id":2}']
    # one record per line stays as it was, and --format lines takes any lines as they are
    r = tb(["produce", url, "--format", "lines"], tmp_path, stdin="[\n")
    assert r.returncode == 0, r.stderr
    r = tb(["produce", url], tmp_path, stdin='{"id": 3}\n{"id": 4}\n')
    assert r.returncode == 0, r.stderr


@pytest.mark.slow
def test_help_has_no_markup_and_every_command_a_description(tmp_path: Path) -> None:
    r = tb(["--help"], tmp_path)
    assert r.returncode == 0 and "``" not in r.stdout, r.stdout
    commands = re.findall(r"^    ([\w-]+)", r.stdout, re.M)
    assert {"produce", "consume", "work", "gc", "serve"} <= set(commands), commands
    for cmd in commands:
        r = tb([cmd, "--help"], tmp_path)
        assert r.returncode == 0, (cmd, r.stderr)
        assert "``" not in r.stdout, (cmd, r.stdout)
        # usage, a blank line, then the description before the argument list
        description = r.stdout.split("\n\n")[1]
        assert not description.startswith(("positional arguments", "options")), (cmd, r.stdout)
    r = tb(["produce", "--help"], tmp_path)
    assert "one record per line" in r.stdout and "--format json" in r.stdout


# --- --timeout: how long the store may keep failing --------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("value", ["0", "-5s", "=-5s", "-1"])
@pytest.mark.parametrize("command", ["produce", "consume", "gc", "drain"])
def test_a_timeout_that_is_not_positive_is_one_line_saying_so(
    tmp_path: Path, command: str, value: str
) -> None:
    """``--timeout 0`` used to run and then report that the store "still failed" (it
    never had), and ``--timeout -5s`` was taken for an option ("expected one argument")."""
    flag = ["--timeout" + value] if value.startswith("=") else ["--timeout", value]
    argv = [command, *(["stage"] if command == "drain" else []), "file://./b", *flag]
    r = tb(argv, tmp_path, stdin="a\n")
    assert r.returncode == 2, r.stderr
    no_traceback(r)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "--timeout" in lines[0] and "more than 0" in lines[0], lines[0]
    assert "expected one argument" not in lines[0], lines[0]


def test_timeout_is_how_long_the_store_may_fail_not_how_long_produce_may_take(
    tmp_path: Path,
) -> None:
    """A healthy store never starts the clock: a tiny --timeout still produces
    everything, through backpressure (one record per call, more calls than the producer
    buffers) and the final flush."""
    r = tb(
        ["produce", "file://./b", "--timeout", "1ms", "--batch", "1"],
        tmp_path,
        stdin="".join(f"{i}\n" for i in range(2500)),
    )
    assert r.returncode == 0, r.stderr
    assert "produced 2500 records in 2500 calls" in r.stdout, r.stdout
    assert "still failed" not in r.stderr, r.stderr
