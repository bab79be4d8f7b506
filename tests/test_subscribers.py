"""Named subscribers: own position, own epoch (I4), every entry to every subscriber (I9),
the head held by the slowest, removal, retention winning, exact request costs."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

import tieredbuf
from tests.faults import CountingStore, FaultInjectingStore
from tests.subscriber_util import drain, fill
from tieredbuf import gc, keys
from tieredbuf.errors import (
    BufferNotFoundError,
    ConfigError,
    DataLossError,
    FencedError,
    OutcomeUnknownError,
    PreconditionFailedError,
    SubscriberRemovedError,
)
from tieredbuf.format import manifest as fm
from tieredbuf.format import registry as freg
from tieredbuf.store import open_store


def _buf() -> tieredbuf.Buffer:
    return tieredbuf.open("memory://")


def _progress_keys(buf: tieredbuf.Buffer) -> set[str]:
    return {m.key for m in buf.store.list(keys.SUBSCRIBERS_PREFIX)}


@pytest.mark.slow
def test_I9_every_subscriber_sees_every_entry_once_in_order_across_restarts(any_url) -> None:  # type: ignore[no-untyped-def]
    url, opts = any_url
    buf = tieredbuf.open(url, **opts)
    fill(buf, 6)
    a, b, d = buf.consumer("a", dequeue_every=2), buf.consumer("b"), buf.consumer()
    for c in (a, b, d):
        c.initialize()
    assert drain(a, 4) == [0, 1, 2, 3]
    assert drain(b, 1) == [0]
    a.flush()
    b.flush()
    a.close()
    fill(buf, 3, start=6)
    a2 = buf.consumer("a")
    a2.initialize()  # resumes after its last flushed ack
    assert drain(a2) == [4, 5, 6, 7, 8]
    assert drain(b) == list(range(1, 9))
    assert drain(d) == list(range(9))
    for c in (a2, b, d):
        c.flush()
        c.close()
    assert buf.snapshot().head == 9


def test_I4_a_new_instance_fences_only_older_instances_of_its_own_subscriber() -> None:
    buf = _buf()
    fill(buf, 4)
    # check_every=1: checked before every entry (the amortised bounds: test_consumer_checks)
    old = buf.consumer("etl", dequeue_every=1000, check_every=1)
    old.initialize()
    other, dflt = buf.consumer("archive"), buf.consumer()
    other.initialize()
    dflt.initialize()
    got = old.next_batch()
    assert got is not None
    old.ack(got.sequence)  # buffered: no request
    new = buf.consumer("etl")
    new.initialize()
    progress = {k: buf.store.get(k).data for k in _progress_keys(buf)}
    root = buf.store.get(keys.MANIFEST_KEY).data
    with pytest.raises(FencedError) as e:
        old.next_batch()
    assert e.value.subscriber == "etl"
    with pytest.raises(FencedError):
        old.flush()  # the CAS of its progress object is fenced by the epoch there
    assert {k: buf.store.get(k).data for k in _progress_keys(buf)} == progress
    assert buf.store.get(keys.MANIFEST_KEY).data == root
    # the new instance starts where "etl" is (nothing flushed); the others are untouched
    assert drain(new) == [0, 1, 2, 3]
    assert drain(other) == [0, 1, 2, 3]
    assert drain(dflt) == [0, 1, 2, 3]
    new.flush()
    dflt.flush()
    other.flush()


def test_I9_the_head_waits_for_the_slowest_subscriber_and_gc_keeps_what_it_needs() -> None:
    buf = _buf()
    fill(buf, 5)
    fast, slow = buf.consumer("fast"), buf.consumer("slow")
    fast.initialize()
    slow.initialize()
    drain(fast)
    fast.flush()
    snap = buf.snapshot()
    assert snap.head == 0 and snap.low == 0
    locations = [e.location for e in snap.entries()]
    report = gc.run_once(buf, grace=timedelta(0), now_ms=time.time_ns() // 10**6 + 10**9)
    assert report.deleted == 0
    assert all(buf.store.head(loc) for loc in locations)
    drain(slow, 3)
    slow.flush()
    assert buf.snapshot().head == 3 and buf.snapshot().low == 3
    report = gc.run_once(buf, grace=timedelta(0), now_ms=time.time_ns() // 10**6 + 10**9)
    # entries 0..2 are unlinked now; an object ULID-stamped in the same millisecond as the
    # oldest linked one is kept by the RFC rule (uploaded but maybe not yet enqueued)
    assert set(report.deleted_keys) <= set(locations[:3]) and report.deleted >= 1
    assert report.deleted + report.kept_newer_than_oldest == 3
    assert all(buf.store.head(loc) for loc in locations[3:])
    assert drain(slow) == [3, 4]
    slow.close()
    fast.close()


def test_removing_a_subscriber_releases_its_hold_and_stops_its_instances() -> None:
    buf = _buf()
    fill(buf, 4)
    live, stalled = buf.consumer("live"), buf.consumer("stalled", check_every=1)
    live.initialize()
    stalled.initialize()
    drain(live)
    live.flush()
    assert buf.snapshot().head == 0
    key = next(k for k in _progress_keys(buf) if "/stalled." in k)
    assert buf.remove_subscriber("stalled") is True
    assert buf.snapshot().head == 4 and key not in _progress_keys(buf)
    assert [s.name for s in buf.subscribers()] == ["live"]
    with pytest.raises(SubscriberRemovedError):
        drain(stalled)  # within check_every (1) entries
    assert buf.remove_subscriber("stalled") is False
    # initialize() registers it afresh: a new subscriber starts at the earliest entry held
    again = buf.consumer("stalled")
    again.initialize()
    assert again.next_batch() is None  # everything it had was unlinked with its hold


def test_removing_default_fences_the_live_default_consumer() -> None:
    buf = _buf()
    fill(buf, 2)
    c = buf.consumer(check_every=1)
    c.initialize()
    etl = buf.consumer("etl")
    etl.initialize()
    assert buf.remove_subscriber("default")
    with pytest.raises(FencedError):
        drain(c)  # within check_every (1) entries
    assert set(buf.snapshot().registry) == {"etl"}


@pytest.mark.slow
def test_a_new_subscriber_starts_at_the_earliest_entry_held_or_the_tail() -> None:
    buf = _buf()
    fill(buf, 3)
    d = buf.consumer()
    d.initialize()
    drain(d)
    d.flush()  # only "default": entries 0..2 are unlinked
    fill(buf, 2, start=3)
    early, late = buf.consumer("early"), buf.consumer("late")
    early.initialize()
    late.initialize(start="latest")
    fill(buf, 1, start=5)
    assert drain(early) == [3, 4, 5]
    assert drain(late) == [5]


@pytest.mark.slow
def test_resuming_below_the_published_position_lowers_the_head_back() -> None:
    buf = _buf()
    buf.set_retention(max_bytes=1 << 30)  # history kept: there is something to go back to
    fill(buf, 6)
    a = buf.consumer("a")
    a.initialize()
    drain(a)
    a.flush()
    assert buf.snapshot().head == 6
    again = buf.consumer("a")
    again.initialize(last_acked_sequence=1)
    assert buf.snapshot().head == 2 and buf.snapshot().registry["a"].published_next == 2
    assert drain(again) == [2, 3, 4, 5]


def test_I9_retention_wins_over_a_stalled_subscriber_who_is_told() -> None:
    from tieredbuf.format.batch import encode_batch

    buf = _buf()
    one = encode_batch([b"r0"], tieredbuf.ProducerConfig().batch_compression)
    buf.set_retention(max_bytes=len(one))  # keep at most one object of fill()'s
    stalled = buf.consumer("stalled")
    skipper = buf.consumer("skipper", on_lost="skip")
    buf.create()
    stalled.initialize()
    skipper.initialize()
    fill(buf, 4)
    snap = buf.snapshot()
    assert snap.low == 3 and snap.head == 3
    with pytest.raises(DataLossError, match=r"sequences 0\.\.2 were unlinked"):
        stalled.next_batch()
    assert drain(skipper) == [3]
    assert skipper.stats.get("lost_sequences") == 3
    skipper.flush()
    info = {s.name: s for s in buf.subscribers()}
    assert info["skipper"].lost == 3 and info["skipper"].next_sequence == 4
    assert info["stalled"].lost_now == 3


@pytest.mark.parametrize("read_ahead", [0, 4])
@pytest.mark.slow
def test_I9_a_skipping_subscriber_whose_read_window_was_unlinked_and_reaped_moves_on(
    read_ahead: int,
) -> None:
    """Review finding: a named subscriber held a window of entries; retention unlinked them
    and GC deleted their objects (legal past the grace period).  Every next_batch raised
    DataLossError blaming a grace-period violation, and on_lost="skip" never skipped.  The
    window is checked against the root before a missing object is called data loss."""
    from tieredbuf.format.batch import encode_batch

    buf = _buf()
    fill(buf, 12)
    c = buf.consumer("etl", on_lost="skip", read_ahead=read_ahead)
    c.initialize()
    first = c.next_batch()
    assert first is not None and first.sequence == 0  # the window 0..11 is decoded now
    c.ack(0)
    one = encode_batch([b"r10"], tieredbuf.ProducerConfig().batch_compression)
    buf.set_retention(max_bytes=2 * len(one))  # keeps 10 and 11
    assert buf.snapshot().low == 10
    linked = {e.location for e in buf.snapshot().iter_from(10)}
    gone = [m.key for m in buf.store.list(keys.DATA_PREFIX) if m.key not in linked]
    assert len(gone) == 10
    assert not buf.store.delete_many(gone)  # what GC does past the grace period
    got = drain(c)
    lost = c.stats.get("lost_sequences")
    # each of 1..11 is delivered once, in order, or counted lost: entries read ahead before
    # the objects were reaped are delivered (their data was read while they were linked)
    assert got[-2:] == [10, 11] and got == sorted(set(got)) and len(got) + lost == 11
    if read_ahead == 0:
        assert got == [10, 11] and lost == 9
    c.flush()
    info = {s.name: s for s in buf.subscribers()}
    assert info["etl"].lost == lost and info["etl"].next_sequence == 12
    strict = buf.consumer("strict")
    strict.initialize(last_acked_sequence=0)
    with pytest.raises(DataLossError, match=r"sequences 1\.\.9 were unlinked"):
        strict.next_batch()


def test_readers_never_create_a_buffer() -> None:
    buf = tieredbuf.open("memory://typo")
    for make in (buf.consumer, lambda: buf.consumer("etl")):
        with pytest.raises(BufferNotFoundError):
            make().initialize()
    with pytest.raises(BufferNotFoundError):
        buf.worker("jobs").claim()
    assert not buf.exists()


def test_stream_and_shared_subscribers_do_not_mix() -> None:
    buf = _buf()
    fill(buf, 1)
    buf.consumer("etl").initialize()
    with pytest.raises(ConfigError, match="stream subscriber"):
        buf.worker("etl").claim()
    buf.worker("jobs").initialize()
    with pytest.raises(ConfigError, match="shared work queue"):
        buf.consumer("jobs").initialize()
    with pytest.raises(ConfigError, match="bad subscriber name"):
        buf.consumer("no/slash")


def test_a_default_only_buffer_keeps_its_bytes_and_an_older_root_reads_as_default() -> None:
    buf = _buf()
    fill(buf, 3)
    c = buf.consumer()
    c.initialize()
    drain(c)
    c.flush()
    view = fm.open_manifest(buf.store.get(keys.MANIFEST_KEY).data)
    assert view.subscribers is None  # the registry is the implied one: not written
    assert buf.snapshot().registry == {"default": freg.Registration("default", freg.ZERO_REG, 0, 3)}
    e = buf.consumer("etl")
    e.initialize()
    view = fm.open_manifest(buf.store.get(keys.MANIFEST_KEY).data)
    assert set(view.subscribers or {}) == {"default", "etl"}


@pytest.mark.slow
def test_an_ack_costs_no_request_and_a_flush_one_progress_cas() -> None:
    counting = CountingStore(open_store("memory://"))
    buf = tieredbuf.Buffer(counting)
    fill(buf, 15)
    other = buf.consumer("other")
    other.initialize()  # holds the head at 0
    c = buf.consumer("etl", dequeue_every=5, read_ahead=0)
    c.subscription.clock_ms = lambda: 1_000_000  # no publish_interval passes in this test
    c.initialize()
    drain(c, 5)
    c.flush()  # published at 5: ahead of the head, so "etl" is not the one holding it
    batches = [c.next_batch() for _ in range(4)]
    counting.reset()
    for b in batches:
        assert b is not None
        c.ack(b.sequence)
    assert counting.counts == {}  # four acks: no request at all
    b = c.next_batch()
    assert b is not None
    counting.reset()
    c.ack(b.sequence)  # the 5th ack: one CAS of its own progress object, nothing else
    assert counting.of("subscriber") == {"put": 1} and counting.of("root") == {}
    counting.reset()
    c.flush()  # nothing new to write: one GET checks the epoch; flush() always publishes:
    # one root GET, one GET per named subscriber behind the tail, one root CAS
    assert counting.of("subscriber") == {"get": 3}
    assert counting.of("root") == {"get": 1, "put": 1}


@pytest.mark.slow
def test_publication_is_lazy_only_the_subscriber_holding_the_head_writes_the_root() -> None:
    clock = [1_000_000]
    counting = CountingStore(open_store("memory://"))
    buf = tieredbuf.Buffer(counting)
    fill(buf, 20)
    fast = buf.consumer("fast", dequeue_every=2, read_ahead=0)
    slow = buf.consumer("slow", dequeue_every=2, read_ahead=0)
    for c in (fast, slow):
        c.subscription.clock_ms = lambda: clock[0]
        c.initialize()
    counting.reset()
    drain(fast, 10)  # 5 progress CASes; it published once (it held the head), then not
    assert counting.of("subscriber").get("put") == 5
    assert counting.of("root").get("put", 0) == 1
    counting.reset()
    drain(slow, 4)  # holds the head: publishes, at most once per publish_interval
    assert counting.of("root").get("put", 0) == 1
    clock[0] += 1000
    drain(slow, 2)
    assert counting.of("root").get("put", 0) == 2
    assert buf.snapshot().head == 6  # the publication refreshed both


def test_I2_a_registration_and_an_epoch_bump_whose_responses_were_lost_land_once() -> None:
    store = FaultInjectingStore(open_store("memory://"))
    buf = tieredbuf.Buffer(store)
    fill(buf, 2)
    store.arm("put", key=keys.MANIFEST_KEY, when="after", error=PreconditionFailedError, times=1)
    c = buf.consumer("etl", check_every=1)
    c.initialize()
    assert len(_progress_keys(buf)) == 1 and set(buf.snapshot().registry) == {"etl"}
    key = next(iter(_progress_keys(buf)))
    store.arm("put", key=key, when="after", error=OutcomeUnknownError, times=1)
    c2 = buf.consumer("etl")
    c2.initialize()
    assert c2.epoch == 2  # bumped once although the CAS answered "unknown"
    assert drain(c2) == [0, 1]
    with pytest.raises(FencedError):
        drain(c)  # within check_every (1) entries


def test_a_lost_registration_race_leaves_an_orphan_gc_reaps() -> None:
    buf = _buf()
    fill(buf, 1)
    a = buf.consumer("etl")
    from tieredbuf.queue import subscribers as subs

    real = subs.register
    rival: list[str] = []

    def racing(queue, reg, check=None):  # type: ignore[no-untyped-def]
        if not rival:  # another process registers "etl" first
            rival.append("x")
            buf.consumer("etl").initialize()
        return real(queue, reg, check)

    subs.register = racing  # type: ignore[assignment]
    try:
        a.initialize()
    finally:
        subs.register = real  # type: ignore[assignment]
    assert len(_progress_keys(buf)) == 2  # ours is an orphan; we joined the winner's
    assert a.epoch == 2 and drain(a) == [0]
    young = gc.run_once(buf, grace=timedelta(minutes=10))
    assert young.deleted_keys == []
    report = gc.run_once(buf, grace=timedelta(0), now_ms=time.time_ns() // 10**6 + 10**9)
    assert len(_progress_keys(buf)) == 1 and report.deleted_keys
    a.flush()


def test_the_queue_level_subscription_serves_a_driver_without_batches() -> None:
    """What a Spark driver needs: initialize / position / ack_through / flush, no data."""
    buf = _buf()
    fill(buf, 5)
    sub = buf.subscription("spark")
    assert sub.initialize() == 0
    sub.ack_through(2)  # no request
    assert sub.position == 3
    sub.flush()
    again = buf.subscription("spark")
    assert again.initialize() == 3  # resumes; the first instance is fenced
    with pytest.raises(FencedError):
        sub.check()
    assert buf.snapshot().registry["spark"].published_next == 3
    d = buf.subscription()  # "default": the root-resident RFC consumer; new, so it
    assert d.initialize() == 3  # starts at the earliest entry held (0..2 were unlinked)
    d.ack_through(4)
    d.flush()
    assert buf.snapshot().registry["default"].published_next == 5
    assert buf.snapshot().head == 3


def test_I6_the_registry_is_capped_so_the_root_stays_bounded() -> None:
    buf = _buf()
    fill(buf, 1)

    def crowd(snap, draft) -> bool:  # type: ignore[no-untyped-def]
        for i in range(freg.MAX_SUBSCRIBERS):
            name = f"s{i:04d}"
            draft.registry[name] = freg.Registration(name, bytes(15) + b"\x01", 0, 0)
        return True

    buf.queue.update(crowd, "test")
    root = buf.store.get(keys.MANIFEST_KEY).data
    assert len(root) < 100_000  # the registry at its cap: <= 92,170 bytes of it
    with pytest.raises(ConfigError, match="1024 subscribers"):
        buf.consumer("one-too-many").initialize()
    with pytest.raises(ConfigError, match="1024 subscribers"):
        buf.worker("one-too-many").claim()
    # review finding: the default consumer registers too, and got a raw ValueError
    with pytest.raises(ConfigError, match="1024 subscribers"):
        buf.consumer().initialize()
    assert buf.store.get(keys.MANIFEST_KEY).data == root
