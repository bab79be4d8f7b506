"""A committer whose clock is minutes ahead: reported, never a silent stall (I10).

The review's case 2: a holder of the commit lease whose clock ran 6 minutes ahead (GC
grace 10 minutes) took a correct-clock writer's fresh uploads for ones older than half
the grace period and held them back for ever, while it acked its own; the writer's
``close()`` dropped its records and nothing said why.  Now the writer measures the
holder's clock from each commit it reads and, past the documented bound (0.4 of the
grace period, docs/architecture.md "Clocks"), says so: a WARNING naming the holder, the
``clock_skew_ms`` gauge, ``commit_health()``, and the service's ``/healthz``.  Its writes
wait and time out loudly; they are never acked without their entry.

The holder is a real process whose whole clock (``time.time``) runs ahead.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import tieredbuf
from tieredbuf import errors
from tieredbuf.produce.fanin import hub_for

WORKER = Path(__file__).with_name("ack_torture_worker.py")


@contextmanager
def _holder(url: str, ahead_ms: int) -> Iterator[subprocess.Popen[bytes]]:
    """A producer process whose clock is ``ahead_ms`` ahead, holding the commit lease
    (it writes all the time); yields once one of its writes is REMOTE."""
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), url, "h", "direct", "-", str(ahead_ms), "1", "0", "0", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    remote = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(b"REMOTE "):
                remote.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert remote.wait(60), "the holder never committed"
        yield proc
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)


def _until(cond: object, timeout: float = 60) -> float:
    """Seconds until ``cond()`` holds (fails past ``timeout``)."""
    start = time.monotonic()
    while not cond():  # type: ignore[operator]
        assert time.monotonic() - start < timeout, "timed out"
        time.sleep(0.05)
    return time.monotonic() - start


@pytest.mark.slow
@pytest.mark.parametrize("ahead_min", [6, 11])
def test_I10_a_committer_minutes_ahead_is_reported_and_no_write_is_acked_without_its_entry(
    tmp_path: Path, ahead_min: int, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"file://{tmp_path}/b"
    buf = tieredbuf.open(url)
    buf.create()  # the default grace period: 10 minutes, half of it 5
    with _holder(url, ahead_min * 60_000):
        hub = hub_for(buf.store, buf.queue)
        p = buf.producer()
        with caplog.at_level(logging.WARNING, logger="tieredbuf"):
            h = p.produce([b"w:0"])
            took = _until(lambda: p.commit_health() is not None)
        print(f"{ahead_min} min ahead: reported after {took:.2f} s: {p.commit_health()}")
        assert "ahead of this process" in (p.commit_health() or "")
        lease = buf.snapshot().root.lease
        assert lease is not None and lease.holder in (p.commit_health() or "")
        assert lease.holder in caplog.text and "clock" in caplog.text
        skew = hub.stats.get("clock_skew_ms")
        assert ahead_min * 60_000 - 5_000 < skew <= ahead_min * 60_000 + 1_000
        assert h.result() is None  # waiting: never acked without its entry
        with pytest.raises(errors.FlushTimeoutError):
            p.close(timeout=1)
    records = {
        r
        for e in buf.entries()
        for r in tieredbuf.ConsumedBatch(
            e.sequence, e.location, e.metadata, buf.read_object(e)
        ).entries
    }
    assert b"w:0" not in records


@pytest.mark.slow
def test_a_committer_a_minute_ahead_takes_a_writers_fresh_uploads(tmp_path: Path) -> None:
    """Inside the bound nothing is reported and the writes land."""
    url = f"file://{tmp_path}/b"
    buf = tieredbuf.open(url)
    buf.create()
    with _holder(url, 60_000), buf.producer() as p:
        out = p.produce([b"w:0"]).wait(timeout=60)
        assert p.commit_health() is None
    assert out.sequence in {e.sequence for e in buf.entries()}
