"""DurabilityWatcher: waits wake on the level they asked for, time out, and see failures.

The watcher keeps no Condition (a plain lock, and a lock per blocked waiter made only
when someone blocks); these pin down the waiting semantics that scheme must keep.
"""

from __future__ import annotations

import threading
import time

import pytest

from tieredbuf.produce.handles import Durability, DurabilityWatcher, RemoteOutcome, WriteOutcome


def _poll(pred: object, deadline: float = 10.0) -> None:
    end = time.monotonic() + deadline
    while not pred():  # type: ignore[operator]
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.001)


def _blocked_waiter(w: DurabilityWatcher, level: Durability, out: list[object]) -> threading.Thread:
    def run() -> None:
        try:
            out.append(w.wait(level))
        except BaseException as e:
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    _poll(lambda: w._waiters)  # it is blocked on its own lock
    return t


def test_waiter_blocked_for_remote_stays_blocked_at_local_and_wakes_at_remote() -> None:
    w = DurabilityWatcher()
    out: list[object] = []
    t = _blocked_waiter(w, Durability.REMOTE, out)
    w.reach(Durability.LOCAL)
    _poll(lambda: w._waiters)  # woken, re-checked, blocked again
    assert out == [] and t.is_alive()
    outcome = RemoteOutcome(7, "data/x.batch")
    w.reach(Durability.REMOTE, outcome)
    t.join(10)
    assert out == [outcome]


def test_I10_remote_is_reached_only_with_the_entry_it_names() -> None:
    """A REMOTE outcome without its sequence (or data object) cannot be made, and a
    watcher cannot reach REMOTE without one: the promise needs the entry (I10)."""
    with pytest.raises(ValueError, match="I10"):
        WriteOutcome(None, "data/x.batch", Durability.REMOTE)
    with pytest.raises(ValueError, match="I10"):
        WriteOutcome(3, None, Durability.REMOTE)
    w = DurabilityWatcher()
    with pytest.raises(TypeError, match="I10"):
        w.reach(Durability.REMOTE)
    with pytest.raises(TypeError, match="I10"):
        w.reach(Durability.REMOTE, WriteOutcome(3, "data/x.batch", Durability.REMOTE))  # type: ignore[arg-type]
    assert w.level is None


def test_several_waiters_all_wake() -> None:
    w = DurabilityWatcher()
    outs: list[list[object]] = [[] for _ in range(3)]
    threads = [_blocked_waiter(w, Durability.LOCAL, o) for o in outs]
    _poll(lambda: w._waiters is not None and len(w._waiters) == 3)
    w.reach(Durability.LOCAL)
    for t in threads:
        t.join(10)
    assert [o[0].durability for o in outs] == [Durability.LOCAL] * 3  # type: ignore[union-attr]


def test_failure_wakes_a_blocked_waiter_with_the_error() -> None:
    w = DurabilityWatcher()
    out: list[object] = []
    t = _blocked_waiter(w, Durability.REMOTE, out)
    err = OSError("store says no")
    w.fail(err)
    t.join(10)
    assert out == [err]


def test_timeout_raises_and_leaves_no_waiter_behind() -> None:
    w = DurabilityWatcher()
    with pytest.raises(TimeoutError):
        w.wait(Durability.LOCAL, timeout=0.01)
    assert not w._waiters
    with pytest.raises(TimeoutError):
        w.wait(Durability.LOCAL, timeout=0)
    w.reach(Durability.LOCAL)
    assert w.wait(Durability.LOCAL, timeout=0).durability == Durability.LOCAL
