"""Amortised checks and fencing under them (I4), for the default consumer and a named one.

A consumer checks that it is still the current instance of its subscriber (the root
footer's epoch for "default", its progress object for a named subscriber) when it
reaches the end of what it knows, every ``check_every`` entries, every
``check_interval``, and with every write.  So nothing a fenced consumer writes lands
(acks, flushes and dequeues fail with FencedError), and its reads stop within
``check_every`` entries or ``check_interval``, or at its next write.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

import tieredbuf
from tests.faults import CountingStore
from tests.subscriber_util import drain, seed
from tieredbuf import keys
from tieredbuf.errors import ConfigError, FencedError
from tieredbuf.store import open_store

SUBSCRIBERS = ["default", "etl"]
LONG = {"check_every": 10_000, "check_interval": timedelta(hours=1)}
SHORT = {"check_every": 1, "check_interval": timedelta(0)}


class Clock:
    def __init__(self) -> None:
        self.ms = 1_800_000_000_000

    def __call__(self) -> int:
        return self.ms


def _consumer(buf: tieredbuf.Buffer, subscriber: str, clock: Clock | None = None, **kw: Any) -> Any:
    c = buf.consumer(subscriber, **kw)
    if clock is not None:
        c.subscription.clock_ms = clock
    return c


def _state(buf: tieredbuf.Buffer) -> dict[str, bytes]:
    """Every object a consumer could write: the root and the progress objects."""
    found = [keys.MANIFEST_KEY, *(m.key for m in buf.store.list(keys.SUBSCRIBERS_PREFIX))]
    return {k: buf.store.get(k).data for k in found}


@pytest.mark.parametrize("subscriber", SUBSCRIBERS)
def test_serving_a_known_window_costs_the_data_gets_and_one_check_per_check_every(
    subscriber: str,
) -> None:
    """A consumer that already holds a root listing 250 entries reads neither the root nor
    its progress object again to serve them: only the amortised check, once per 100."""
    counting = CountingStore(open_store("memory://"))
    buf = tieredbuf.Buffer(counting)
    seed(buf, 250)
    c = _consumer(
        buf,
        subscriber,
        Clock(),
        read_ahead=0,
        dequeue_every=1000,
        check_every=100,
        check_interval=timedelta(hours=1),
    )
    c.initialize()
    counting.reset()
    assert drain(c, 250) == list(range(250))
    check = ("root", "get_suffix") if subscriber == "default" else ("subscriber", "get")
    assert counting.of("data") == {"get": 250}
    assert counting.of(check[0]) == {check[1]: 2}  # before entries 100 and 200
    other = "subscriber" if subscriber == "default" else "root"
    assert counting.of(other) == {}
    assert counting.of("group") == {}


@pytest.mark.parametrize("subscriber", SUBSCRIBERS)
def test_an_ack_costs_no_request(subscriber: str) -> None:
    counting = CountingStore(open_store("memory://"))
    buf = tieredbuf.Buffer(counting)
    seed(buf, 5)
    c = _consumer(buf, subscriber, Clock(), read_ahead=0)
    c.initialize()
    batches = [c.next_batch() for _ in range(5)]
    counting.reset()
    for b in batches:
        assert b is not None
        c.ack(b.sequence)
    assert counting.counts == {}


@pytest.mark.parametrize("subscriber", SUBSCRIBERS)
def test_I4_a_fenced_consumer_reads_at_most_check_every_entries_more(subscriber: str) -> None:
    buf = tieredbuf.open("memory://")
    seed(buf, 30)
    old = _consumer(
        buf, subscriber, Clock(), check_every=5, check_interval=timedelta(hours=1), read_ahead=2
    )
    old.initialize()
    assert drain(old, 3, ack=False) == [0, 1, 2]
    new = _consumer(buf, subscriber)
    new.initialize()
    more = []
    with pytest.raises(FencedError):
        for _ in range(30):
            b = old.next_batch()
            assert b is not None
            more.append(b.sequence)
    assert more == [3, 4]  # the 6th entry's check found the new epoch
    with pytest.raises(FencedError):
        old.next_batch()  # and it stays fenced
    assert drain(new) == list(range(30))


@pytest.mark.parametrize("subscriber", SUBSCRIBERS)
def test_I4_a_fenced_consumer_reads_stop_once_check_interval_has_passed(subscriber: str) -> None:
    clock = Clock()
    buf = tieredbuf.open("memory://")
    seed(buf, 30)
    old = _consumer(buf, subscriber, clock, check_every=10_000, check_interval=timedelta(seconds=1))
    old.initialize()
    assert drain(old, 2, ack=False) == [0, 1]
    new = _consumer(buf, subscriber)
    new.initialize()
    clock.ms += 999
    b = old.next_batch()  # within the interval: served from what it knows, unchecked
    assert b is not None and b.sequence == 2
    clock.ms += 1
    with pytest.raises(FencedError):
        old.next_batch()


@pytest.mark.parametrize("check", ["long", "short"])
@pytest.mark.parametrize("subscriber", SUBSCRIBERS)
def test_I4_a_fenced_consumers_acks_never_land(subscriber: str, check: str) -> None:
    """Its reads stop within the bound or at its next write; none of its writes lands,
    whatever the check interval."""
    buf = tieredbuf.open("memory://")
    seed(buf, 10)
    old = _consumer(
        buf, subscriber, Clock(), dequeue_every=3, **(LONG if check == "long" else SHORT)
    )
    old.initialize()
    for b in [old.next_batch(), old.next_batch()]:
        assert b is not None
        old.ack(b.sequence)  # two acks: buffered, nothing written yet
    new = _consumer(buf, subscriber)
    new.initialize()
    before = _state(buf)
    with pytest.raises(FencedError):
        for _ in range(10):  # read and ack on: the check or the 3rd ack's write stops it
            b = old.next_batch()
            assert b is not None
            old.ack(b.sequence)
    for op in (lambda: old.ack(2), old.flush, old.next_batch):
        with pytest.raises(FencedError):
            op()
    old.close()  # writes nothing (a fenced close is logged, not raised)
    assert _state(buf) == before
    assert drain(new) == list(range(10))  # the new instance re-reads what old acked


def test_I4_a_fenced_default_consumer_learns_it_from_its_dequeue_before_any_check() -> None:
    counting = CountingStore(open_store("memory://"))
    buf = tieredbuf.Buffer(counting)
    seed(buf, 10)
    old = _consumer(buf, "default", Clock(), dequeue_every=4, read_ahead=0, **LONG)
    old.initialize()
    new = _consumer(buf, "default")
    new.initialize()
    counting.reset()
    for s in range(3):
        b = old.next_batch()
        assert b is not None
        old.ack(s)
    assert counting.of("root") == {}  # three reads and acks: no check was due
    b = old.next_batch()
    assert b is not None
    with pytest.raises(FencedError):
        old.ack(3)  # the 4th ack's dequeue CAS is at old's epoch: refused
    assert counting.of("root") == {"get": 1}  # read, found fenced, not written
    counting.reset()
    with pytest.raises(FencedError):
        old.next_batch()  # it knows now: no request
    assert counting.counts == {}


def test_check_every_and_check_interval_are_validated() -> None:
    buf = tieredbuf.open("memory://")
    with pytest.raises(ConfigError, match="check_every"):
        buf.consumer(check_every=0)
    with pytest.raises(ConfigError, match="check_interval"):
        buf.consumer(check_interval=timedelta(seconds=-1))


def test_a_default_consumers_dequeue_costs_a_root_get_and_put_and_counts_as_a_check() -> None:
    """docs/subscribers.md: every dequeue_every acks, 1 root GET + 1 root PUT; the write
    shows the instance current, so no footer check follows it for check_every entries."""
    counting = CountingStore(open_store("memory://"))
    buf = tieredbuf.Buffer(counting)
    seed(buf, 30)
    c = _consumer(
        buf,
        "default",
        Clock(),
        read_ahead=0,
        dequeue_every=10,
        check_every=10,
        check_interval=timedelta(hours=1),
    )
    c.initialize()
    counting.reset()
    assert drain(c, 25) == list(range(25))  # dequeues after acks 10 and 20
    assert counting.of("root") == {"get": 2, "put": 2}  # and no footer check at all
    counting.reset()
    c.flush()
    assert counting.of("root") == {"get": 1, "put": 1}
