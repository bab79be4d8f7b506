"""A REMOTE waiter gets its segment sealed promptly (tieredbuf/produce/prompt_seal.py).

Every test sets ``max_open_duration`` to an hour, so a write can only reach REMOTE
through a prompt seal (or a close): nothing here asserts a wall-clock time.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path

import pytest

import tieredbuf
from tieredbuf.produce.handles import Durability

HOUR = timedelta(hours=1)


def _producer(tmp_path: Path, **kw: object) -> tuple[tieredbuf.Buffer, object]:
    buf = tieredbuf.open(f"file://{tmp_path}/buf")
    return buf, buf.producer(staging_dir=tmp_path / "stage", max_open_duration=HOUR, **kw)


def test_I1_a_remote_wait_seals_and_exports_the_write_long_before_max_open(
    tmp_path: Path,
) -> None:
    buf, p = _producer(tmp_path)
    h = p.produce([b"a", b"b"], metadata=b"m")  # type: ignore[attr-defined]
    out = h.wait(Durability.REMOTE, timeout=30)  # max_open_duration is an hour
    assert out.sequence == 0 and out.location.startswith("data/")
    assert [e.location for e in buf.entries()] == [out.location]
    assert p.stats["prompt_seals"] == 1  # type: ignore[attr-defined]
    p.close()  # type: ignore[attr-defined]


def test_a_callback_for_remote_asks_for_the_seal_too(tmp_path: Path) -> None:
    """The service's way of waiting: watcher.when(REMOTE, fn)."""
    _, p = _producer(tmp_path)
    done = threading.Event()
    h = p.produce([b"x"])  # type: ignore[attr-defined]
    h.watcher.when(Durability.REMOTE, done.set)
    assert done.wait(30)
    assert h.result() is not None
    p.close()  # type: ignore[attr-defined]


def test_one_seal_serves_every_waiter_that_asked_before_it(tmp_path: Path) -> None:
    buf, p = _producer(tmp_path)
    handles = [p.produce([b"%d" % i]) for i in range(10)]  # type: ignore[attr-defined]
    waiters = [threading.Thread(target=h.wait, args=(Durability.REMOTE, 30)) for h in handles]
    for t in waiters:
        t.start()
    for t in waiters:
        t.join()
    assert all(h.result() is not None for h in handles)
    stats = p.stats  # type: ignore[attr-defined]
    assert stats["prompt_seals"] == 1 and stats["segments_sealed"] == 1
    assert len(buf.entries()) == 1
    p.close()  # type: ignore[attr-defined]


def test_without_a_remote_waiter_nothing_is_sealed_early(tmp_path: Path) -> None:
    _, p = _producer(tmp_path)
    h = p.produce([b"x"])  # type: ignore[attr-defined]
    h.wait(Durability.LOCAL, timeout=30)  # LOCAL only: no prompt seal is asked for
    assert h.result() is None
    stats = p.stats  # type: ignore[attr-defined]
    assert stats["prompt_seals"] == 0 and stats["segments_sealed"] == 0
    p.close()  # type: ignore[attr-defined]
    assert h.result() is not None  # close() sealed and exported it


def test_a_reached_or_failed_write_asks_nothing(tmp_path: Path) -> None:
    calls: list[int] = []
    handles = tieredbuf.produce.handles
    w = handles.DurabilityWatcher(on_remote_wait=lambda: calls.append(1))
    w.reach(Durability.REMOTE, handles.RemoteOutcome(1, "data/x"))
    w.wait(Durability.REMOTE, timeout=1)
    w.when(Durability.REMOTE, lambda: None)
    assert calls == []
    w2 = tieredbuf.produce.handles.DurabilityWatcher(on_remote_wait=lambda: calls.append(2))
    with pytest.raises(TimeoutError):
        w2.wait(Durability.REMOTE, timeout=0.01)
    w2.when(Durability.REMOTE, lambda: None)
    assert calls == [2]  # asked once, however many waits
