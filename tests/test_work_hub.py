"""The workers one buffer opens on one work queue write its progress object as one
writer (tieredbuf/consume/hub.py): refills asked while a CAS is under way ride the next
one together, and the workers never race each other for the object (I9: each entry
acked exactly once all the same)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest

import tieredbuf
from tests.faults import CountingStore
from tests.subscriber_util import seed
from tests.test_workers import GatedStore
from tieredbuf import keys
from tieredbuf.errors import SubscriberRemovedError
from tieredbuf.store import open_store


class SlowProgressStore(CountingStore):
    """Writes of a progress object take ``put_s`` (S3's round trip, shortened), so that
    workers that each write it themselves overlap and lose races."""

    def __init__(self, inner: Any, put_s: float) -> None:
        super().__init__(inner)
        self.put_s = put_s

    def put(self, key: str, data: Any, *, mode: Any = "overwrite") -> str:
        if key.startswith(keys.SUBSCRIBERS_PREFIX):
            time.sleep(self.put_s)  # the write's latency, not a wait for another thread
        return super().put(key, data, mode=mode)


def test_I9_eight_worker_threads_of_one_buffer_never_race_each_other_for_the_progress() -> None:
    """Eight workers of one buffer drain a backlog on threads of their own: every entry is
    acked exactly once, and no progress CAS of theirs ever meets another's write (each
    refill would otherwise race seven others, and lose about once a write)."""
    store = SlowProgressStore(open_store("memory://"), put_s=0.004)
    buf = tieredbuf.Buffer(store)
    n = 240
    seed(buf, n)
    applied: list[int] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            w = buf.worker("jobs", claim_batch=4, publish_interval=timedelta(hours=1))
            w.on_applied = lambda seqs: _extend(lock, applied, seqs)
            while (b := w.claim()) is not None:
                assert b.entries == [b"r%d" % b.sequence]
                w.ack(b.sequence)
            w.close()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert sorted(applied) == list(range(n))  # each acked exactly once
    (info,) = [s for s in buf.subscribers() if s.name == "jobs"]
    assert info.next_sequence == n and info.work["leased"] == 0
    stats = buf.queue.stats.snapshot()
    assert stats.get("progress_conflicts", 0) == 0, stats
    assert stats["progress_writes"] < n // 4  # fewer than one per claim_batch: batched


def _extend(lock: threading.Lock, into: list[int], seqs: list[int]) -> None:
    with lock:
        into.extend(seqs)


def test_refills_asked_while_a_cas_is_under_way_ride_the_next_one_together() -> None:
    """Three workers flush their buffered acks at once: the first one's CAS is held in its
    write; the other two ask meanwhile and are written by one CAS after it -- two
    progress writes for three flushes, none refused."""
    gate = GatedStore(open_store("memory://"))
    buf = tieredbuf.Buffer(gate)
    seed(buf, 12)
    ws = [buf.worker("jobs", claim_batch=1, read_ahead=0) for _ in range(3)]
    for w in ws:
        b = w.claim()
        assert b is not None
        w.ack(b.sequence)  # buffered: applied by the next CAS
    hub = ws[0]._hub
    assert all(w._hub is hub for w in ws)
    gate.reset()
    gate.opened.clear()
    first = threading.Thread(target=ws[0].flush)
    first.start()
    assert gate.waiting.wait(timeout=30)  # its CAS is in its write
    rest = [threading.Thread(target=w.flush) for w in ws[1:]]
    for t in rest:
        t.start()
    deadline = time.monotonic() + 30
    while hub.waiting() < 2:  # both asked, behind the CAS under way
        assert time.monotonic() < deadline, "the other two never asked"
        time.sleep(0.001)
    gate.opened.set()
    for t in [first, *rest]:
        t.join(timeout=30)
    assert gate.of("subscriber").get("put") == 2
    assert buf.queue.stats.get("progress_conflicts") == 0
    (info,) = [s for s in buf.subscribers() if s.name == "jobs"]
    assert info.next_sequence == 3  # every ack applied, once
    for w in ws:
        w.close()


def test_a_worker_opened_after_its_queue_was_removed_registers_it_afresh() -> None:
    """The hub of a removed queue takes no new worker: the old workers fail
    (SubscriberRemovedError), a worker opened afterwards registers the queue again."""
    buf = tieredbuf.open("memory://")
    seed(buf, 4)
    old = buf.worker("jobs", claim_batch=1)
    assert old.claim() is not None
    assert buf.remove_subscriber("jobs")
    new = buf.worker("jobs", claim_batch=1)
    got = new.claim()
    assert got is not None and got.sequence == 0  # a new registration, at the earliest
    new.ack(got.sequence)
    new.close()
    with pytest.raises(SubscriberRemovedError):
        for _ in range(3):
            old.claim()
    with pytest.raises(SubscriberRemovedError):
        old.close()  # what it holds cannot be handed back: the queue is gone


def test_workers_with_other_configurations_get_hubs_of_their_own() -> None:
    buf = tieredbuf.open("memory://")
    seed(buf, 2)
    a = buf.worker("jobs", claim_batch=1)
    b = buf.worker("jobs", claim_batch=1)
    c = buf.worker("jobs", claim_batch=2)
    assert a._hub is b._hub and c._hub is not a._hub
    for w in (a, b, c):
        w.close()
    again = buf.worker("jobs", claim_batch=1)  # the last one closed: a new hub
    assert again._hub is not a._hub
    again.close()


def test_the_last_worker_of_the_publishing_hub_publishes_when_it_closes() -> None:
    """The publisher is the hub that ran the refills of the lowest worker id: when that
    worker closes first, the last one to close still publishes the queue's position."""
    buf = tieredbuf.open("memory://")
    seed(buf, 4)
    ws = [buf.worker("jobs", claim_batch=2, refill_ahead=False) for _ in range(2)]
    ws.sort(key=lambda w: w.worker_id)
    for w in ws:
        for _ in range(2):
            b = w.claim()
            assert b is not None
            w.ack(b.sequence)
    for w in ws:  # the lowest id first
        w.close()
    assert buf.snapshot().head == 4
