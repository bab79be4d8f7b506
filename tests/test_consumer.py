"""The fenced consumer: RFC semantics, fencing (I4), read-ahead, missing objects."""

from __future__ import annotations

import pytest

import tieredbuf
from tests.faults import CountingStore
from tieredbuf.errors import AckOrderError, DataLossError, FencedError, NotInitializedError
from tieredbuf.keys import MANIFEST_KEY


def _fill(buf: tieredbuf.Buffer, n: int) -> list[list[bytes]]:
    produced = []
    with buf.producer() as p:
        for i in range(n):
            recs = [f"r{i}-{j}".encode() for j in range(3)]
            p.produce(recs, metadata=f"m{i}".encode()).wait(timeout=10)
            produced.append(recs)
    return produced


@pytest.mark.slow
def test_consumes_in_order_and_resumes_after_last_acked(any_url) -> None:  # type: ignore[no-untyped-def]
    url, opts = any_url
    buf = tieredbuf.open(url, **opts)
    produced = _fill(buf, 5)
    c = buf.consumer()
    c.initialize()
    b0 = c.next_batch()
    assert b0 is not None and b0.sequence == 0 and b0.entries == produced[0]
    assert b0.metadata[0].payload == b"m0" and b0.metadata[0].start_index == 0
    c.ack(0)
    c.flush()
    assert buf.snapshot().footer.first_sequence == 1
    c2 = buf.consumer()
    c2.initialize(last_acked_sequence=2)
    got = []
    while (b := c2.next_batch()) is not None:
        got.append(b.sequence)
        c2.ack(b.sequence)
    assert got == [3, 4]
    c2.flush()
    assert buf.snapshot().footer.entry_count == 0
    c.close()
    c2.close()


def test_I4_fenced_consumer_fails_every_operation_and_changes_nothing() -> None:
    buf = tieredbuf.open("memory://")
    _fill(buf, 4)
    a = buf.consumer(check_every=1)  # checks before every entry (the bounds: test_consumer_checks)
    a.initialize()
    ba = a.next_batch()
    assert ba is not None
    b = buf.consumer()
    b.initialize()
    before = buf.store.get(MANIFEST_KEY).data
    with pytest.raises(FencedError):
        a.next_batch()
    with pytest.raises(FencedError):
        a.ack(ba.sequence)
    with pytest.raises(FencedError):
        a.flush()
    assert buf.store.get(MANIFEST_KEY).data == before
    # B is unaffected and starts at the earliest entry
    first = b.next_batch()
    assert first is not None and first.sequence == 0


def test_acks_must_be_in_order_and_for_read_batches() -> None:
    buf = tieredbuf.open("memory://")
    _fill(buf, 3)
    c = buf.consumer()
    c.initialize()
    c.next_batch()
    c.next_batch()
    with pytest.raises(AckOrderError, match="next ack must be 0"):
        c.ack(1)
    c.ack(0)
    c.ack(1)
    with pytest.raises(AckOrderError, match="not yet read"):
        c.ack(2)


def test_dequeues_automatically_every_n_acks() -> None:
    buf = tieredbuf.open("memory://")
    _fill(buf, 5)
    c = buf.consumer(dequeue_every=2)
    c.initialize()
    for s in range(3):
        c.next_batch()
        c.ack(s)
    assert buf.snapshot().footer.first_sequence == 2  # dequeued through 1 after 2 acks


def test_missing_data_object_is_data_loss_not_a_skip() -> None:
    buf = tieredbuf.open("memory://")
    _fill(buf, 2)
    victim = buf.entries()[0].location
    buf.store.delete_many([victim])
    c = buf.consumer(read_ahead=0)
    c.initialize()
    with pytest.raises(DataLossError, match=victim):
        c.next_batch()


@pytest.mark.slow
def test_read_ahead_fetches_the_backlog_before_it_is_asked_for() -> None:
    counting = CountingStore(tieredbuf.open("memory://").store)
    buf = tieredbuf.Buffer(counting)
    _fill(buf, 6)
    c = buf.consumer(read_ahead=4)
    c.initialize()
    counting.reset()
    first = c.next_batch()
    assert first is not None
    for fut in c._ahead.pending():
        fut.result()  # let the scheduled prefetches finish
    # one GET for the first object, four read ahead; no manifest request (the window
    # initialize() read lists them all, and no check is due)
    assert counting.counts["get"] == 5
    assert counting.counts["get_suffix"] == 0
    counting.reset()
    for _ in range(4):
        assert c.next_batch() is not None
    for fut in c._ahead.pending():
        fut.result()  # the window moved on: entry 5 is being read ahead
    # served from the read-ahead; only entry 5 (newly in the window) was fetched
    assert counting.counts["get"] == 1


def test_using_the_consumer_before_initialize_is_an_error() -> None:
    c = tieredbuf.open("memory://").consumer()
    with pytest.raises(NotInitializedError):
        c.next_batch()


def test_empty_queue_returns_none_then_sees_new_entries() -> None:
    buf = tieredbuf.open("memory://")
    assert buf.create()  # an empty buffer, created explicitly: a consumer never creates one
    c = buf.consumer()
    c.initialize()
    assert c.next_batch() is None
    _fill(buf, 1)
    b = c.next_batch()
    assert b is not None and b.sequence == 0
