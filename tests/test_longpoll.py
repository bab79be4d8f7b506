"""The footer long poll: an idle reader costs <= 0.5 requests/s and sees new entries
within the backoff's cap.  Time is simulated (the poll's clock and sleep): no test
sleeps 60 s; the requests are counted exactly by the buffer's meter."""

from __future__ import annotations

from pathlib import Path

import pytest

import tieredbuf
from tieredbuf.format.manifest import Footer, NewEntry
from tieredbuf.queue.longpoll import IDLE_BACKOFF_MAX_S, FooterPoll


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        assert s >= 0
        self.t += s


def _buf(tmp_path: Path) -> tuple[tieredbuf.Buffer, int]:
    buf = tieredbuf.open(f"file://{tmp_path}/b")
    buf.queue.append([NewEntry("data/a", ())], "p", 1)
    return buf, buf.queue.read_footer().next_sequence


def _poll(buf: tieredbuf.Buffer, clock: _Clock) -> FooterPoll:
    return FooterPoll(buf.queue.read_footer, clock=clock, sleep=clock.sleep)


def test_an_idle_long_poll_costs_at_most_half_a_request_a_second(tmp_path: Path) -> None:
    buf, nxt = _buf(tmp_path)
    clock = _Clock()
    poll = _poll(buf, clock)
    before = buf.requests.snapshot()
    start = clock.t
    while clock.t - start < 60:  # a reader calling next_batch(timeout=1 s) for 60 s
        assert poll.wait(nxt, 1.0) is None
    sent = {
        k: v - before.get(k, 0) for k, v in buf.requests.snapshot().items() if v != before.get(k, 0)
    }
    assert set(sent) == {("get_range", "root")}  # the 22-byte footer, nothing else
    assert sent[("get_range", "root")] == poll.footer_reads
    # 0.1 + 0.2 + 0.4 + 0.8 + 1.6 s, then every 2 s: 0.5/s once idle
    assert 60 * 0.5 - 1 <= poll.footer_reads <= 60 * 0.5 + 5
    # the steady state: over any later 10 s, at most 5 reads
    reads = poll.footer_reads
    start = clock.t
    while clock.t - start < 10:
        poll.wait(nxt, 0.5)
    assert poll.footer_reads - reads <= 10 * 0.5


def test_a_long_poll_sees_a_new_entry_within_the_backoff_cap(tmp_path: Path) -> None:
    buf, nxt = _buf(tmp_path)
    clock = _Clock()
    poll = _poll(buf, clock)
    for _ in range(30):  # long idle: the backoff is at its cap
        poll.wait(nxt, 1.0)
    buf.queue.append([NewEntry("data/b", ())], "p", 2)
    appended_at = clock.t
    reads = poll.footer_reads
    footer = poll.wait(nxt, 30.0)
    assert footer is not None and footer.next_sequence == nxt + 1
    assert clock.t - appended_at <= IDLE_BACKOFF_MAX_S
    assert poll.footer_reads == reads + 1
    assert not poll.idle  # a change ends the idle period: the next one starts at 0.1 s
    t0 = clock.t
    assert poll.wait(nxt + 1, 0.05) is None and poll.footer_reads == reads + 1
    poll.wait(nxt + 1, 1.0)  # reads 0.1, 0.3 and 0.7 s into the new idle period
    assert poll.footer_reads == reads + 4 and clock.t - t0 <= 1.05 + 1e-9


def test_I4_a_long_poll_returns_when_the_epoch_moves(tmp_path: Path) -> None:
    buf, nxt = _buf(tmp_path)
    epoch = buf.queue.initialize("me")
    clock = _Clock()
    poll = _poll(buf, clock)
    assert poll.wait(nxt, 5.0, epoch=epoch) is None
    newer = buf.queue.initialize("someone else")  # fences us: the reader must find out
    footer = poll.wait(nxt, 30.0, epoch=epoch)
    assert footer is not None and footer.epoch == newer != epoch
    assert footer.next_sequence == nxt  # nothing new: only the epoch says it


def test_wake_ends_a_long_poll(tmp_path: Path) -> None:
    import threading

    buf, nxt = _buf(tmp_path)
    poll = FooterPoll(buf.queue.read_footer)  # real clock: wake interrupts the sleep
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(poll.wait(nxt, 3600.0)))
    t.start()
    poll.wake()
    t.join(timeout=60)
    assert not t.is_alive() and got == [None]


def _wait_until(cond, what: str, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _produce(url: str, data: bytes) -> None:
    from datetime import timedelta

    with tieredbuf.open(url).producer(flush_interval=timedelta(milliseconds=1)) as p:
        p.produce([data]).wait(timeout=60)


def _when_idle_produce(c: object, url: str, data: bytes) -> None:
    _wait_until(lambda: c._poll.idle, "the consumer waits")  # type: ignore[attr-defined]
    _produce(url, data)


@pytest.mark.slow
def test_next_batch_with_a_timeout_returns_what_arrives_while_it_waits(tmp_path: Path) -> None:
    import threading

    url = f"file://{tmp_path}/b"
    _produce(url, b"first")
    for name in ("default", "etl"):
        buf = tieredbuf.open(url)
        c = buf.consumer() if name == "default" else buf.consumer(subscriber=name)
        c.initialize()
        got = c.next_batch(timeout=5)
        assert got is not None and b"first" in got.data
        c.ack(got.sequence)
        while (more := c.next_batch()) is not None:  # etl also finds the default's second
            c.ack(more.sequence)
        before = buf.requests.snapshot()
        assert c.next_batch(timeout=0.3) is None  # nothing new: footer reads only
        sent = {
            k: v - before.get(k, 0)
            for k, v in buf.requests.snapshot().items()
            if v != before.get(k, 0)
        }
        assert set(sent) <= {("get_range", "root")}, sent
        t = threading.Thread(target=_when_idle_produce, args=(c, url, b"second-" + name.encode()))
        t.start()
        got = c.next_batch(timeout=60)
        t.join()
        assert got is not None and b"second-" + name.encode() in got.data
        c.ack(got.sequence)
        c.close()


def test_I4_a_long_polling_default_consumer_learns_it_was_fenced(tmp_path: Path) -> None:
    import threading

    import pytest

    from tieredbuf.errors import FencedError

    url = f"file://{tmp_path}/b"
    _produce(url, b"x")
    c = tieredbuf.open(url).consumer()
    c.initialize()
    assert c.next_batch(timeout=5) is not None
    newer = tieredbuf.open(url).consumer()
    t = threading.Thread(
        target=lambda: (_wait_until(lambda: c._poll.idle, "the consumer waits"), newer.initialize())
    )
    t.start()
    with pytest.raises(FencedError):
        c.next_batch(timeout=60)
    t.join()
    c.close()
    newer.close()


@pytest.mark.slow
def test_a_consumer_that_rewinds_after_idling_reads_at_once(tmp_path: Path) -> None:
    """The long poll waits only at the tail: initialize() back to an earlier position
    ends the idle period, so the entries there are returned without waiting for the
    footer to change (it will not)."""
    url = f"file://{tmp_path}/b"
    _produce(url, b"a")
    _produce(url, b"b")
    c = tieredbuf.open(url).consumer()
    c.initialize()
    first = c.next_batch(timeout=5)
    assert first is not None and first.sequence == 0
    c.ack(0)
    assert c.next_batch(timeout=5) is not None
    assert c.next_batch(timeout=0.3) is None and c._poll.idle
    c.initialize(last_acked_sequence=0)  # read sequence 1 again
    again = c.next_batch(timeout=3600)
    assert again is not None and again.sequence == 1
    c.close()


@pytest.mark.slow
def test_idle_poll_max_caps_a_consumers_backoff(tmp_path: Path) -> None:
    """ConsumerConfig.idle_poll_max: a lower cap means more footer reads while idle
    (about 1 / cap a second) and a new entry seen sooner."""
    from datetime import timedelta

    url = f"file://{tmp_path}/b"
    _produce(url, b"first")
    counts = {}
    for cap in (timedelta(milliseconds=100), None):
        buf = tieredbuf.open(url)
        c = buf.consumer(**({} if cap is None else {"idle_poll_max": cap}))
        c.initialize()
        assert c.next_batch(timeout=5) is not None
        before = buf.requests.total("get_range", "root")
        assert c.next_batch(timeout=2.0) is None  # 2 s idle: footer reads only
        counts[cap] = buf.requests.total("get_range", "root") - before
        c.close()
    # the default (0.1 s doubling to 2.5 s) reads at 0.1, 0.3, 0.7 and 1.5 s
    assert counts[None] <= 5
    assert counts[timedelta(milliseconds=100)] >= 10, counts


def test_an_idle_consumers_footer_reads_are_what_its_docstring_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Consumer.next_batch(timeout=...) in a loop, idle for 30 simulated seconds: the
    footer is read at 0, 0.1, 0.3, 0.7, 1.5, 3.1 s and then every ``idle_poll_max``
    (2.5 s) -- 8 reads in the first 10 s after going idle, then 4 per 10 s (0.4/s, P2's
    <= 0.5/s) -- as consume/consumer.py and config.py say."""
    from types import SimpleNamespace

    from tieredbuf.consume import consumer as consumer_module
    from tieredbuf.consume.consumer import IDLE_POLL_MAX_S

    url = f"file://{tmp_path}/b"
    _produce(url, b"x")
    clock = _Clock()
    monkeypatch.setattr(consumer_module, "time", SimpleNamespace(monotonic=clock))
    buf = tieredbuf.open(url)
    c = buf.consumer()
    c.initialize()
    assert c.next_batch(timeout=5) is not None
    reads: list[float] = []
    read_footer = buf.queue.read_footer

    def counted() -> Footer:
        reads.append(clock.t)
        return read_footer()

    monkeypatch.setattr(buf.queue, "read_footer", counted)
    c._poll = FooterPoll(  # the consumer's own settings, on the simulated clock
        counted, first_s=0.1, max_s=IDLE_POLL_MAX_S, clock=clock, sleep=clock.sleep
    )
    start = clock.t
    while clock.t - start < 30:
        assert c.next_batch(timeout=1.0) is None
    since = [round(t - reads[0], 3) for t in reads]
    assert since[:9] == [0.0, 0.1, 0.3, 0.7, 1.5, 3.1, 5.6, 8.1, 10.6]
    per_10s = [sum(1 for t in since if 10 * w <= t < 10 * (w + 1)) for w in range(3)]
    assert per_10s == [8, 4, 4]
    c.close()
