"""The stateless producer: flush triggers, group commit, backpressure, order, GC-grace guard."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest

import tieredbuf
from tieredbuf.errors import BackpressureError, ClosedError
from tieredbuf.store import open_store

HOUR = timedelta(hours=1)


class GatedStore:
    """Forwards to a store; data-object PUTs wait until ``gate`` is set (real synchronisation)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.gate = threading.Event()
        self.waiting = threading.Semaphore(0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def put(self, key: str, data: Any, *, mode: Any = "overwrite") -> str:
        if key.startswith("data/"):
            self.waiting.release()
            self.gate.wait()
        return str(self.inner.put(key, data, mode=mode))


def test_flush_interval_is_driven_by_a_timer() -> None:
    buf = tieredbuf.open("memory://")
    p = buf.producer(flush_interval=timedelta(milliseconds=20))
    out = p.produce([b"x"]).wait(timeout=10)  # nobody calls flush(): the timer must
    assert out.sequence == 0 and out.location is not None
    assert buf.entries()[0].location == out.location
    p.close()


def test_flush_size_bytes_triggers_a_flush() -> None:
    buf = tieredbuf.open("memory://")
    p = buf.producer(flush_interval=HOUR, flush_size_bytes=100)
    small = p.produce([b"a" * 10])
    big = p.produce([b"b" * 200])
    assert big.wait(timeout=10).sequence == 0
    assert small.result() is not None  # same batch
    p.close()


def test_calls_in_one_batch_get_their_own_metadata_items() -> None:
    buf = tieredbuf.open("memory://")
    p = buf.producer(flush_interval=HOUR)
    h1 = p.produce([b"a", b"b"], metadata=b"first")
    h2 = p.produce([b"c"], metadata=b"second")
    p.flush(timeout=10)
    assert h1.result() == h2.result()
    (entry,) = buf.entries()
    items = entry.metadata
    assert [(m.start_index, m.payload) for m in items] == [(0, b"first"), (2, b"second")]
    assert items[0].ingestion_time_ms <= items[1].ingestion_time_ms
    c = buf.consumer()
    c.initialize()
    batch = c.next_batch()
    assert batch is not None and batch.entries == [b"a", b"b", b"c"]
    p.close()


def test_I8_backpressure_at_max_buffered_inputs() -> None:
    gated = GatedStore(open_store("memory://"))
    buf = tieredbuf.Buffer(gated)  # type: ignore[arg-type]
    p = buf.producer(max_buffered_inputs=2, flush_interval=timedelta(0))
    h1 = p.produce([b"1"])
    h2 = p.produce([b"2"])
    gated.waiting.acquire(timeout=10)  # an upload is in flight and held
    with pytest.raises(BackpressureError):
        p.produce([b"3"], timeout=0.05)
    assert p.stats.get("backpressure_timeouts") == 1
    gated.gate.set()
    h3 = p.produce([b"3"], timeout=10)
    for h in (h1, h2, h3):
        h.wait(timeout=10)
    p.close()
    recs = []
    c = buf.consumer()
    c.initialize()
    while (b := c.next_batch()) is not None:
        recs.extend(b.entries)
    assert recs == [b"1", b"2", b"3"]


def test_I8_backpressure_by_bytes() -> None:
    gated = GatedStore(open_store("memory://"))
    p = tieredbuf.Buffer(gated).producer(  # type: ignore[arg-type]
        max_buffered_bytes=1000, flush_interval=timedelta(0)
    )
    p.produce([b"x" * 600])
    gated.waiting.acquire(timeout=10)
    with pytest.raises(BackpressureError):
        p.produce([b"y" * 600], timeout=0.05)
    gated.gate.set()
    p.close()


def test_I3_one_producers_batches_keep_their_order() -> None:
    buf = tieredbuf.open("memory://")
    p = buf.producer(flush_interval=timedelta(0))
    handles = [p.produce([str(i).encode()]) for i in range(60)]
    p.close()
    seqs = [h.result().sequence for h in handles]  # type: ignore[union-attr]
    assert seqs == sorted(seqs)
    c = buf.consumer()
    c.initialize()
    got = []
    while (b := c.next_batch()) is not None:
        got.extend(int(r) for r in b.entries)
    assert got == list(range(60))


def test_close_flushes_and_later_produce_is_refused() -> None:
    buf = tieredbuf.open("memory://")
    p = buf.producer(flush_interval=HOUR)
    h = p.produce([b"last"])
    p.close()
    assert h.result() is not None
    assert len(buf.entries()) == 1
    with pytest.raises(ClosedError):
        p.produce([b"late"])


def test_bad_input_is_a_clear_error() -> None:
    p = tieredbuf.open("memory://").producer()
    with pytest.raises(TypeError, match="list of byte records"):
        p.produce(b"not-a-list")
    with pytest.raises(TypeError, match="bytes-like"):
        p.produce([1, 2])
    with pytest.raises(tieredbuf.errors.ConfigError, match="unknown producer option"):
        tieredbuf.open("memory://").producer(flush_intervall=1)
    with pytest.raises(tieredbuf.errors.ConfigError, match="timedelta"):
        tieredbuf.open("memory://").producer(flush_interval=100)
    p.close()


def test_I8_a_batch_holding_half_the_input_budget_is_cut_without_waiting_for_the_timer() -> None:
    buf = tieredbuf.open("memory://")
    p = buf.producer(max_buffered_inputs=4, flush_interval=HOUR)
    first = p.produce([b"a"])
    second = p.produce([b"b"])  # 2 of 4: half the budget sits in the open batch
    assert second.wait(timeout=10).sequence == 0
    assert first.result() == second.result()
    p.close()
