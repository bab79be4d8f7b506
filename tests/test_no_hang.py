"""Nothing hangs, in Python: a failed producer's threads never keep the interpreter
alive, a direct call gives up on a store that stays down (saying so at WARNING while it
retries), and a local path that is a file is a permanent error, never retried.

Each "does it exit" check runs a real interpreter (``python -c``) and waits for it with
a deadline: a hang fails the test by ``subprocess.TimeoutExpired``.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import pytest

import tieredbuf
from tieredbuf import errors

AWS = {"region": "us-east-1", "access_key_id": "k", "secret_access_key": "s"}


def closed_port() -> int:
    """A loopback port nothing listens on (connections are refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_python(code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_readme_snippet_against_a_wrong_port_raises_and_the_interpreter_exits() -> None:
    """The README's producer lines against a port nothing listens on: the REMOTE wait
    times out, the script ends with that error, and the process exits (an upload thread
    still retrying used to be joined at exit forever)."""
    r = run_python(f"""
        from datetime import timedelta
        import tieredbuf
        buf = tieredbuf.open("s3://bucket/prefix", endpoint="http://127.0.0.1:{closed_port()}",
                             region="us-east-1", access_key_id="k", secret_access_key="s")
        producer = buf.producer(flush_interval=timedelta(milliseconds=100))
        handle = producer.produce([b"a", b"b"], metadata=b"m")
        handle.wait(tieredbuf.Durability.REMOTE, timeout=2)
    """)
    assert r.returncode == 1, r.stderr
    assert "TimeoutError: write not REMOTE after 2 s" in r.stderr


def test_a_producer_never_closed_does_not_keep_the_interpreter_alive() -> None:
    r = run_python(f"""
        import tieredbuf
        buf = tieredbuf.open("s3://bucket/prefix", endpoint="http://127.0.0.1:{closed_port()}",
                             region="us-east-1", access_key_id="k", secret_access_key="s")
        p = buf.producer()
        p.produce([b"a"])
        print("leaving with the upload still retrying", flush=True)
    """)
    assert r.returncode == 0, r.stderr
    assert "leaving" in r.stdout


@pytest.mark.slow
def test_create_against_a_host_that_does_not_resolve_gives_up_and_warns_while_retrying(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``buf.create()`` used to retry in silence for as long as the caller waited."""
    from tieredbuf.config import RetryConfig

    buf = tieredbuf.open("s3://bucket/prefix", endpoint="http://no-such-host.invalid:9000", **AWS)
    buf.queue.retry = RetryConfig(give_up_after=timedelta(seconds=2))
    caplog.set_level(logging.WARNING, logger="tieredbuf")
    with pytest.raises(errors.StoreUnreachableError) as ei:
        buf.create()
    msg = str(ei.value)
    assert "does not resolve" in msg and "gave up after" in msg, msg
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("does not resolve" in m and "retrying" in m for m in warned), warned
    # once per interval, not once per attempt
    assert len([m for m in warned if "retrying" in m]) == 1, warned


def test_the_default_deadline_of_a_direct_call_is_bounded() -> None:
    from tieredbuf.config import RetryConfig

    assert RetryConfig().give_up_after is not None
    assert RetryConfig().give_up_after <= timedelta(minutes=1)
    with pytest.raises(errors.ConfigError):
        RetryConfig(give_up_after=timedelta(0))


def test_a_regular_file_as_the_store_root_is_a_permanent_error(tmp_path: Path) -> None:
    """``tieredbuf.open("events.json")`` on an existing file: EEXIST from the directory
    creation is permanent (it used to be retried forever)."""
    f = tmp_path / "events.json"
    f.write_text('{"a": 1}\n')
    buf = tieredbuf.open(str(f))
    with pytest.raises(errors.PermanentStoreError, match="not a directory"):
        buf.store.put("data/x", b"1", mode="create")
    p = buf.producer()
    h = p.produce([b"x"])
    with pytest.raises(errors.PermanentStoreError):
        h.wait(tieredbuf.Durability.REMOTE, timeout=30)
    with pytest.raises(errors.PermanentStoreError):
        p.close(timeout=30)
    assert f.read_text() == '{"a": 1}\n'


def test_a_path_under_a_regular_file_is_a_permanent_error(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    buf = tieredbuf.open(str(f / "buf"))
    with pytest.raises(errors.PermanentStoreError):
        buf.create()
