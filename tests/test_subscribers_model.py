"""A stateful model test of subscribers and workers against a plain model.

Rules: append; (re)initialize a stream subscriber (a new instance fences the old);
read and ack; flush; an old instance's operation (fenced); claim / ack / defer / reject
by two workers of a shared subscriber; leases lapsing; removing a subscriber;
retention by bytes; GC with a zero grace period.  After every step:

* I9 / I5: every entry a registered subscriber still needs (from its flushed position,
  or the first retained sequence) is linked, and its data object exists;
* the root never publishes a position beyond what the subscriber flushed, and the head
  is the slowest published position clamped into [low, next];
* a stream subscriber gets exactly the next sequence it expects (in order, once since
  its last flush) or DataLossError when retention passed it (I3, I9);
* a fenced instance fails with FencedError and writes nothing (I4);
* a shared subscriber's entries are each acked or rejected exactly once, an ack under
  a lease another worker re-claimed is refused, and its position is the oldest not done.
"""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from ulid import ULID

import tieredbuf
from tieredbuf import gc, keys
from tieredbuf.config import TreeConfig
from tieredbuf.errors import (
    AckOrderError,
    DataLossError,
    FencedError,
    LeaseExpiredError,
    SubscriberRemovedError,
)
from tieredbuf.format.batch import encode_batch
from tieredbuf.format.manifest import MetadataItem, NewEntry
from tieredbuf.store import open_store

STREAMS = ("s0", "s1")
WORKERS = 2
LEASE_MS = 1000
OBJ = len(encode_batch([b"r%06d" % 0]))
"""Every object's size: one fixed-width record (readers check the recorded size, I10)."""


class Clock:
    def __init__(self) -> None:
        self.t = 1_800_000_000_000

    def __call__(self) -> int:
        return self.t


class SubscriberMachine(RuleBasedStateMachine):
    @initialize(m=st.integers(2, 4))
    def setup(self, m: int) -> None:
        self.clock = Clock()
        self.buf = tieredbuf.Buffer(open_store("memory://"), TreeConfig(m=m))
        self.buf.create()
        self.n = 0
        self.pseq = 0
        self.retained = False
        # stream subscribers: model of what is flushed and what the live instance expects
        self.flushed: dict[str, int] = {}
        self.live: dict[str, Any] = {}
        self.expect: dict[str, int] = {}
        self.acked: dict[str, int] = {}
        self.stale: list[tuple[str, Any]] = []
        # the shared subscriber "w"
        self.w_registered = False
        self.w_start = 0
        self.workers: list[Any] = []
        self.done: set[int] = set()
        self.holder: dict[int, tuple[int, int]] = {}  # seq -> (worker, expires_ms)

    # --- producing -------------------------------------------------------------------

    @rule(k=st.integers(1, 3))
    def append(self, k: int) -> None:
        new = []
        for i in range(self.n, self.n + k):
            key = keys.data_key(ULID.from_timestamp(self.clock.t / 1000))
            self.buf.store.put(key, encode_batch([b"r%06d" % i]), mode="create")
            new.append(NewEntry(key, (MetadataItem(0, self.clock.t, b""),), OBJ))
        self.pseq += k
        assert self.buf.queue.append(new, "p", self.pseq) == list(range(self.n, self.n + k))
        self.n += k

    # --- stream subscribers ----------------------------------------------------------

    def _consumer(self, name: str) -> Any:
        c = self.buf.consumer(name, dequeue_every=1 << 20, read_ahead=0)
        c.subscription.clock_ms = self.clock
        return c

    @rule(name=st.sampled_from(STREAMS))
    def start_instance(self, name: str) -> None:
        old = self.live.get(name)
        c = self._consumer(name)
        low = self.buf.snapshot().low
        c.initialize()
        if name not in self.flushed:
            assert c.subscription.position == low  # new: the earliest entry still held
            self.flushed[name] = low
        assert c.subscription.position == self.flushed[name]  # resumes where it flushed
        if old is not None:
            self.stale.append((name, old))
        self.live[name] = c
        self.expect[name] = self.acked[name] = self.flushed[name]

    @rule(name=st.sampled_from(STREAMS), k=st.integers(1, 4))
    def read_and_ack(self, name: str, k: int) -> None:
        c = self.live.get(name)
        if c is None:
            return
        for _ in range(k):
            low = self.buf.snapshot().low
            try:
                b = c.next_batch()
            except DataLossError:
                assert self.expect[name] < low  # retention passed it: told, never skipped
                return
            if self.expect[name] >= self.n:
                assert b is None
                return
            assert b is not None and b.sequence == self.expect[name]  # I3: next, in order
            assert b.entries == [b"r%06d" % b.sequence]
            c.ack(b.sequence)
            self.expect[name] = self.acked[name] = b.sequence + 1

    @rule(name=st.sampled_from(STREAMS))
    def flush(self, name: str) -> None:
        c = self.live.get(name)
        if c is None:
            return
        c.flush()
        self.flushed[name] = self.acked[name]

    @precondition(lambda self: bool(self.stale))
    @rule(data=st.data())
    def fenced_instance_writes_nothing(self, data: st.DataObject) -> None:
        _name, old = data.draw(st.sampled_from(self.stale))
        before = {
            m.key: self.buf.store.get(m.key).data
            for m in self.buf.store.list(keys.SUBSCRIBERS_PREFIX)
        }
        try:
            old.flush()
            raise AssertionError("I4: a fenced instance's flush must fail")
        except FencedError:  # SubscriberRemovedError is one too
            pass
        after = {
            m.key: self.buf.store.get(m.key).data
            for m in self.buf.store.list(keys.SUBSCRIBERS_PREFIX)
        }
        assert after == before

    # --- the shared subscriber -------------------------------------------------------

    def _workers(self) -> list[Any]:
        if not self.workers:
            for _ in range(WORKERS):
                # refill_ahead=False: the model knows of a lease when claim() returns it;
                # a refill ahead leases in the background, on a thread (the tests of
                # refilling ahead: tests/test_workers.py)
                w = self.buf.worker(
                    "w",
                    claim_batch=1,
                    max_claim_batch=1,
                    refill_ahead=False,
                    lease=timedelta(milliseconds=LEASE_MS),
                )
                w.subscription.clock_ms = self.clock
                w.initialize()
                self.workers.append(w)
            self.w_registered = True
            self.w_start = self.workers[0].subscription.progress.position
        return self.workers

    def _live_holder(self, seq: int) -> int | None:
        h = self.holder.get(seq)
        return h[0] if h is not None and h[1] > self.clock.t else None

    @rule(i=st.integers(0, WORKERS - 1))
    def claim(self, i: int) -> None:
        w = self._workers()[i]
        try:
            b = w.claim()
        except LeaseExpiredError:
            return  # an ack applied at once was refused (checked in resolve)
        except DataLossError:
            assert self.retained
            return
        if b is None:
            return
        s = b.sequence
        assert s not in self.done, "a done entry was delivered again"
        other = self._live_holder(s)
        assert other is None or other == i, "an entry leased to a live worker was handed out"
        assert b.entries == [b"r%06d" % s]
        self.holder[s] = (i, w._held[s].expires_ms)

    @rule(
        i=st.integers(0, WORKERS - 1),
        how=st.sampled_from(["ack", "defer", "reject"]),
        data=st.data(),
    )
    def resolve(self, i: int, how: str, data: st.DataObject) -> None:
        if not self.workers or not self.workers[i].held:
            return
        w = self.workers[i]
        seq = data.draw(st.sampled_from([s for s in w.held if w._held[s].handed_out] or [-1]))
        if seq < 0:
            return
        mine = self.holder.get(seq, (None, 0))[0] == i
        try:
            if how == "ack":
                w.ack(seq)
            elif how == "reject":
                w.reject(seq, reason=b"bad")
            else:
                w.defer(seq)
            w.flush()
        except LeaseExpiredError as e:
            assert not mine and seq in e.sequences  # re-claimed by another: refused
            return
        except DataLossError:
            assert self.retained  # raised after the CAS that applied the ack landed
        except AckOrderError:
            raise
        if how == "defer":
            if mine:
                self.holder.pop(seq, None)
            return
        assert mine, "an ack under a lease another worker re-claimed was applied"
        assert seq not in self.done, "acked twice"
        self.done.add(seq)
        self.holder.pop(seq, None)

    @rule(ms=st.integers(0, 2 * LEASE_MS))
    def time_passes(self, ms: int) -> None:
        self.clock.t += ms

    @rule(i=st.integers(0, WORKERS - 1))
    def lease_lapses_and_another_worker_claims(self, i: int) -> None:
        self.clock.t += LEASE_MS + 1
        self.claim(1 - i)

    # --- administration ----------------------------------------------------------------

    @rule(name=st.sampled_from([*STREAMS, "w"]))
    def remove(self, name: str) -> None:
        registered = name in self.buf.snapshot().registry
        assert self.buf.remove_subscriber(name) is registered
        if name == "w":
            for w in self.workers:
                try:  # what it leased already it may hand out; its next CAS must fail
                    for _ in range(3):
                        w.claim()
                    raise AssertionError("a worker of a removed subscriber went on")
                except SubscriberRemovedError:
                    pass
            self.workers, self.w_registered = [], False
            self.done, self.holder = set(), {}
            return
        c = self.live.pop(name, None)
        if c is not None:
            self.stale.append((name, c))
        self.flushed.pop(name, None)

    @rule(objects=st.integers(1, 6))
    def retention(self, objects: int) -> None:
        self.buf.set_retention(max_bytes=objects * OBJ)
        self.retained = True

    @rule()
    def gc_with_zero_grace(self) -> None:
        report = gc.run_once(self.buf, grace=timedelta(0), now_ms=time.time_ns() // 10**6 + 10**9)
        assert report.failed == 0

    # --- invariants ----------------------------------------------------------------------

    @invariant()
    def every_needed_entry_is_linked_and_stored(self) -> None:
        if not hasattr(self, "buf"):
            return
        snap = self.buf.snapshot()
        reg = snap.registry
        assert set(self.flushed) == {n for n in reg if n in STREAMS}
        assert ("w" in reg) == self.w_registered
        if not self.retained:
            assert snap.low == snap.head
        positions = [r.published_next for r in reg.values()]
        if positions:
            assert snap.head == min(max(min(positions), snap.low), snap.root.next_seq)
        for name, pos in self.flushed.items():
            assert reg[name].published_next <= pos  # never published past what was flushed
        need = [self.flushed[n] for n in self.flushed]
        if self.w_registered:
            w_pos = min(set(range(self.w_start, self.n + 1)) - self.done)
            need.append(w_pos)
            p = self.workers[0].subscription.reload()
            assert p.position == w_pos  # the oldest entry neither acked nor rejected
        start = max(min(need, default=snap.head), snap.low)
        got = list(snap.iter_from(start))
        assert [e.sequence for e in got] == list(range(start, self.n))
        stored = {m.key for m in self.buf.store.list(keys.DATA_PREFIX)}
        assert {e.location for e in got} <= stored  # I5: nothing needed was deleted

    def teardown(self) -> None:
        if hasattr(self, "buf"):
            for c in [*self.live.values(), *(c for _, c in self.stale), *self.workers]:
                with contextlib.suppress(FencedError, LeaseExpiredError, DataLossError):
                    c.close()


SubscriberMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None
)
test_I3_I4_I5_I9_subscribers_and_workers_match_the_model = SubscriberMachine.TestCase


class LongSubscriberMachine(SubscriberMachine):
    pass


LongSubscriberMachine.TestCase.settings = settings(
    max_examples=600, stateful_step_count=60, deadline=None
)
test_I3_I4_I5_I9_subscribers_and_workers_match_the_model_long = pytest.mark.slow(
    LongSubscriberMachine.TestCase
)
