"""Fan-in (produce/fanin.py): one commit per interval carries what every writer uploaded.

The failure cases of cross-writer group commit, each with real processes and SIGKILL
where a process dies: a writer killed with its announcement out, a committer killed
after its commit and before it deleted the announcements, writers whose clocks are
two seconds apart.  Nothing is lost, nothing is duplicated (I1, I2), each writer's
records keep their order (I3), and a write committed by another writer reaches its own
handle as REMOTE with the right sequence.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import tieredbuf
from tieredbuf import keys
from tieredbuf.format import announce as fa
from tieredbuf.produce.fanin import hub_for
from tieredbuf.store import open_store

WORKER = Path(__file__).with_name("fanin_worker.py")


def _writer(
    url: str, name: str, n: int, *flags: str, opts: dict[str, Any] | None = None
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(WORKER), url, json.dumps(opts or {}), name, str(n), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


class Lines:
    """A worker's output lines, read by a thread: waiting for one has a deadline."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self._q: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._q.put(line.strip())
        self._q.put(None)

    def until(self, want: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._q.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {want!r} from the worker in {timeout} s") from None
            if line is None:
                err = self.proc.stderr.read() if self.proc.stderr else ""
                raise AssertionError(f"worker ended before {want!r}: {err}")
            if line.startswith(want):
                return line


def _acks(proc: subprocess.Popen[str], timeout: float = 120) -> dict[str, int]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    acks = {}
    for line in out.splitlines():
        if line.startswith("ACK "):
            _, rec, seq = line.split()
            acks[rec] = int(seq)
    return acks


def _records(buf: tieredbuf.Buffer) -> list[tuple[int, bytes]]:
    out = []
    for e in buf.entries():
        for r in tieredbuf.ConsumedBatch(
            e.sequence, e.location, e.metadata, buf.read_object(e)
        ).entries:
            out.append((e.sequence, r))
    return out


def _check_once_in_order(got: list[tuple[int, bytes]], names: dict[str, int]) -> None:
    recs = [r.decode() for _, r in got]
    assert len(recs) == len(set(recs)), "I2: a record appears twice"
    for name, n in names.items():
        mine = [int(r.split(":")[1]) for r in recs if r.startswith(name + ":")]
        assert mine == list(range(n)), f"I1/I3: {name}'s records lost or out of order"


@contextlib.contextmanager
def _kept_busy(p: Any, fmt: bytes, start: int = 0) -> Iterator[list[int]]:
    """A busy holder keeps renewing its lease: ``p`` produces ``fmt % i`` records one
    after another (each waited for) until the block ends; yields ``[records sent]``."""
    stop = threading.Event()
    sent = [start]

    def run() -> None:
        while not stop.is_set():
            p.produce([fmt % sent[0]]).wait(timeout=60)
            sent[0] += 1

    busy = threading.Thread(target=run)
    busy.start()
    try:
        yield sent
    finally:
        stop.set()
        busy.join(timeout=60)


def _wait_for(cond: Any, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_I2_I3_the_writers_of_one_process_share_each_commit(tmp_path: Path) -> None:
    buf = tieredbuf.open(f"file://{tmp_path}/b")
    producers = [buf.producer(flush_interval=timedelta(milliseconds=20)) for _ in range(6)]
    handles = [
        (i, j, p.produce([f"p{i}:{j}".encode()]))
        for j in range(10)
        for i, p in enumerate(producers)
    ]
    outcomes = {(i, j): h.wait(tieredbuf.Durability.REMOTE, timeout=60) for i, j, h in handles}
    for p in producers:
        p.close()
    got = _records(buf)
    _check_once_in_order(got, {f"p{i}": 10 for i in range(6)})
    by_record = {r.decode(): seq for seq, r in got}
    for (i, j), o in outcomes.items():  # every handle names its entry's sequence
        assert o.sequence == by_record[f"p{i}:{j}"]
    stats = buf.queue.stats
    assert stats.get("entries_appended") == len({seq for seq, _ in got})
    assert stats.get("commits") < stats.get("entries_appended")  # commits carry several
    assert list(buf.store.list(keys.PENDING_PREFIX)) == []  # in-process: never announced


@pytest.mark.slow
def test_I2_a_write_committed_by_another_writer_reaches_its_handle_with_its_sequence(
    tmp_path: Path,
) -> None:
    """Two buffers on one store are two hubs (two processes, as far as fan-in knows):
    the one holding the lease commits the other's announcement, and the other's handle
    gets REMOTE with the sequence the root gave it."""
    url = f"file://{tmp_path}/b"
    holder, other = tieredbuf.open(url), tieredbuf.open(url)
    with holder.producer(manifest_writes_per_s=2.0) as hp:
        hp.produce([b"first"]).wait(timeout=60)  # takes the lease
        lease = holder.snapshot().root.lease
        assert lease is not None and lease.holder == hub_for(holder.store, holder.queue).holder
        with (
            _kept_busy(hp, b"h%d"),
            other.producer(flush_interval=timedelta(milliseconds=5)) as op,
        ):
            got = op.produce([b"theirs"]).wait(tieredbuf.Durability.REMOTE, timeout=60)
        assert hub_for(other.store, other.queue).stats.get("announcements") >= 1
        held = hub_for(holder.store, holder.queue).stats
        # one writer's append without metadata: spelled out in its key, read without a GET
        assert held.get("announcements_read_from_key") == held.get("announcements_read") >= 1
    by_record = {r: seq for seq, r in _records(holder)}
    assert got.sequence == by_record[b"theirs"]
    assert other.queue.stats.get("commits") == 0  # it never committed itself
    assert list(holder.store.list(keys.PENDING_PREFIX)) == []


class HeldAnnouncements:
    """Forwards to a store; holds the first announcement's PUT until ``release`` is set,
    and keeps every announcement's body."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.release = threading.Event()
        self.bodies: list[bytes] = []

    def put(self, key: str, data: Any, *, mode: Any = "overwrite") -> str:
        if key.startswith(keys.PENDING_PREFIX):
            if not self.bodies and not self.release.wait(60):
                raise AssertionError("the first announcement was never released")
            self.bodies.append(bytes(data))
        etag: str = self._inner.put(key, data, mode=mode)
        return etag

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def test_I2_I3_the_writers_of_one_process_announce_together_one_put_a_turn(
    tmp_path: Path,
) -> None:
    """Eight writers of a process that does not hold the lease: what they submitted while
    its last announcement was out goes in one announcement (one PUT, one GET, one run per
    writer), not one object per writer."""
    url = f"file://{tmp_path}/b"
    holder = tieredbuf.open(url)
    held = HeldAnnouncements(open_store(url))
    other = tieredbuf.Buffer(held)  # type: ignore[arg-type]
    with holder.producer(manifest_writes_per_s=5.0) as hp:
        hp.produce([b"first"]).wait(timeout=60)  # takes the lease
        with _kept_busy(hp, b"h%d"):
            try:
                ops = [other.producer(flush_interval=timedelta(milliseconds=5)) for _ in range(8)]
                handles = [p.produce([f"w{i}:0".encode()]) for i, p in enumerate(ops)]
                hub = hub_for(other.store, other.queue)
                _wait_for(lambda: hub.stats.get("groups_submitted") == 8)
                held.release.set()
                for h in handles:
                    h.wait(tieredbuf.Durability.REMOTE, timeout=60)
                for p in ops:
                    p.close()
            finally:
                held.release.set()
    assert hub.stats.get("announced_groups") == 8
    # the one held (the groups submitted before the hub's turn), then the rest at once;
    # one alone when all eight were in before its first turn (a busy machine)
    sent = hub.stats.get("announcements")
    assert 1 <= sent <= 2
    runs = [fa.decode(b) for b in held.bodies]
    assert len(runs) == sent
    assert sum(len(r) for r in runs) == 8  # a run per writer
    assert {a.producer_id for r in runs for a in r} == {p.producer_id for p in ops}
    assert hub_for(holder.store, holder.queue).stats.get("announcements_read") == sent
    _check_once_in_order(
        [(q, r) for q, r in _records(holder) if r.startswith(b"w")], {f"w{i}": 1 for i in range(8)}
    )
    assert list(holder.store.list(keys.PENDING_PREFIX)) == []


@pytest.mark.slow
def test_a_holder_that_leaves_hands_its_lease_to_the_hub_that_announced_last(
    tmp_path: Path,
) -> None:
    """Instead of giving the lease up for every waiting hub to race for it (each LISTing
    and reading every announcement first), the leaving holder names the hub it heard
    from last: that one commits next, and the third hub never LISTs at all."""
    url = f"file://{tmp_path}/b"
    a, b, c = (tieredbuf.open(url) for _ in range(3))
    hubs = {name: hub_for(x.store, x.queue) for name, x in (("a", a), ("b", b), ("c", c))}
    ap = a.producer(manifest_writes_per_s=5.0)
    ap.produce([b"a:0"]).wait(timeout=60)  # a holds the lease before b and c start
    bp = b.producer(flush_interval=timedelta(milliseconds=5))
    cp = c.producer(flush_interval=timedelta(milliseconds=5))
    with _kept_busy(ap, b"a:%d", start=1) as sent:
        bp.produce([b"b:0"]).wait(tieredbuf.Durability.REMOTE, timeout=60)
        cp.produce([b"c:0"]).wait(tieredbuf.Durability.REMOTE, timeout=60)
    ap.close()  # a leaves while b and c were heard from lately
    assert hubs["a"].stats.get("handovers") == 1
    lease = a.snapshot().root.lease
    assert lease is not None and lease.holder in (hubs["b"].holder, hubs["c"].holder)
    heir, other = ("b", "c") if lease.holder == hubs["b"].holder else ("c", "b")
    hb = bp.produce([b"b:1"])
    hc = cp.produce([b"c:1"])
    for h in (hb, hc):
        h.wait(tieredbuf.Durability.REMOTE, timeout=60)
    assert hubs[heir].stats.get("commits") >= 1  # the heir committed next
    assert hubs[other].stats.get("lists") == 0  # the other never raced for the lease
    assert hubs[other].stats.get("announcements") == 2
    bp.close()
    cp.close()
    _check_once_in_order(_records(a), {"a": sent[0], "b": 2, "c": 2})


@pytest.mark.slow
def test_hubs_waiting_on_a_lapsed_lease_take_it_with_their_own_groups_without_listing(
    tmp_path: Path,
) -> None:
    """The holder died (its lease lapses, nobody inherits it): of the three hubs whose
    writers wait, each tries to take the lease with its own groups in one CAS, before any
    LIST. One wins and LISTs on its next turn; the losers read the root, see its lease,
    and never LIST or read an announcement (each used to, for every one listed)."""
    from ulid import ULID

    from tieredbuf.format.batch import encode_batch
    from tieredbuf.queue.commit import Pending, commit

    url = f"file://{tmp_path}/b"
    bufs = [tieredbuf.open(url) for _ in range(3)]
    dead = encode_batch([b"dead:0"])
    loc = keys.data_key(ULID())
    bufs[0].store.put(loc, dead, mode="create")
    commit(bufs[0].queue, [Pending("dead", (fa.Announced(1, loc, len(dead), ()),))],
           holder="h-dead", lease_ms=2_000, interval_ms=200)  # fmt: skip
    producers = [x.producer(flush_interval=timedelta(milliseconds=5)) for x in bufs]
    handles = [p.produce([f"w{i}:0".encode()]) for i, p in enumerate(producers)]
    for h in handles:
        h.wait(tieredbuf.Durability.REMOTE, timeout=60)
    for p in producers:
        p.close()
    hubs = [hub_for(x.store, x.queue) for x in bufs]
    assert all(h.stats.get("announcements") >= 1 for h in hubs)  # the dead one's lease
    winners = [h for h in hubs if h.stats.get("commits") >= 1]
    assert len(winners) == 1
    assert all(h.stats.get("lists") == 0 for h in hubs if h not in winners)
    assert all(h.stats.get("announcements_read") == 0 for h in hubs if h not in winners)
    _check_once_in_order(_records(bufs[0]), {"dead": 1, "w0": 1, "w1": 1, "w2": 1})


def test_a_watcher_that_takes_a_lapsed_lease_over_holds_it_long(tmp_path: Path) -> None:
    """A watcher (it met another hub's lease) whose holder stopped committing takes the
    lease over with its own groups, before any LIST.  That commit carries no announcement,
    and its lease was the short one of a lone writer (two periods, 0.4-1.4 s): on a busy
    machine it lapsed again before the taker's next turn, and every waiting hub raced
    for it, herd after herd (the cost benchmark: 26 and 40 conflicts in a row).  Having
    met others lately, the taker holds the long lease."""
    from ulid import ULID

    from tieredbuf.format.batch import encode_batch
    from tieredbuf.produce.fanin import LEASE_MIN_S
    from tieredbuf.queue.commit import Pending, commit

    url = f"file://{tmp_path}/b"
    b = tieredbuf.open(url)
    body, loc = encode_batch([b"s:0"]), keys.data_key(ULID())
    b.store.put(loc, body, mode="create")
    commit(b.queue, [Pending("s", (fa.Announced(1, loc, len(body), ()),))],
           holder="h-stalled", lease_ms=60_000, interval_ms=200)  # fmt: skip
    hub = hub_for(b.store, b.queue)
    p = b.producer(flush_interval=timedelta(milliseconds=5))
    h = p.produce([b"b:0"])
    _wait_for(lambda: hub.stats.get("announcements") == 1)  # a watcher of h-stalled
    real = b.queue.clock_ms
    ahead = lambda: real() + 90_000  # noqa: E731  h-stalled's lease lapses (b's clock)
    b.queue.clock_ms = hub.wall_ms = ahead
    h.wait(tieredbuf.Durability.REMOTE, timeout=60)
    lease = b.snapshot().root.lease
    assert lease is not None and lease.holder == hub.holder
    assert lease.expires_ms - hub.wall_ms() > (LEASE_MIN_S - 1) * 1000
    p.close()
    _check_once_in_order(_records(b), {"s": 1, "b": 1})


class DamagedFirstAnnouncement:
    """Forwards to a store; the first announcement it writes lands with a byte of its
    body flipped, and its key form (format/spelled.py) ``dropped`` (the key asks for the
    body to be read), ``damaged`` (a character changed: the reader reads the body) or
    ``intact``."""

    def __init__(self, inner: Any, key_form: str) -> None:
        self._inner = inner
        self.key_form = key_form
        self.damaged: str | None = None

    def put(self, key: str, data: Any, *, mode: Any = "overwrite") -> str:
        if key.startswith(keys.PENDING_PREFIX) and self.damaged is None:
            parsed, form = keys.parse_pending_key(key), keys.pending_key_form(key)
            assert parsed is not None and form, "the announcement was spelled out in its key"
            if self.key_form == "dropped":
                form = ""
            elif self.key_form == "damaged":
                form = form[:-1] + ("1" if form[-1] != "1" else "2")
            key = keys.pending_key(*parsed, form)
            self.damaged = key
            raw = bytearray(data)
            raw[len(raw) // 2] ^= 0xFF
            data = bytes(raw)
        etag: str = self._inner.put(key, data, mode=mode)
        return etag

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@pytest.mark.slow
@pytest.mark.parametrize("key_form", ["dropped", "damaged"])
def test_I1_I7_I10_a_damaged_announcement_is_never_committed_and_its_groups_go_in_again(
    tmp_path: Path, key_form: str
) -> None:
    """A writer's first group is in a damaged announcement, its second in a good one that
    names the first as the append it follows.  The second must not go in alone (its
    watermark would cover the first, whose writer would be told REMOTE for records never
    appended): the holder holds it back, the writer's hub announces both again after a
    few commits without them, and both land once, in order, each REMOTE with its own
    entry; the damaged announcement is never committed."""
    url = f"file://{tmp_path}/b"
    holder = tieredbuf.open(url)
    damaging = DamagedFirstAnnouncement(open_store(url), key_form)
    other = tieredbuf.Buffer(damaging)  # type: ignore[arg-type]
    hp = holder.producer(manifest_writes_per_s=5.0)
    hp.produce([b"h:0"]).wait(timeout=60)  # the holder holds the lease
    theirs = hub_for(other.store, other.queue)
    mine = hub_for(holder.store, holder.queue)
    op = other.producer(flush_interval=timedelta(milliseconds=5))
    with _kept_busy(hp, b"h:%d", start=1):
        first = op.produce([b"o:0"])
        _wait_for(lambda: theirs.stats.get("announcements") == 1)
        second = op.produce([b"o:1"])
        got = [h.wait(tieredbuf.Durability.REMOTE, timeout=60) for h in (first, second)]
        assert mine.stats.get("announcements_corrupt") >= 1
        assert mine.stats.get("held_back_gap") >= 1  # the second waited for the first
        assert theirs.stats.get("reannounced") >= 1
        op.close(timeout=60)
    hp.close()
    assert damaging.damaged is not None
    by_record = {r: seq for seq, r in _records(holder)}
    assert [g.sequence for g in got] == [by_record[b"o:0"], by_record[b"o:1"]]
    assert by_record[b"o:0"] < by_record[b"o:1"]
    _check_once_in_order([(q, r) for q, r in _records(holder) if r.startswith(b"o")], {"o": 2})


@pytest.mark.slow
def test_I1_an_announcement_whose_body_is_damaged_is_committed_from_its_intact_key(
    tmp_path: Path,
) -> None:
    """The key form is checked against the body's CRC as written, and the body's length
    as listed: a key that passes says exactly what the body said before its damage, so
    the holder commits it -- both groups, nothing lost -- and never reads the body."""
    url = f"file://{tmp_path}/b"
    holder = tieredbuf.open(url)
    damaging = DamagedFirstAnnouncement(open_store(url), "intact")
    other = tieredbuf.Buffer(damaging)  # type: ignore[arg-type]
    with holder.producer(manifest_writes_per_s=5.0) as hp:
        hp.produce([b"h:0"]).wait(timeout=60)  # the holder holds the lease
        mine = hub_for(holder.store, holder.queue)
        with _kept_busy(hp, b"h:%d", start=1), other.producer() as op:
            got = [op.produce([b"o:%d" % i]).wait(timeout=60) for i in range(2)]
        assert all(g.durability is tieredbuf.Durability.REMOTE for g in got)
        assert mine.stats.get("announcements_corrupt") == 0
        assert mine.stats.get("announcements_read_from_key") >= 1
    assert damaging.damaged is not None
    assert [r for _, r in _records(holder) if r.startswith(b"o")] == [b"o:0", b"o:1"]


class RootWriteTimes:
    """Forwards to a store; notes when each root CAS that landed (not the root's creation)
    was sent: the budget spaces the writes as the store receives them."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.times: list[float] = []

    def put(self, key: str, data: Any, *, mode: Any = "overwrite") -> str:
        sent = time.monotonic()
        etag: str = self._inner.put(key, data, mode=mode)
        if key == keys.MANIFEST_KEY and mode != "create":
            self.times.append(sent)
        return etag

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@pytest.mark.slow
def test_the_holder_commits_once_per_interval_while_its_own_writers_keep_submitting() -> None:
    """The budget holds for the committer's own process too: writers handing it groups
    all the time do not cut its wait for the next slot short (each submit wakes the hub).
    The gaps are the hub's own pacing (monotonic clock), a bound the code guarantees."""
    store = RootWriteTimes(open_store("memory://"))
    buf = tieredbuf.Buffer(store)  # type: ignore[arg-type]
    rate = 5.0
    producers = [
        buf.producer(flush_interval=timedelta(milliseconds=5), manifest_writes_per_s=rate)
        for _ in range(4)
    ]
    handles = []
    for j in range(40):  # ~1 s of input: a group from some writer every few ms
        for i, p in enumerate(producers):
            handles.append(p.produce([f"p{i}:{j}".encode()]))
        threading.Event().wait(0.025)  # pacing of the input, not synchronisation
    for h in handles:
        h.wait(tieredbuf.Durability.REMOTE, timeout=60)
    for p in producers:
        p.close()
    commits = store.times
    assert len(commits) >= 2
    gaps = [b - a for a, b in itertools.pairwise(commits)]
    assert min(gaps) >= 1 / rate, f"root writes closer than the interval: {gaps}"
    _check_once_in_order(_records(buf), {f"p{i}": 40 for i in range(4)})


def _hold_the_lease_and_produce(buf: tieredbuf.Buffer, n: int, every: float) -> None:
    """One producer (a 2 s flush timer, 5 commits a second) takes the lease with ``p:0``,
    then produces ``p:1`` .. ``p:n`` one each ``every`` seconds, waits for all to be
    REMOTE and closes."""
    p = buf.producer(flush_interval=timedelta(seconds=2), manifest_writes_per_s=5.0)
    p.produce([b"p:0"]).wait(tieredbuf.Durability.REMOTE, timeout=60)  # the lease
    handles = []
    for j in range(1, n + 1):
        handles.append(p.produce([f"p:{j}".encode()]))
        threading.Event().wait(every)  # pacing of the input, not synchronisation
    for h in handles:
        h.wait(tieredbuf.Durability.REMOTE, timeout=60)
    p.close()


@pytest.mark.slow
def test_a_producer_in_the_holding_process_cuts_its_batches_for_the_next_commit() -> None:
    """A batch waits for its flush timer and then for the hub's next commit: a producer
    whose hub holds the lease cuts it in time for that commit instead, never later than
    the timer. With a 2 s timer and commits 5 times a second, a second of input goes in
    several commits, not in one batch two seconds later."""
    buf = tieredbuf.Buffer(open_store("memory://"))
    _hold_the_lease_and_produce(buf, 40, every=0.025)  # a record every 25 ms for a second
    assert len(list(buf.entries())) >= 4  # a data object per commit slot, about (one or
    # two with the timer alone)
    _check_once_in_order(_records(buf), {"p": 41})


class SlowLists:
    """Forwards to a store; every LIST takes ``delay`` seconds (a turn that runs late)."""

    def __init__(self, inner: Any, delay: float) -> None:
        self._inner = inner
        self.delay = delay

    def list(self, prefix: str) -> Any:
        threading.Event().wait(self.delay)  # the round trip, not synchronisation
        return self._inner.list(prefix)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@pytest.mark.slow
def test_a_producer_cuts_at_most_once_a_turn_for_its_hub_while_the_turn_runs_late() -> None:
    """While the holder's turn runs late (a slow LIST), its cut-off has passed and a batch
    cut now would still go in that commit: a producer cuts once for it, not every batch it
    opens meanwhile (each a data object)."""
    buf = tieredbuf.Buffer(SlowLists(open_store("memory://"), 0.35))  # type: ignore[arg-type]
    _hold_the_lease_and_produce(buf, 200, every=0.005)  # a record every 5 ms for a second
    commits = buf.queue.stats.get("commits")
    objects = len(list(buf.entries()))
    assert objects <= 2 * commits + 2, (objects, commits)  # a cut per turn, and the timer
    _check_once_in_order(_records(buf), {"p": 201})


def test_an_idle_producer_and_hub_make_no_request(tmp_path: Path) -> None:
    buf = tieredbuf.open(f"file://{tmp_path}/b")
    with buf.producer(manifest_writes_per_s=20.0) as p:
        p.produce([b"x"]).wait(timeout=60)
        hub = hub_for(buf.store, buf.queue)
        _wait_for(lambda: hub.pending() == 0)
    before = buf.requests.snapshot()
    with buf.producer() as idle:
        assert idle.stats.snapshot().get("batches_flushed", 0) == 0
    assert buf.requests.snapshot() == before  # attach and detach: no request


@pytest.mark.slow
def test_the_holder_deletes_what_it_committed_at_most_once_a_second_and_all_when_it_leaves(
    tmp_path: Path,
) -> None:
    """A holder deleted the announcements every commit carried right after it: one
    DELETE a commit, as many as its LISTs and CASes.  It now deletes them together at
    most once a second (a covered announcement left meanwhile is skipped by its LIST,
    never committed or read again), and every one before it gives the lease up."""
    url = f"file://{tmp_path}/b"
    holder, other = tieredbuf.open(url), tieredbuf.open(url)
    hp = holder.producer(manifest_writes_per_s=10.0)
    hp.produce([b"h:0"]).wait(timeout=60)  # the holder takes the lease first
    op = other.producer(flush_interval=timedelta(milliseconds=5))
    hub = hub_for(holder.store, holder.queue)
    with _kept_busy(hp, b"h:%d", start=1) as sent:
        started = time.monotonic()
        for i in range(12):  # one announcement each, each carried by its own commit
            op.produce([b"o:%d" % i]).wait(tieredbuf.Durability.REMOTE, timeout=60)
        took = time.monotonic() - started
        deletes = holder.requests.snapshot().get(("delete", "announcement"), 0)
    assert hub.stats.get("commits") >= 12
    assert deletes <= took + 1, f"{deletes} DELETEs in {took:.1f} s"
    op.close(timeout=60)
    hp.close(timeout=60)
    assert hub.stats.get("announcements_deleted") == 12
    assert list(holder.store.list(keys.PENDING_PREFIX)) == []  # none left behind
    assert other.queue.stats.get("commits") == 0
    _check_once_in_order(_records(holder), {"h": sent[0], "o": 12})


@pytest.mark.slow
def test_a_holder_that_finds_covered_announcements_left_behind_deletes_them_unread_twice(
    tmp_path: Path,
) -> None:
    """Announcements a gone holder committed and never deleted (it died, or lost its
    lease before its once-a-second delete) are covered already: the next holder deletes
    them without committing them again, and does not take their announcer for a live
    hub -- it handed its lease to that gone hub when it left, and every other writer
    waited out a long lease."""
    url = f"file://{tmp_path}/b"
    gone, holder = tieredbuf.open(url), tieredbuf.open(url)
    with gone.producer() as gp:
        gp.produce([b"g:0"]).wait(tieredbuf.Durability.REMOTE, timeout=60)
        pid = gp.producer_id
    wm = gone.snapshot().view.watermarks[pid]
    entry = next(iter(gone.entries()))
    left = keys.pending_key("h-" + "0" * 26, 1)  # a hub that is gone
    body = fa.encode(
        [fa.make(pid, 0, [fa.Announced(wm.producer_seq, entry.location, 1, ())])],
        int(time.time() * 1000),
    )
    holder.store.put(left, body, mode="create")
    hub = hub_for(holder.store, holder.queue)
    hp = holder.producer(flush_interval=timedelta(milliseconds=5))
    for i in range(5):  # the first commit takes the lease; the later turns LIST
        hp.produce([b"h:%d" % i]).wait(tieredbuf.Durability.REMOTE, timeout=60)
    hp.close(timeout=60)
    assert hub.stats.get("lists") >= 1
    assert list(holder.store.list(keys.PENDING_PREFIX)) == []
    assert hub.stats.get("handovers") == 0
    lease = holder.snapshot().root.lease
    assert lease is None or lease.holder == hub.holder  # never the gone hub's
    _check_once_in_order(_records(holder), {"g": 1, "h": 5})


@pytest.mark.slow
def test_I1_I2_a_writer_killed_with_its_announcement_out_loses_and_duplicates_nothing(
    tmp_path: Path,
) -> None:
    url = f"file://{tmp_path}/b"
    buf = tieredbuf.open(url)
    with buf.producer(manifest_writes_per_s=0.5) as holder:  # commits every 2 s
        holder.produce([b"holder:0"]).wait(timeout=60)
        # busy, so its lease stays live however long the writer takes to start (a lease
        # that lapsed meanwhile had the writer commit its own record, never announce it)
        with _kept_busy(holder, b"holder:%d", start=1) as sent:
            w = _writer(url, "w", 1, "--hold")
            try:
                _wait_for(lambda: any(True for _ in buf.store.list(keys.PENDING_PREFIX)))
            finally:
                w.send_signal(signal.SIGKILL)  # announced, not committed yet (or just)
                w.communicate(timeout=30)
        # the next commit of any live writer carries the dead one's announcement
        holder.produce([b"holder:%d" % sent[0]]).wait(timeout=60)
    _check_once_in_order(_records(buf), {"holder": sent[0] + 1, "w": 1})
    assert list(buf.store.list(keys.PENDING_PREFIX)) == []


@pytest.mark.slow
def test_I1_I2_a_committer_killed_after_its_commit_before_its_deletes_loses_nothing(
    tmp_path: Path,
) -> None:
    url = f"file://{tmp_path}/b"
    # a busy committer: it writes all the time, so it lists and commits every interval
    c = _writer(url, "c", 100_000, "--rate", "2", "--crash-before-delete")
    lines = Lines(c)
    try:
        lines.until("ACK c:0")  # it committed its own record: it holds the lease
        buf = tieredbuf.open(url)
        with buf.producer(flush_interval=timedelta(milliseconds=5)) as w:
            first = w.produce([b"w:0"])  # announced; the committer commits it, then stops
            lines.until("CRASHPOINT")
            c.send_signal(signal.SIGKILL)
            c.communicate(timeout=30)
            assert first.wait(timeout=60).sequence is not None
            assert list(buf.store.list(keys.PENDING_PREFIX)) != []  # left behind
            # the dead holder's lease lapses; this writer takes over and cleans up
            w.produce([b"w:1"]).wait(timeout=60)
    finally:
        if c.poll() is None:
            c.send_signal(signal.SIGKILL)
            c.communicate(timeout=30)
    got = _records(buf)
    acked = sum(1 for _, r in got if r.startswith(b"c:"))
    _check_once_in_order(got, {"c": acked, "w": 2})
    assert list(buf.store.list(keys.PENDING_PREFIX)) == []


@pytest.mark.slow
def test_I2_I3_writers_with_clocks_two_seconds_apart_lose_and_duplicate_nothing(
    tmp_path: Path,
) -> None:
    url = f"file://{tmp_path}/b"
    tieredbuf.open(url).create()
    procs = {
        f"s{i}": _writer(url, f"s{i}", 25, "--skew-ms", str(skew))
        for i, skew in enumerate((-2000, 0, 2000))
    }
    acks = {name: _acks(p) for name, p in procs.items()}
    buf = tieredbuf.open(url)
    got = _records(buf)
    _check_once_in_order(got, {name: 25 for name in procs})
    by_record = {r.decode(): seq for seq, r in got}
    for a in acks.values():
        for rec, seq in a.items():
            assert by_record[rec] == seq  # each handle got its own entry's sequence
    assert list(buf.store.list(keys.PENDING_PREFIX)) == []


class RoundTrips:
    """Forwards to a store, each request ``delay`` seconds late: a slow store's round
    trips (injected latency, as tests/latency_proxy.py adds over HTTP)."""

    def __init__(self, inner: Any, delay: float) -> None:
        self._inner = inner
        self.delay = delay

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name not in ("get", "get_range", "get_suffix", "head", "put", "list", "delete_many"):
            return attr

        def slow(*args: Any, **kw: Any) -> Any:
            threading.Event().wait(self.delay)  # the round trip, not synchronisation
            return attr(*args, **kw)

        return slow


@pytest.mark.slow
def test_I2_the_lease_outlasts_the_holders_commit_turn_at_slow_round_trips(
    tmp_path: Path,
) -> None:
    """At 120 ms a request a commit turn (LIST, root GET, root PUT) takes longer than
    two 200 ms intervals minus one: a lease of two intervals lapsed between every two
    commits of a busy holder, and a writer elsewhere then committed itself (racing the
    holder, a CAS conflict each time) instead of announcing.  The lease now covers the
    holder's measured turn: the other writer announces and never commits."""
    inner = open_store(f"file://{tmp_path}/b")
    holder = tieredbuf.Buffer(RoundTrips(inner, 0.12))  # type: ignore[arg-type]
    other = tieredbuf.Buffer(RoundTrips(inner, 0.12))  # type: ignore[arg-type]
    stop = threading.Event()
    hp = holder.producer(flush_interval=timedelta(milliseconds=5))
    try:
        for i in range(3):  # a few commits: the holder has measured its turn
            hp.produce([b"warm%d" % i]).wait(tieredbuf.Durability.REMOTE, timeout=60)

        def keep_busy() -> None:  # a busy holder keeps committing (short lease: alone)
            i = 0
            while not stop.is_set():
                hp.produce([b"h%d" % i]).wait(tieredbuf.Durability.REMOTE, timeout=60)
                i += 1

        busy = threading.Thread(target=keep_busy)
        busy.start()
        op = other.producer(flush_interval=timedelta(milliseconds=5))
        try:
            for i in range(8):
                op.produce([b"o%d" % i]).wait(tieredbuf.Durability.REMOTE, timeout=60)
        finally:
            stop.set()
            busy.join(timeout=60)
            op.close(timeout=60)
    finally:
        hp.close(timeout=60)
    assert other.queue.stats.get("commits") == 0, "the other writer raced the holder"
    assert hub_for(other.store, other.queue).stats.get("announcements") >= 8
    assert sorted(r for _, r in _records(holder) if r.startswith(b"o")) == [
        b"o%d" % i for i in range(8)
    ]


@pytest.mark.slow
def test_a_holder_whose_writers_went_quiet_keeps_committing_for_others_while_its_lease_lives(
    tmp_path: Path,
) -> None:
    """A holder that committed another process's announcement took the long lease (5 s).
    When its own writers went quiet and its next LIST found nothing, it stopped looking
    while the lease lived: the other writer's next announcement waited for the lease to
    lapse (about 5 s) and was then committed by its own hub.  Now the holder keeps
    LISTing while it holds a long lease: it commits the other's writes, which never
    commits itself."""
    url = f"file://{tmp_path}/b"
    holder, other = tieredbuf.open(url), tieredbuf.open(url)
    hp = holder.producer(flush_interval=timedelta(milliseconds=5))
    op = other.producer(flush_interval=timedelta(milliseconds=5))
    try:
        hp.produce([b"h0"]).wait(tieredbuf.Durability.REMOTE, timeout=60)  # takes the lease
        first = op.produce([b"o0"])  # announced: the holder is live
        _wait_for(lambda: bool(list(holder.store.list(keys.PENDING_PREFIX))))
        hp.produce([b"h1"]).wait(tieredbuf.Durability.REMOTE, timeout=60)  # carries o0
        first.wait(tieredbuf.Durability.REMOTE, timeout=60)
        lease = holder.snapshot().root.lease
        assert lease is not None and lease.holder == hub_for(holder.store, holder.queue).holder
        for i in range(1, 4):  # the holder's writers are quiet now; the other writes
            threading.Event().wait(0.6)  # now and then (3 intervals apart: the scenario)
            op.produce([b"o%d" % i]).wait(tieredbuf.Durability.REMOTE, timeout=60)
        assert other.queue.stats.get("commits") == 0, "the other waited out the lease"
    finally:
        op.close(timeout=60)
        hp.close(timeout=60)
    assert sorted(r for _, r in _records(holder)) == sorted(
        [b"h0", b"h1", b"o0", b"o1", b"o2", b"o3"]
    )


class SlowAnnouncements:
    """Forwards to a store; an announcement's PUT lands ``delay`` seconds late (longer
    than an interval: it lands after the holder's next LIST)."""

    def __init__(self, inner: Any, delay: float) -> None:
        self._inner = inner
        self.delay = delay

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def put(self, key: str, data: Any, **kw: Any) -> Any:
        if key.startswith(keys.PENDING_PREFIX):
            threading.Event().wait(self.delay)  # the round trip, not synchronisation
        return self._inner.put(key, data, **kw)


@pytest.mark.slow
def test_a_watcher_polls_for_the_first_commit_listed_after_its_announcement_landed(
    tmp_path: Path,
) -> None:
    """A commit whose LIST came before an announcement landed cannot carry it.  The
    watcher polled for the holder's next commit as soon as its announcement's PUT
    returned, however late that was: with PUTs longer than an interval, every write cost
    a poll that found a commit without it, and another (the cost benchmark's trace: 18 of
    64 polls).  Now it polls on the holder's first beat after the landing."""
    url = f"file://{tmp_path}/b"
    holder = tieredbuf.open(url)
    other = tieredbuf.Buffer(SlowAnnouncements(open_store(url), 0.35))  # type: ignore[arg-type]
    hp = holder.producer(flush_interval=timedelta(milliseconds=5))
    try:
        hp.produce([b"h"]).wait(tieredbuf.Durability.REMOTE, timeout=60)  # takes the lease
        with _kept_busy(hp, b"h%d"):
            op = other.producer(flush_interval=timedelta(milliseconds=5))
            try:
                for i in range(8):
                    op.produce([b"o%d" % i]).wait(tieredbuf.Durability.REMOTE, timeout=60)
                polls = hub_for(other.store, other.queue).stats.get("root_polls")
            finally:
                op.close(timeout=60)
    finally:
        hp.close(timeout=60)
    assert other.queue.stats.get("commits") == 0, "the other writer took the lease"
    assert polls <= 8 + 3, f"{polls} polls for 8 writes"  # one each, bar a late commit


@pytest.mark.slow
def test_a_quiet_holder_commits_what_a_writer_elsewhere_announced_while_its_lease_lives(
    tmp_path: Path,
) -> None:
    """A holder took its turns only while its last LIST showed announcements (or it held
    the long lease): announcements made after an empty LIST waited for its short lease
    to lapse, and then every writer waiting raced for it (the cost benchmark's 100 B
    rows: up to three waves of 3-14 conflicts).  A holder now takes its turns while its
    lease lives: a LIST each, one commit of the announcement."""
    url = f"file://{tmp_path}/b"
    holder, other = tieredbuf.open(url), tieredbuf.open(url)
    flush = timedelta(milliseconds=5)  # a budget of 1/s: a lease of seconds, no lapse here
    hp = holder.producer(flush_interval=flush, manifest_writes_per_s=1.0)
    op = other.producer(flush_interval=flush, manifest_writes_per_s=1.0)
    try:
        hp.produce([b"h0"]).wait(tieredbuf.Durability.REMOTE, timeout=60)  # takes the lease
        op.produce([b"o0"]).wait(tieredbuf.Durability.REMOTE, timeout=60)  # the holder's
        lease = other.snapshot().root.lease
        assert lease is not None and lease.holder == hub_for(holder.store, holder.queue).holder
        assert other.queue.stats.get("commits") == 0, "the writer elsewhere took the lease"
    finally:
        op.close(timeout=60)
        hp.close(timeout=60)
    assert sorted(r for _, r in _records(holder)) == [b"h0", b"o0"]


def test_a_first_lease_outlasts_a_conditional_put_of_a_loaded_store(tmp_path: Path) -> None:
    """A hub's first lease was two intervals (0.4 s at the default budget): its turn was
    not measured yet.  A first conditional PUT of 0.3-0.7 s (file:// with 16 processes
    fsyncing) landed a lease that had lapsed already, and every waiting writer raced for
    it.  An unmeasured turn now counts 0.5 s: 1.4 s from the write."""
    buf = tieredbuf.open(f"file://{tmp_path}/b")
    with buf.producer(flush_interval=timedelta(milliseconds=5)) as p:
        p.produce([b"x"]).wait(tieredbuf.Durability.REMOTE, timeout=60)
        acked_ms = int(time.time() * 1000)
        lease = buf.snapshot().root.lease
        assert lease is not None and lease.expires_ms - acked_ms > 700
