"""Shared work queues: claim / ack / defer / reject (Quiver's bundle lifecycle), leases,
redelivery, exactly-once acks (I9), batching and exact request costs."""

from __future__ import annotations

import random
import threading
from datetime import timedelta
from typing import Any

import pytest

import tieredbuf
from tests.faults import CountingStore, FaultInjectingStore
from tests.subscriber_util import fill, seed
from tieredbuf import keys
from tieredbuf.errors import (
    AckOrderError,
    ConfigError,
    DataLossError,
    LeaseExpiredError,
    OutcomeUnknownError,
    PreconditionFailedError,
    SubscriberRemovedError,
)
from tieredbuf.store import open_store


class Clock:
    def __init__(self) -> None:
        self.t = 1_800_000_000_000

    def __call__(self) -> int:
        return self.t


def _worker(
    buf: tieredbuf.Buffer, clock: Clock | None = None, name: str = "jobs", **kw: Any
) -> tieredbuf.consume.worker.Worker:  # type: ignore[name-defined]
    w = buf.worker(name, **kw)
    if clock is not None:
        w.subscription.clock_ms = clock
    return w


def _progress(buf: tieredbuf.Buffer, name: str = "jobs") -> Any:
    (info,) = [s for s in buf.subscribers() if s.name == name]
    return info


@pytest.mark.slow
def test_I9_workers_share_a_subscriber_each_entry_acked_exactly_once_out_of_order() -> None:
    buf = tieredbuf.open("memory://")
    fill(buf, 30)
    ws = [_worker(buf, claim_batch=4) for _ in range(3)]
    rng = random.Random(7)
    held: list[tuple[Any, int]] = []
    seen: list[int] = []
    while True:
        got = [(w, w.claim()) for w in ws]
        fresh = [(w, b.sequence) for w, b in got if b is not None]
        if not fresh and not held:
            break
        held += fresh
        seen += [s for _, s in fresh]
        rng.shuffle(held)
        for w, s in held[: rng.randint(0, len(held))]:
            w.ack(s)
            held.remove((w, s))
    for w in ws:
        w.close()
    assert sorted(seen) == list(range(30))  # each delivered once: no lease lapsed
    info = _progress(buf)
    assert info.next_sequence == 30 and info.work["done_above_position"] == 0
    assert buf.snapshot().head == 30


def test_a_lapsed_lease_is_redelivered_and_the_old_holders_ack_changes_nothing() -> None:
    buf = tieredbuf.open("memory://")
    fill(buf, 2)
    clock = Clock()
    a = _worker(buf, clock, claim_batch=1, lease=timedelta(seconds=10))
    b = _worker(buf, clock, claim_batch=1, lease=timedelta(seconds=10))
    first = a.claim()
    assert first is not None and first.sequence == 0
    clock.t += 11_000  # a's lease lapsed (a is stalled, e.g. a long GC pause)
    again = b.claim()
    assert again is not None and again.sequence == 0  # redelivered
    with pytest.raises(LeaseExpiredError) as e:
        a.ack(0)  # its lease is past lapsing: applied at once, and refused
    assert e.value.sequences == [0]
    a.flush()  # nothing of it is left buffered
    assert _progress(buf).next_sequence == 0 and _progress(buf).work["leased"] == 1
    b.ack(0)
    b.flush()
    assert _progress(buf).next_sequence == 1


def test_a_lapsed_lease_nobody_claimed_again_may_still_be_acked() -> None:
    buf = tieredbuf.open("memory://")
    fill(buf, 1)
    clock = Clock()
    a = _worker(buf, clock, lease=timedelta(seconds=10))
    got = a.claim()
    assert got is not None
    clock.t += 60_000
    a.ack(got.sequence)  # applied at once: its lease is past the point of lapsing
    assert _progress(buf).next_sequence == 1


def test_defer_hands_an_entry_back_after_its_redelivery_delay() -> None:
    buf = tieredbuf.open("memory://")
    fill(buf, 1)
    clock = Clock()
    a, b = _worker(buf, clock), _worker(buf, clock)
    got = a.claim()
    assert got is not None and b.claim() is None
    a.defer(got.sequence)
    assert b.claim() is None  # its redelivery delay: 1 s after a first delivery
    clock.t += 1_000
    again = b.claim()
    assert again is not None and again.sequence == got.sequence
    with pytest.raises(AckOrderError):
        a.ack(got.sequence)  # no longer a's
    b.defer(again.sequence, delay=timedelta(0))  # at once
    third = a.claim()
    assert third is not None and third.sequence == got.sequence
    a.ack(third.sequence)
    a.close()
    b.close()
    assert _progress(buf).next_sequence == 1


def test_the_redelivery_delay_doubles_with_each_delivery_up_to_its_cap() -> None:
    buf = tieredbuf.open("memory://")
    fill(buf, 1)
    clock = Clock()
    w = _worker(
        buf,
        clock,
        redelivery_delay=timedelta(seconds=2),
        redelivery_delay_max=timedelta(seconds=5),
    )
    waits = []
    for _ in range(4):
        got = w.claim()
        assert got is not None
        w.defer(got.sequence)
        waits.append(w.waiting_s())
        clock.t += 1_999
        assert w.claim() is None  # not a millisecond early
        clock.t += int(waits[-1] * 1000) - 1_999
    assert waits == [2.0, 4.0, 5.0, 5.0]


def test_rejected_entries_are_listed_and_never_redelivered() -> None:
    buf = tieredbuf.open("memory://")
    fill(buf, 3)
    w = _worker(buf)
    got = [w.claim() for _ in range(3)]
    assert [g.sequence for g in got if g] == [0, 1, 2]
    w.reject(1, reason=b"bad json")
    w.ack(0)
    w.ack(2)
    w.flush()
    assert w.claim() is None
    info = _progress(buf)
    assert info.next_sequence == 3
    assert [(r.seq, r.reason) for r in info.rejected] == [(1, b"bad json")]
    assert info.as_dict()["rejected"][0]["reason"] == "bad json"


def test_max_deliveries_rejects_a_poison_entry_instead_of_redelivering_it() -> None:
    buf = tieredbuf.open("memory://")
    fill(buf, 1)
    clock = Clock()
    w = _worker(buf, clock, lease=timedelta(seconds=1), max_deliveries=2, claim_batch=1)
    for _ in range(2):
        got = w.claim()
        assert got is not None and got.sequence == 0
        clock.t += 2_000  # the process working on it died each time
    assert w.claim() is None
    info = _progress(buf)
    assert info.next_sequence == 1
    assert [(r.seq, r.deliveries, r.reason) for r in info.rejected] == [
        (0, 2, b"max_deliveries reached")
    ]


@pytest.mark.slow
def test_max_span_bounds_the_state_behind_a_stuck_entry() -> None:
    buf = tieredbuf.open("memory://")
    fill(buf, 12)
    stuck, w = _worker(buf, claim_batch=1), _worker(buf, claim_batch=1, max_span=4)
    assert stuck.claim() is not None  # holds 0 for 30 s
    for _ in range(3):
        b = w.claim()
        assert b is not None
        w.ack(b.sequence)
    w.flush()
    assert w.claim() is None  # 0..3 span max_span: nothing past it is claimed
    assert _progress(buf).work["claim_cursor"] == 4


@pytest.mark.slow
def test_claims_are_batched_one_progress_cas_per_claim_batch() -> None:
    counting = CountingStore(open_store("memory://"))
    buf = tieredbuf.Buffer(counting)
    fill(buf, 16)
    w = _worker(
        buf,
        Clock(),
        claim_batch=8,
        max_claim_batch=8,
        read_ahead=0,
        publish_interval=timedelta(hours=1),
    )
    w.initialize()
    counting.reset()
    for _ in range(16):
        b = w.claim()
        assert b is not None
        w.ack(b.sequence)
    # two refills, a progress CAS each; the second applies the first eight acks in the
    # same CAS and leases from the root the first one read (it already lists entry 15).
    # After the first, the subscriber held the head: one publication (root GET, its
    # progress GET, root CAS); the second is rate-limited.
    assert counting.of("subscriber") == {"put": 2, "get": 1}
    assert counting.of("root") == {"get": 2, "put": 1}
    assert counting.of("data") == {"get": 16}


def test_I2_a_claim_whose_response_was_lost_finds_its_own_leases() -> None:
    store = FaultInjectingStore(open_store("memory://"))
    buf = tieredbuf.Buffer(store)
    fill(buf, 4)
    w = _worker(buf, claim_batch=2)
    w.initialize()
    key = next(m.key for m in store.list(keys.SUBSCRIBERS_PREFIX))
    for err in (OutcomeUnknownError, PreconditionFailedError):
        fault = store.arm("put", key=key, when="after", error=err, times=1)
        b = w.claim()
        assert fault.fired == 1 and b is not None
        w.ack(b.sequence)
        b = w.claim()
        assert b is not None
        w.ack(b.sequence)
    w.flush()
    info = _progress(buf)
    assert info.next_sequence == 4 and info.work["leased"] == 0


def test_close_hands_back_what_the_worker_still_holds() -> None:
    buf = tieredbuf.open("memory://")
    fill(buf, 4)
    a, b = _worker(buf, claim_batch=4), _worker(buf)
    got = a.claim()
    assert got is not None
    a.close()  # 0 handed out (not acked), 1..3 leased but not handed out
    assert sorted(x.sequence for x in iter(b.claim, None)) == [0, 1, 2, 3]


def test_retention_lost_entries_raise_or_are_skipped_and_counted() -> None:
    from tieredbuf.format.batch import encode_batch

    buf = tieredbuf.open("memory://")
    buf.create()
    strict, skipper = _worker(buf, name="strict"), _worker(buf, name="skip", on_lost="skip")
    strict.initialize()
    skipper.initialize()
    one = encode_batch([b"r0"], tieredbuf.ProducerConfig().batch_compression)
    buf.set_retention(max_bytes=len(one))  # one object of fill()'s: the newest is kept
    fill(buf, 3)
    with pytest.raises(DataLossError, match=r"0\.\.1"):
        strict.claim()
    b = skipper.claim()
    assert b is not None and b.sequence == 2
    assert skipper.stats.get("lost_sequences") == 2


def test_a_removed_shared_subscriber_stops_its_workers() -> None:
    buf = tieredbuf.open("memory://")
    fill(buf, 2)
    w = _worker(buf, claim_batch=1)
    assert w.claim() is not None
    assert buf.remove_subscriber("jobs")
    with pytest.raises(SubscriberRemovedError):
        w.claim()


@pytest.mark.slow
def test_under_a_slow_refill_a_worker_leases_more_per_cas_within_its_limits() -> None:
    buf = tieredbuf.open("memory://")
    fill(buf, 40)
    w = _worker(buf, claim_batch=2, max_claim_batch=6, lease=timedelta(seconds=10))
    assert w._claim_n() == 2  # nothing measured yet
    w._refill_s, w._item_s = 0.5, 0.1  # refills take 5 entries' processing time
    assert w._claim_n() == 6  # 2 x 0.5 / 0.1 = 10, capped at max_claim_batch
    w._item_s = 2.0  # slow processing: half a lease holds 2.5 entries
    assert w._claim_n() == 2
    w._refill_s, w._item_s = 4.0, 1.5  # wants 6, but only 3 fit in half a lease
    assert w._claim_n() == 3


# --- a delivery is a claim() that returned the entry ---------------------------------------


@pytest.mark.slow
def test_max_deliveries_counts_only_entries_claim_returned_not_a_refills_hand_back() -> None:
    """Review finding: worker A leased a refill batch, returned one entry, acked it and
    closed; the seven it never returned were rejected "after 1 deliveries"."""
    buf = tieredbuf.open("memory://")
    fill(buf, 8)
    a = _worker(buf, max_deliveries=1, claim_batch=8)
    got = a.claim()
    assert got is not None and got.sequence == 0
    a.ack(0)
    a.close()
    b = _worker(buf, max_deliveries=1, claim_batch=8)
    assert sorted(x.sequence for x in iter(b.claim, None)) == list(range(1, 8))
    assert _progress(buf).rejected == ()


def test_max_deliveries_ignores_leases_a_worker_let_lapse_before_handing_them_out() -> None:
    buf = tieredbuf.open("memory://")
    fill(buf, 4)
    clock = Clock()
    a = _worker(buf, clock, max_deliveries=1, claim_batch=4, lease=timedelta(seconds=10))
    assert a.claim() is not None  # 0 handed out; 1..3 leased, not handed out
    a.ack(0)
    clock.t += 60_000  # 1..3 lapse unused: dropped locally, handed back with the next CAS
    assert sorted(x.sequence for x in iter(a.claim, None)) == [1, 2, 3]
    assert _progress(buf).rejected == ()


def test_a_dead_workers_unsaid_hand_out_is_not_charged_and_the_next_one_is_marked() -> None:
    """A worker killed after a refill (it stops writing: its leases lapse) never said
    which entries claim() returned: none is charged (I10), every one is suspect, and the
    next worker marks each (one CAS: the charge made durable) before claim() returns it."""
    buf = tieredbuf.open("memory://")
    fill(buf, 4)
    clock = Clock()
    dead = _worker(buf, clock, max_deliveries=1, claim_batch=4, lease=timedelta(seconds=10))
    assert dead.claim() is not None  # then the process dies holding 0..3
    clock.t += 60_000
    b = _worker(buf, clock, max_deliveries=1, claim_batch=4)
    marked: list[int] = []
    b.on_mark = marked.append
    got = []
    for x in iter(b.claim, None):
        got.append(x.sequence)
        (lease,) = [y for y in b.subscription.progress.leases if y.seq == x.sequence]
        assert lease.deliveries == 1  # charged before claim() returned it
    assert got == marked == [0, 1, 2, 3]
    assert _progress(buf).rejected == ()


def test_an_entry_that_kills_every_worker_is_still_dead_lettered() -> None:
    """The first death leaves no word (the hand-out is never charged); from then on each
    hand-out is marked before claim() returns it, so max_deliveries still stops it."""
    buf = tieredbuf.open("memory://")
    fill(buf, 1)
    clock = Clock()
    returns = 0
    for _ in range(5):
        w = _worker(buf, clock, max_deliveries=2, claim_batch=1, lease=timedelta(seconds=10))
        got = w.claim()
        if got is None:
            break
        returns += 1  # and the worker dies on it
        clock.t += 60_000
    (rej,) = _progress(buf).rejected
    assert (rej.seq, rej.deliveries, rej.reason) == (0, 2, b"max_deliveries reached")
    assert returns == 3  # one unrecorded, then two charged


def test_a_deferred_entry_counts_as_delivered_once_per_claim() -> None:
    buf = tieredbuf.open("memory://")
    fill(buf, 1)
    w = _worker(buf, max_deliveries=2, claim_batch=1)
    for _ in range(2):
        got = w.claim()
        assert got is not None and got.sequence == 0
        w.defer(0, delay=timedelta(0))
    assert w.claim() is None
    assert [(r.seq, r.deliveries) for r in _progress(buf).rejected] == [(0, 2)]


# --- a retry that finds its own landed write keeps that write's decisions --------------------


def test_I2_a_refused_late_ack_stays_refused_when_its_cas_response_was_lost() -> None:
    """Review finding: worker 1's lease lapsed and worker 2 re-claimed the entry; worker
    1's ack was written (refused inside it) and the response lost; the retry found its
    own write and reported the ack as applied."""
    store = FaultInjectingStore(open_store("memory://"))
    buf = tieredbuf.Buffer(store)
    fill(buf, 1)
    clock = Clock()
    w1 = _worker(buf, clock, claim_batch=1, lease=timedelta(seconds=10))
    w2 = _worker(buf, clock, claim_batch=1, lease=timedelta(seconds=10))
    applied: dict[str, list[int]] = {"w1": [], "w2": []}
    w1.on_applied = applied["w1"].extend
    w2.on_applied = applied["w2"].extend
    first = w1.claim()
    assert first is not None
    clock.t += 60_000
    again = w2.claim()
    assert again is not None and again.sequence == first.sequence
    key = next(m.key for m in store.list(keys.SUBSCRIBERS_PREFIX))
    fault = store.arm("put", key=key, when="after", error=OutcomeUnknownError, times=1)
    with pytest.raises(LeaseExpiredError):
        w1.ack(first.sequence)  # past its lapse: applied at once
    assert fault.fired == 1
    w2.ack(again.sequence)
    w2.flush()
    assert applied == {"w1": [], "w2": [first.sequence]}
    assert _progress(buf).next_sequence == 1


def test_I2_an_auto_reject_is_reported_when_its_cas_response_was_lost() -> None:
    store = FaultInjectingStore(open_store("memory://"))
    buf = tieredbuf.Buffer(store)
    fill(buf, 1)
    clock = Clock()
    w = _worker(buf, clock, claim_batch=1, lease=timedelta(seconds=1), max_deliveries=1)
    assert w.claim() is not None
    clock.t += 2_000  # it died on it
    key = next(m.key for m in store.list(keys.SUBSCRIBERS_PREFIX))
    fault = store.arm("put", key=key, when="after", error=OutcomeUnknownError, times=1)
    assert w.claim() is None
    assert fault.fired == 1
    assert w.stats.get("auto_rejected") == 1
    assert [r.seq for r in _progress(buf).rejected] == [0]


# --- request costs --------------------------------------------------------------------------


def test_an_idle_claim_costs_a_footer_get_and_a_progress_get() -> None:
    """docs/subscribers.md: an idle worker poll is a footer GET and a progress GET."""
    counting = CountingStore(open_store("memory://"))
    buf = tieredbuf.Buffer(counting)
    fill(buf, 1)
    w = _worker(buf, claim_batch=1, publish_interval=timedelta(hours=1))
    b = w.claim()
    assert b is not None
    w.ack(b.sequence)
    w.flush()
    assert w.claim() is None  # the root read here is at most publish_interval old now
    counting.reset()
    assert w.claim() is None
    assert counting.of("root") == {"get_suffix": 1}
    assert counting.of("subscriber") == {"get": 1}
    assert sum(counting.counts.values()) == 2


@pytest.mark.parametrize("read_ahead", [0, 4])
@pytest.mark.slow
def test_I9_a_skipping_worker_whose_leased_entries_were_unlinked_and_reaped_moves_on(
    read_ahead: int,
) -> None:
    """The worker twin of the subscriber finding: leased entries that retention unlinked
    and GC reaped are skipped and counted with on_lost="skip", never raised over and over."""
    from tieredbuf.format.batch import encode_batch

    buf = tieredbuf.open("memory://")
    fill(buf, 12)
    w = _worker(buf, on_lost="skip", claim_batch=12, read_ahead=read_ahead)
    first = w.claim()
    assert first is not None and first.sequence == 0  # 1..11 leased too
    w.ack(0)
    one = encode_batch([b"r10"], tieredbuf.ProducerConfig().batch_compression)
    buf.set_retention(max_bytes=2 * len(one))  # keeps 10 and 11
    linked = {e.location for e in buf.snapshot().iter_from(10)}
    gone = [m.key for m in buf.store.list(keys.DATA_PREFIX) if m.key not in linked]
    assert not buf.store.delete_many(gone)  # what GC does past the grace period
    got = [b.sequence for b in iter(w.claim, None)]
    for s in got:
        w.ack(s)
    w.close()
    info = _progress(buf)
    assert got[-2:] == [10, 11] and got == sorted(set(got))
    assert len(got) + info.lost == 11 and info.next_sequence == 12
    if read_ahead == 0:
        assert got == [10, 11] and info.lost == 9


# --- refilling ahead ---------------------------------------------------------------------------


class GatedStore(CountingStore):
    """Holds every write of a progress object while closed (a CAS at S3's round trips, or
    stuck behind other workers' CASes): the test opens it."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.opened = threading.Event()
        self.opened.set()
        self.waiting = threading.Event()

    def put(self, key: str, data: Any, *, mode: Any = "overwrite") -> str:
        if key.startswith(keys.SUBSCRIBERS_PREFIX) and not self.opened.is_set():
            self.waiting.set()
            if not self.opened.wait(timeout=30):
                raise TimeoutError("the test never opened the gate")
        return super().put(key, data, mode=mode)


def test_claim_hands_out_what_it_holds_while_the_next_refill_runs_ahead() -> None:
    """The progress CAS is not on claim()'s path: with the refill ahead stuck in its CAS,
    claim() still returns every entry already leased; the refill lands afterwards."""
    gate = GatedStore(open_store("memory://"))
    buf = tieredbuf.Buffer(gate)
    seed(buf, 24)
    w = _worker(buf, claim_batch=8, max_claim_batch=8, read_ahead=0)
    first = w.claim()  # nothing leased yet: this refill is claim()'s own
    assert first is not None and first.sequence == 0
    w._refill_s, w._item_s = 0.5, 0.1  # a refill takes 5 entries' time: start at 5 left
    gate.opened.clear()
    got = [first.sequence]
    w.ack(first.sequence)
    for _ in range(7):
        b = w.claim()
        assert b is not None
        got.append(b.sequence)
        w.ack(b.sequence)
    assert got == list(range(8))  # all handed out with the refill ahead held in its CAS
    assert gate.waiting.wait(timeout=30) and w.stats.get("refills_ahead") == 1
    gate.opened.set()
    rest = [b.sequence for b in iter(w.claim, None)]
    for s in rest:
        w.ack(s)
    w.close()
    assert rest == list(range(8, 24))
    assert _progress(buf).next_sequence == 24  # every ack applied, once


def test_an_entry_leased_ahead_is_never_handed_out_when_its_lease_is_about_to_lapse() -> None:
    buf = tieredbuf.open("memory://")
    seed(buf, 16)
    clock = Clock()
    w = _worker(
        buf, clock, claim_batch=4, max_claim_batch=4, lease=timedelta(seconds=10), read_ahead=0
    )
    w.claim()
    w._refill_s, w._item_s = 1.0, 0.1  # refill ahead at once
    b = w.claim()
    assert b is not None and b.sequence == 1
    w._settle(wait=True)  # 4..7 leased ahead, at the clock's now
    assert w.held == [0, 1, 2, 3, 4, 5, 6, 7]
    clock.t += 8_000  # 2 s left of every lease: inside the margin (a quarter of the lease)
    again = w.claim()
    assert again is not None
    assert w.stats.get("lapsed_before_use") == 6  # 2..7: handed back uncharged, not out
    w._settle(wait=True)
    lease = next(x for x in w.subscription.reload().leases if x.seq == again.sequence)
    assert lease.expires_ms - clock.t == 10_000  # handed out under a fresh lease
    assert lease.deliveries <= 1  # this hand-out only: releasing 2..7 charged nothing


def test_refill_ahead_off_refills_only_when_claim_runs_dry() -> None:
    counting = CountingStore(open_store("memory://"))
    buf = tieredbuf.Buffer(counting)
    seed(buf, 12)
    w = _worker(buf, claim_batch=4, max_claim_batch=4, refill_ahead=False, read_ahead=0)
    w.claim()
    w._refill_s, w._item_s = 1.0, 0.1
    for _ in range(3):
        assert w.claim() is not None
        assert w.held == [0, 1, 2, 3]  # nothing leased ahead
    assert w.claim() is not None and w.held == [0, 1, 2, 3, 4, 5, 6, 7]
    assert not w.stats.get("refills_ahead")


def test_worker_options_are_validated() -> None:
    buf = tieredbuf.open("memory://")
    with pytest.raises(ConfigError, match="check_interval"):
        buf.worker("jobs", check_interval=timedelta(seconds=-1))
    with pytest.raises(ConfigError, match="read_ahead_bytes"):
        buf.worker("jobs", read_ahead_bytes=0)


def test_I10_no_cas_started_before_claim_returns_an_entry_charges_its_delivery(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The refill a claim() starts ahead runs on the hub's thread and can land before
    claim() returns; a worker killed in between must not have been charged for the entry
    it never returned (found by the work-queue torture test: an entry dead-lettered after
    one return, charged twice).  So every ``out`` in a refill is for an entry claim() had
    already returned when the refill was asked for."""
    from tieredbuf.consume.hub import RefillHub

    buf = tieredbuf.open("memory://")
    seed(buf, 60)
    returned: set[int] = set()
    early: list[int] = []
    asked = {"in_claim": 0}
    in_claim = threading.local()
    real = RefillHub.submit

    def submit(self: RefillHub, worker_id: bytes, ops: Any, *a: Any, **kw: Any) -> Any:
        if getattr(in_claim, "on", False):
            asked["in_claim"] += 1
        early.extend(op.seq for op in ops if op.action == "out" and op.seq not in returned)
        return real(self, worker_id, ops, *a, **kw)

    monkeypatch.setattr(RefillHub, "submit", submit)
    w = _worker(buf, claim_batch=2, max_deliveries=1)
    while True:
        in_claim.on = True
        try:
            b = w.claim()
        finally:
            in_claim.on = False
        if b is None:
            break
        returned.add(b.sequence)
        w.ack(b.sequence)
    w.close()
    assert returned == set(range(60))
    assert asked["in_claim"] > 0  # refills were started inside claim() (the case at issue)
    assert early == []
    assert _progress(buf).rejected == ()
