"""A delivery is a ``claim()`` that returned the entry (I10): only that is ever charged,
whatever happens to the worker -- a kill, a stall, a lapse, a refill ahead, a failed
data GET, a close.  Each test here is named after the finding it pins (issue: work
queues you can trust) and checks the same invariant: no entry is rejected for
``max_deliveries`` unless claim() returned it that many times."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta
from typing import Any

import pytest

import tieredbuf
from tests.faults import FaultInjectingStore
from tests.subscriber_util import seed
from tieredbuf import keys
from tieredbuf.errors import LeaseExpiredError, TransientStoreError
from tieredbuf.store import open_store
from tieredbuf.store.base import GetResult


class Clock:
    def __init__(self) -> None:
        self.t = 1_800_000_000_000

    def __call__(self) -> int:
        return self.t


def _worker(buf: tieredbuf.Buffer, clock: Clock, **kw: Any) -> Any:
    w = buf.worker("jobs", **kw)
    w.subscription.clock_ms = clock
    return w


def _rejected(buf: tieredbuf.Buffer) -> dict[int, int]:
    (info,) = [s for s in buf.subscribers() if s.name == "jobs"]
    return {r.seq: r.deliveries for r in info.rejected}


def _check_charges(returned: Counter[int], rejected: dict[int, int], max_deliveries: int) -> None:
    """I10: every rejection needs ``max_deliveries`` claim() returns, and its recorded
    delivery count is at most the returns."""
    for seq, deliveries in rejected.items():
        assert returned[seq] >= max_deliveries, (
            f"sequence {seq} rejected after {returned[seq]} claim() returns "
            f"(max_deliveries {max_deliveries})"
        )
        assert deliveries <= returned[seq], f"sequence {seq}: {deliveries} charged"


def _drain(w: Any, returned: Counter[int], ack: bool = True) -> list[int]:
    got = []
    while (b := w.claim()) is not None:
        returned[b.sequence] += 1
        got.append(b.sequence)
        if ack:
            w.ack(b.sequence)
    w.flush()
    return got


def _wait_refill(w: Any) -> None:
    """Let the refill running ahead land (the next claim() takes it in)."""
    pending = getattr(w, "_pending", None)
    if pending is not None:
        pending[0].result(timeout=30)


# --- finding 1: a lapsed holder charged once per operation token ---------------------------


def test_a_killed_worker_holding_a_refill_ahead_is_charged_only_for_what_claim_returned() -> None:
    """Found: with refill-ahead a worker holds two operation tokens (the rest of its batch
    and the batch leased ahead); killed, it was charged one delivery per token, so an
    entry it never handed out was dead-lettered at max_deliveries=1."""
    buf = tieredbuf.open("memory://")
    seed(buf, 8)
    clock = Clock()
    dead = _worker(
        buf,
        clock,
        max_deliveries=1,
        claim_batch=2,
        max_claim_batch=2,
        lease=timedelta(seconds=10),
        read_ahead=0,
    )
    returned: Counter[int] = Counter()
    first = dead.claim()  # leases 0, 1
    assert first is not None and first.sequence == 0
    returned[0] += 1
    dead._refill_s, dead._item_s = 1.0, 0.1  # a refill is slow: the next one runs ahead
    second = dead.claim()  # hands out 1, and leases 2, 3 ahead under a second token
    assert second is not None and second.sequence == 1
    returned[1] += 1
    _wait_refill(dead)
    # the process dies here: it never writes again, its leases lapse
    clock.t += 60_000
    other = _worker(buf, clock, max_deliveries=1, claim_batch=8, read_ahead=0)
    _drain(other, returned)
    _check_charges(returned, _rejected(buf), max_deliveries=1)
    assert returned[2] == 1 and returned[3] == 1  # never handed out before: delivered now


def test_a_stalled_worker_is_not_charged_for_the_entries_it_leased_but_never_returned() -> None:
    """A worker that stalls past its lease (SIGSTOP) and comes back: whatever it leased
    and never handed out goes back uncharged, however many refills it held."""
    buf = tieredbuf.open("memory://")
    seed(buf, 12)
    clock = Clock()
    w = _worker(
        buf,
        clock,
        max_deliveries=1,
        claim_batch=3,
        max_claim_batch=3,
        lease=timedelta(seconds=10),
        read_ahead=0,
    )
    returned: Counter[int] = Counter()
    b = w.claim()
    assert b is not None
    returned[b.sequence] += 1
    w.ack(b.sequence)
    w._refill_s, w._item_s = 1.0, 0.1
    b = w.claim()
    assert b is not None
    returned[b.sequence] += 1
    w.ack(b.sequence)
    _wait_refill(w)
    clock.t += 60_000  # stalled past every lease
    other = _worker(buf, clock, max_deliveries=1, claim_batch=12, read_ahead=0)
    _drain(other, returned)
    with pytest.raises(LeaseExpiredError):  # it comes back: its acks of 0 and 1 were late
        _drain(w, returned)
    _drain(w, returned)
    _check_charges(returned, _rejected(buf), max_deliveries=1)
    assert set(returned) == set(range(12))


# --- finding 2: a failed data GET inside claim() strands the entry ------------------------


def test_a_failed_data_get_inside_claim_does_not_strand_and_dead_letter_the_entry() -> None:
    """Found: claim() popped the entry before its data GET; the GET failed (an error that
    outlived the store's retries), the entry was neither handed out nor handed back, and
    when its lease lapsed it was charged a delivery: dead-lettered at max_deliveries=1
    without ever being returned.  Like the stream consumer, the next claim() retries it."""
    store = FaultInjectingStore(open_store("memory://"))
    buf = tieredbuf.Buffer(store)
    seed(buf, 3)
    clock = Clock()
    w = _worker(buf, clock, max_deliveries=1, claim_batch=3, read_ahead=0)
    first = next(iter(buf.snapshot().iter_from(0)))
    fault = store.arm("get", key=first.location, when="before", error=TransientStoreError)
    with pytest.raises(TransientStoreError):
        w.claim()
    assert fault.fired == 1
    store.disarm()
    returned: Counter[int] = Counter()
    _drain(w, returned)
    clock.t += 60_000  # whatever it still held has lapsed
    _drain(_worker(buf, clock, max_deliveries=1, read_ahead=0), returned)
    _check_charges(returned, _rejected(buf), max_deliveries=1)
    assert sorted(returned) == [0, 1, 2] and _rejected(buf) == {}


def test_a_worker_closed_after_a_failed_data_get_hands_the_entry_back_uncharged() -> None:
    store = FaultInjectingStore(open_store("memory://"))
    buf = tieredbuf.Buffer(store)
    seed(buf, 2)
    clock = Clock()
    w = _worker(buf, clock, max_deliveries=1, claim_batch=2, read_ahead=0)
    first = next(iter(buf.snapshot().iter_from(0)))
    store.arm("get", key=first.location, when="before", error=TransientStoreError)
    with pytest.raises(TransientStoreError):
        w.claim()
    store.disarm()
    w.close()
    returned: Counter[int] = Counter()
    _drain(_worker(buf, clock, max_deliveries=1, read_ahead=0), returned)  # no lapse needed
    assert sorted(returned) == [0, 1] and _rejected(buf) == {}


# --- finding 3: a slow data GET hands out a lease inside its margin, queues a sequence twice ---


class SlowDataStore(FaultInjectingStore):
    """Data GETs take ``delay_ms`` on the test's clock (a slow GET inside claim()): every
    one, or only the first ``slow`` of them."""

    def __init__(self, inner: Any, clock: Clock, delay_ms: int, slow: int | None) -> None:
        super().__init__(inner)
        self.clock, self.delay_ms, self.slow = clock, delay_ms, slow

    def get(self, key: str) -> GetResult:
        if key.startswith(keys.DATA_PREFIX) and (self.slow is None or self.slow > 0):
            self.clock.t += self.delay_ms
            self.slow = None if self.slow is None else self.slow - 1
        return super().get(key)


def _slow_worker(delay_ms: int, slow: int | None = None) -> tuple[tieredbuf.Buffer, Clock, Any]:
    clock = Clock()
    store = SlowDataStore(open_store("memory://"), clock, delay_ms, slow)
    buf = tieredbuf.Buffer(store)
    seed(buf, 12)
    w = _worker(
        buf,
        clock,
        claim_batch=4,
        max_claim_batch=4,
        lease=timedelta(seconds=4),  # margin: 1 s
        read_ahead=0,
    )
    w._refill_s, w._item_s = 1.0, 0.1  # refill ahead after every hand-out
    return buf, clock, w


def test_claim_never_hands_out_an_entry_inside_its_lease_margin_after_a_slow_get() -> None:
    """Found: the margin was checked before the data GET; a 3.5 s GET handed out an
    entry with 0.5 s left of its 4 s lease (margin 1 s)."""
    _, clock, w = _slow_worker(3_500)
    margin_ms = 1_000
    handed = 0
    while handed < 6:
        b = w.claim()
        if b is None:
            break
        handed += 1
        _wait_refill(w)  # the refill ahead updates the progress object too: not meanwhile
        (lease,) = [x for x in w.subscription.reload().leases if x.seq == b.sequence]
        left = lease.expires_ms - clock.t
        assert left >= margin_ms, f"sequence {b.sequence} handed out with {left} ms left"
        w.ack(b.sequence)
    assert handed == 6


def test_claim_never_queues_a_sequence_twice_under_a_refill_ahead() -> None:
    """Found: the refill ahead released entries about to lapse but left them in the ready
    queue, then leased them again: one sequence queued twice, and a caller holding
    several unacked claims got KeyError.  A sequence may come back only as a redelivery:
    after the lease it was handed out under lapsed."""
    _, clock, w = _slow_worker(3_500, slow=1)  # the first GET is slow, the rest quick
    expiry: dict[int, int] = {}
    for _ in range(8):
        b = w.claim()  # the caller holds every entry, acking none
        if b is None:
            break
        seq = b.sequence
        assert seq not in expiry or clock.t >= expiry[seq], f"{seq} handed out twice"
        _wait_refill(w)
        (lease,) = [x for x in w.subscription.reload().leases if x.seq == seq]
        expiry[seq] = lease.expires_ms
    assert expiry, "nothing was handed out"
