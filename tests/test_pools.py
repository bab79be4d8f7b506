"""Long-lived thread pools start every thread when they are made, so a process's thread
count is flat from the start: the soak (I8) reads a count that climbs minutes into a run
as a leak, and a pool that grows to its bound only when tasks first overlap does that."""

from __future__ import annotations

import threading
from datetime import timedelta

import tieredbuf
from tieredbuf.runtime.pools import started_pool


def _named(prefix: str) -> int:
    return sum(t.name.startswith(prefix) for t in threading.enumerate())


def test_a_started_pool_runs_all_its_threads_before_any_task() -> None:
    pool = started_pool(5, "t-started")
    try:
        assert _named("t-started") == 5
        assert pool.submit(lambda: 7).result() == 7
        assert _named("t-started") == 5
    finally:
        pool.shutdown(wait=True)
    assert _named("t-started") == 0


def test_consumer_and_worker_read_ahead_threads_do_not_grow_with_use() -> None:
    buf = tieredbuf.open("memory://")
    with buf.producer() as p:
        p.produce([b"x"] * 10).wait(tieredbuf.Durability.REMOTE, timeout=30)
    # counts are taken against what was there before: the suite's other tests may have
    # left a pool behind in this process, and only this test's are asserted
    there = (_named("tb-readahead"), _named("tb-worker"), _named("tb-refill"))
    c = buf.consumer()
    c.initialize()
    w = buf.worker("jobs", lease=timedelta(seconds=30))
    before = (_named("tb-readahead"), _named("tb-worker"), _named("tb-refill"))
    assert before == (  # the refill CAS runs on one thread of its own
        there[0] + c.config.read_ahead,
        there[1] + w.config.read_ahead,
        there[2] + 1,
    )
    b = c.next_batch()
    assert b is not None
    c.ack(b.sequence)
    wb = w.claim()
    assert wb is not None
    w.ack(wb.sequence)
    assert (_named("tb-readahead"), _named("tb-worker"), _named("tb-refill")) == before
    c.close()
    w.close()
    assert (_named("tb-readahead"), _named("tb-worker"), _named("tb-refill")) == there
