"""``close()`` and ``flush()`` against a store that cannot be reached return or raise
within their documented deadline: once the store has failed and nothing got through for
``RetryConfig.give_up_after`` (30 s by default), as a direct call gives up.

Each runs a real interpreter against a loopback port nothing listens on and waits for
it with a subprocess deadline: a hang fails the test (``subprocess.TimeoutExpired``).
The deadlines here are generous multiples of the ``give_up_after`` each test sets; they
catch "waits forever", not a slow machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_no_hang import closed_port, run_python
from tieredbuf.runtime.retry import StallWatch

OPEN = """
import time
from datetime import timedelta
import tieredbuf
from tieredbuf.config import RetryConfig
buf = tieredbuf.open("s3://bucket/p", endpoint="http://127.0.0.1:{port}", region="us-east-1",
                     access_key_id="k", secret_access_key="s")
retry = RetryConfig(give_up_after=timedelta(seconds=2))
"""


def _script(body: str) -> str:
    return OPEN.format(port=closed_port()) + body


@pytest.mark.slow
@pytest.mark.parametrize("staged", [False, True], ids=["stateless", "staged"])
def test_close_against_an_unreachable_store_raises_within_give_up_after(
    tmp_path: Path, staged: bool
) -> None:
    stage = f"staging_dir={str(tmp_path / 'stage')!r}, " if staged else ""
    r = run_python(
        _script(f"""
p = buf.producer({stage}retry=retry)
h = p.produce([b"a"])
try:
    p.close()
except tieredbuf.errors.FlushTimeoutError as e:
    print("RAISED", e)
"""),
        timeout=45,
    )
    assert r.returncode == 0, r.stderr
    assert "RAISED" in r.stdout and "connection refused" in r.stdout, r.stdout + r.stderr
    if staged:  # nothing is lost: the record stays staged for the next start or a drain
        assert "still staged" in r.stdout and "tieredbuf drain" in r.stdout, r.stdout
    else:
        assert "dropped" in r.stdout, r.stdout


@pytest.mark.slow
@pytest.mark.parametrize("staged", [False, True], ids=["stateless", "staged"])
def test_the_context_manager_against_an_unreachable_store_raises_within_give_up_after(
    tmp_path: Path, staged: bool
) -> None:
    stage = f"staging_dir={str(tmp_path / 'stage')!r}, " if staged else ""
    r = run_python(
        _script(f"""
try:
    with buf.producer({stage}retry=retry) as p:
        p.produce([b"a"])
except tieredbuf.errors.FlushTimeoutError as e:
    print("RAISED", type(e).__name__)
"""),
        timeout=45,
    )
    assert r.returncode == 0, r.stderr
    assert "RAISED FlushTimeoutError" in r.stdout, r.stdout + r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("staged", [False, True], ids=["stateless", "staged"])
def test_flush_against_an_unreachable_store_raises_within_give_up_after_keeping_the_data(
    tmp_path: Path, staged: bool
) -> None:
    stage = f"staging_dir={str(tmp_path / 'stage')!r}, " if staged else ""
    r = run_python(
        _script(f"""
p = buf.producer({stage}retry=retry)
h = p.produce([b"a"])
try:
    p.flush()
except tieredbuf.errors.FlushTimeoutError as e:
    print("RAISED", e)
print("STILL OPEN", p.produce([b"b"]) is not None)
try:
    p.close(timeout=0.5)
except tieredbuf.errors.FlushTimeoutError:
    pass
"""),
        timeout=45,
    )
    assert r.returncode == 0, r.stderr
    kept = "still retried" in r.stdout or "still staged" in r.stdout
    assert "RAISED" in r.stdout and kept, r.stdout + r.stderr
    assert "STILL OPEN True" in r.stdout


@pytest.mark.slow
def test_close_with_the_default_config_gives_up_after_30_s() -> None:
    """The README's producer as written, with no timeout anywhere."""
    r = run_python(
        _script("""
t = time.monotonic()
try:
    with buf.producer(flush_interval=timedelta(milliseconds=100)) as producer:
        producer.produce([b"a", b"b"], metadata=b"m")
except tieredbuf.errors.FlushTimeoutError as e:
    print("RAISED after", round(time.monotonic() - t), "s:", e)
"""),
        timeout=90,
    )
    assert r.returncode == 0, r.stderr
    assert "RAISED after" in r.stdout, r.stdout + r.stderr


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_stall_watch_gives_up_only_after_failures_with_no_progress_for_the_limit() -> None:
    clock, progress, failures = _Clock(), [0], [0]
    w = StallWatch(10.0, lambda: progress[0], lambda: failures[0], clock)
    clock.now = 100.0
    assert not w.stalled(), "no store failure: a slow store is never given up on"
    failures[0] += 1
    clock.now = 105.0
    assert not w.stalled()
    progress[0] += 1  # something got through: the clock starts again
    clock.now = 106.0
    assert not w.stalled()
    clock.now = 200.0
    assert not w.stalled(), "progress, then no failure: nothing to give up on"
    failures[0] += 1
    clock.now = 201.0
    assert not w.stalled()
    clock.now = 210.9
    assert not w.stalled()
    clock.now = 211.0
    assert w.stalled()


def test_stall_watch_without_a_limit_never_gives_up() -> None:
    clock, failures = _Clock(), [0]
    w = StallWatch(None, lambda: 0, lambda: failures[0], clock)
    failures[0] = 5
    clock.now = 1e9
    assert not w.stalled()


@pytest.mark.slow
def test_produce_at_backpressure_against_an_unreachable_store_raises_within_give_up_after() -> None:
    """A stateless producer's produce() with no ``timeout`` waits at a full buffer while
    the store works (a slow store only slows it), but not forever on a store that keeps
    failing: BackpressureError once nothing got through for ``give_up_after``."""
    r = run_python(
        _script("""
p = buf.producer(retry=retry, max_buffered_inputs=2)
try:
    for i in range(10):
        p.produce([b"a"])
    print("NEVER FULL")
except tieredbuf.errors.BackpressureError as e:
    print("RAISED", e)
"""),
        timeout=45,
    )
    assert r.returncode == 0, r.stderr
    assert "RAISED" in r.stdout and "connection refused" in r.stdout, r.stdout + r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("staged", [False, True], ids=["stateless", "staged"])
def test_waiting_for_remote_against_an_unreachable_store_gives_up_within_give_up_after(
    tmp_path: Path, staged: bool
) -> None:
    """``handle.wait(REMOTE)`` with no ``timeout`` waited forever while the store kept
    failing; it now raises FlushTimeoutError (a TimeoutError) once nothing got through
    for ``give_up_after``, as close() does.  The write is not failed by that: it is still
    retried (stateless, in memory) or stays staged (LOCAL)."""
    stage = f"staging_dir={str(tmp_path / 'stage')!r}, " if staged else ""
    r = run_python(
        _script(f"""
p = buf.producer({stage}retry=retry)
h = p.produce([b"a"])
try:
    h.wait(tieredbuf.Durability.REMOTE)
    print("REMOTE")
except TimeoutError as e:
    print("RAISED", type(e).__name__, e)
print("RESULT", h.result())  # not failed: still pending
try:
    p.close()
except tieredbuf.errors.FlushTimeoutError:
    pass
"""),
        timeout=45,
    )
    assert r.returncode == 0, r.stderr
    assert "RAISED FlushTimeoutError" in r.stdout, r.stdout + r.stderr
    assert "connection refused" in r.stdout and "RESULT None" in r.stdout, r.stdout
