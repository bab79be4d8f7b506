"""Work queues: lease extension (SQS's ChangeMessageVisibility), dead-letter redrive,
and the long poll of an idle ``claim(timeout=...)`` (exact request counts)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import tieredbuf
from tests.faults import CountingStore, FaultInjectingStore
from tests.subscriber_util import fill, seed
from tieredbuf import keys
from tieredbuf.consume.claimwait import ClaimWait
from tieredbuf.errors import ConfigError, LeaseExpiredError, OutcomeUnknownError
from tieredbuf.format.manifest import Footer
from tieredbuf.format.progress import KEPT, Progress
from tieredbuf.store import open_store


class Clock:
    def __init__(self) -> None:
        self.t = 1_800_000_000_000

    def __call__(self) -> int:
        return self.t


def _worker(buf: tieredbuf.Buffer, clock: Clock | None = None, **kw: Any) -> Any:
    w = buf.worker("jobs", **kw)
    if clock is not None:
        w.subscription.clock_ms = clock
    return w


def _info(buf: tieredbuf.Buffer) -> Any:
    (info,) = [s for s in buf.subscribers() if s.name == "jobs"]
    return info


# --- extend -----------------------------------------------------------------------------


def test_extend_keeps_an_entry_past_its_lease_and_other_workers_wait() -> None:
    buf = tieredbuf.open("memory://")
    fill(buf, 1)
    clock = Clock()
    a = _worker(buf, clock, lease=timedelta(seconds=10))
    b = _worker(buf, clock, lease=timedelta(seconds=10))
    got = a.claim()
    assert got is not None
    for _ in range(5):  # 50 s of work, extended every 8 s
        clock.t += 8_000
        a.extend(got.sequence, timedelta(seconds=10))
        assert a.expires_ms(got.sequence) == clock.t + 10_000
        assert b.claim() is None
    a.ack(got.sequence)
    a.flush()
    assert _info(buf).next_sequence == 1 and _info(buf).rejected == ()


def test_extend_is_fenced_like_an_ack_once_another_worker_took_the_entry() -> None:
    buf = tieredbuf.open("memory://")
    fill(buf, 1)
    clock = Clock()
    a = _worker(buf, clock, lease=timedelta(seconds=10))
    b = _worker(buf, clock, lease=timedelta(seconds=10))
    got = a.claim()
    assert got is not None
    clock.t += 60_000
    again = b.claim()
    assert again is not None and again.sequence == got.sequence
    with pytest.raises(LeaseExpiredError) as e:
        a.extend(got.sequence, timedelta(seconds=10))
    assert e.value.sequences == [got.sequence]
    assert a.held == []  # no longer a's: its later ack is not even buffered
    b.ack(again.sequence)
    b.flush()
    assert _info(buf).next_sequence == 1


def test_a_lapsed_lease_nobody_took_may_still_be_extended() -> None:
    buf = tieredbuf.open("memory://")
    fill(buf, 1)
    clock = Clock()
    a = _worker(buf, clock, lease=timedelta(seconds=10))
    got = a.claim()
    assert got is not None
    clock.t += 60_000
    a.extend(got.sequence, timedelta(seconds=10))
    assert _worker(buf, clock).claim() is None
    a.ack(got.sequence)
    a.flush()
    assert _info(buf).next_sequence == 1


def test_I2_an_extend_whose_cas_response_was_lost_is_applied_once() -> None:
    store = FaultInjectingStore(open_store("memory://"))
    buf = tieredbuf.Buffer(store)
    fill(buf, 1)
    clock = Clock()
    a = _worker(buf, clock, lease=timedelta(seconds=10))
    got = a.claim()
    assert got is not None
    key = next(m.key for m in store.list(keys.SUBSCRIBERS_PREFIX))
    fault = store.arm("put", key=key, when="after", error=OutcomeUnknownError, times=1)
    clock.t += 5_000
    a.extend(got.sequence, timedelta(seconds=30))
    assert fault.fired == 1
    (lease,) = a.subscription.reload().leases
    assert lease.expires_ms == clock.t + 30_000 and lease.deliveries == 1


def test_extend_takes_a_positive_duration_and_an_entry_claim_returned() -> None:
    buf = tieredbuf.open("memory://")
    fill(buf, 2)
    w = _worker(buf, claim_batch=2)
    got = w.claim()
    assert got is not None
    with pytest.raises(ValueError, match="positive"):
        w.extend(got.sequence, timedelta(0))
    with pytest.raises(tieredbuf.errors.AckOrderError):
        w.extend(got.sequence + 1, timedelta(seconds=1))  # leased, never returned


# --- dead letters and redrive ---------------------------------------------------------


def _dead_letters(buf: tieredbuf.Buffer, clock: Clock, n: int, bad: set[int]) -> None:
    """``n`` entries through one worker: those in ``bad`` rejected, the rest acked."""
    w = _worker(buf, clock, claim_batch=n)
    for _ in range(n):
        got = w.claim()
        assert got is not None
        if got.sequence in bad:
            w.reject(got.sequence, reason=b"bad")
        else:
            w.ack(got.sequence)
    w.close()


def test_a_kept_dead_letter_holds_its_entry_in_the_buffer_until_dropped() -> None:
    """I9: a rejected entry is not lost data: the queue's published position stays at it
    (the buffer keeps the entry for a redrive) until it is redriven or dropped."""
    buf = tieredbuf.open("memory://")
    fill(buf, 4)
    clock = Clock()
    _dead_letters(buf, clock, 4, {1})
    info = _info(buf)
    assert info.next_sequence == 4 and info.published_next == 1
    assert [(r.seq, r.reason) for r in info.rejected] == [(1, b"bad")]
    assert buf.snapshot().head == 1  # entries 1.. stay linked
    r = buf.redrive("jobs", drop=True)
    assert r.dropped == (1,) and r.redriven == ()
    buf.publish_subscribers()
    assert _info(buf).published_next == 4 and buf.snapshot().head == 4
    assert [x.flags & KEPT for x in _info(buf).rejected] == [0]  # listed still


def test_redrive_makes_dead_letters_claimable_again_with_their_count_reset() -> None:
    buf = tieredbuf.open("memory://")
    fill(buf, 5)
    clock = Clock()
    _dead_letters(buf, clock, 5, {1, 3})
    r = buf.redrive("jobs", [3, 4, 9])
    assert (r.redriven, r.not_found) == ((3,), (4, 9))  # 4 was acked, 9 never existed
    assert _info(buf).next_sequence == 3
    w = _worker(buf, clock, max_deliveries=1)
    got = w.claim()
    assert got is not None and got.sequence == 3 and got.entries == [b"r3"]
    w.ack(3)
    assert w.claim() is None
    w.close()
    assert buf.redrive("jobs").redriven == (1,)
    w = _worker(buf, clock, max_deliveries=1)
    got = w.claim()
    assert got is not None and got.sequence == 1
    w.ack(1)
    w.close()
    info = _info(buf)
    assert info.next_sequence == 5 and info.rejected == () and info.work["rejected_total"] == 2


def test_redrive_of_a_dead_letter_retention_unlinked_is_reported() -> None:
    from tieredbuf.format.batch import encode_batch

    buf = tieredbuf.open("memory://")
    fill(buf, 4)
    clock = Clock()
    _dead_letters(buf, clock, 4, {0})
    buf.set_retention(max_bytes=len(encode_batch([b"r3"])))  # keeps 3 only
    r = buf.redrive("jobs")
    assert r.unlinked == (0,) and r.redriven == ()


def test_I2_a_redrive_whose_cas_response_was_lost_reports_what_it_did() -> None:
    store = FaultInjectingStore(open_store("memory://"))
    buf = tieredbuf.Buffer(store)
    fill(buf, 2)
    clock = Clock()
    _dead_letters(buf, clock, 2, {0})
    key = next(m.key for m in store.list(keys.SUBSCRIBERS_PREFIX))
    fault = store.arm("put", key=key, when="after", error=OutcomeUnknownError, times=1)
    assert buf.redrive("jobs").redriven == (0,)
    assert fault.fired == 1
    got = _worker(buf, clock).claim()
    assert got is not None and got.sequence == 0


def test_redrive_needs_a_work_queue() -> None:
    buf = tieredbuf.open("memory://")
    fill(buf, 1)
    with pytest.raises(ConfigError, match="not a work queue"):
        buf.redrive("nope")
    buf.consumer(subscriber="etl").initialize()
    with pytest.raises(ConfigError, match="not a work queue"):
        buf.redrive("etl")


EXE = shutil.which("tieredbuf") or str(Path(sys.executable).with_name("tieredbuf"))


@pytest.mark.slow
def test_cli_subscribers_redrive(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/buf"
    buf = tieredbuf.open(url)
    fill(buf, 4)
    _dead_letters(buf, Clock(), 4, {0, 2})

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [EXE, "subscribers", *argv], capture_output=True, text=True, timeout=60
        )

    listing = run(url)
    assert "2 rejected (2 kept for redrive)" in listing.stdout, listing.stdout
    r = run("redrive", url, "jobs", "--sequences", "2,5-6")
    assert r.returncode == 1, r.stderr  # 5 and 6 are not dead letters
    assert r.stdout.splitlines() == [
        "redriven (claimable again): 2",
        "not a kept dead letter of this queue: 5, 6",
    ]
    r = run("redrive", url, "jobs", "--drop", "--json")
    assert r.returncode == 0 and '"dropped": [0]' in r.stdout, r.stdout
    r = run("redrive", url, "jobs", "--sequences", "x")
    assert r.returncode == 2 and "--sequences: 'x'" in r.stderr
    r = run(url, "--drop")
    assert r.returncode == 2 and "go with: tieredbuf subscribers redrive" in r.stderr


# --- the long poll of an idle claim -------------------------------------------------------


class FakeTime:
    """Monotonic time that a wait advances (no real sleep)."""

    def __init__(self) -> None:
        self.t = 1000.0

    def now(self) -> float:
        return self.t


def test_an_idle_wait_reads_the_footer_with_a_backoff_and_the_progress_every_15_s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """P2: an idle worker sends at most 0.4 requests/s: over 60 s, footer reads at
    0.1, 0.3, 0.7, 1.5, 3.1 s and then every 3 s, and a progress read every 15 s."""
    import tieredbuf.consume.claimwait as cw

    ft = FakeTime()
    reads: list[tuple[str, float]] = []

    def footer() -> Footer:
        reads.append(("footer", ft.t))
        return Footer(5, 5, 1, 1)

    def progress() -> Progress:
        reads.append(("progress", ft.t))
        return None  # type: ignore[return-value]

    monkeypatch.setattr(cw.time, "monotonic", ft.now)
    w = ClaimWait(footer, progress, lambda: int(ft.t * 1000), max_s=3.0)

    def advance(timeout: float | None = None) -> bool:
        ft.t += timeout or 0
        return False

    monkeypatch.setattr(w._stop, "wait", advance)
    assert w.wait(5, lambda: None, lambda p: False, deadline=ft.t + 60) is False
    footer_at = [round(t - 1000, 3) for k, t in reads if k == "footer"]
    progress_at = [round(t - 1000, 3) for k, t in reads if k == "progress"]
    assert footer_at[:6] == [0.1, 0.3, 0.7, 1.5, 3.1, 6.1]
    assert progress_at == [15.0, 30.0, 45.0, 60.0]
    assert len(reads) == 23 + 4 <= 0.5 * 60


def test_claim_with_a_timeout_returns_an_entry_appended_while_it_waits() -> None:
    counting = CountingStore(open_store("memory://"))
    buf = tieredbuf.Buffer(counting)
    seed(buf, 1)
    w = _worker(buf, claim_batch=1, idle_poll_max=timedelta(milliseconds=200))
    got = w.claim()
    assert got is not None
    w.ack(got.sequence)
    w.flush()
    counting.reset()
    appended = threading.Event()

    def produce() -> None:
        appended.wait(30)
        seed(buf, 1, start=1)

    t = threading.Thread(target=produce)
    t.start()
    appended.set()
    try:
        got = w.claim(timeout=30)
    finally:
        t.join()
    assert got is not None and got.sequence == 1 and got.entries == [b"r1"]
    w.ack(1)
    w.close()


def test_claim_with_a_timeout_wakes_for_a_redelivery_delay_without_polling_for_it() -> None:
    counting = CountingStore(open_store("memory://"))
    buf = tieredbuf.Buffer(counting)
    seed(buf, 1)
    w = _worker(buf, claim_batch=1, redelivery_delay=timedelta(milliseconds=300))
    got = w.claim()
    assert got is not None
    w.defer(got.sequence)
    counting.reset()
    again = w.claim(timeout=30)
    assert again is not None and again.sequence == got.sequence
    # the idle claim (footer + progress), the footer reads of the first 0.3 s, the refill
    assert counting.of("subscriber").get("get", 0) <= 2
    w.ack(again.sequence)
    w.close()


def test_wake_ends_a_claim_wait_from_another_thread() -> None:
    buf = tieredbuf.open("memory://")
    seed(buf, 1)
    w = _worker(buf, claim_batch=1)
    got = w.claim()
    assert got is not None
    w.ack(got.sequence)
    threading.Timer(0.2, w.wake).start()
    assert w.claim(timeout=600) is None  # returns on wake, not after 10 minutes
    w.close()


# --- what a work queue's acks do to other readers -------------------------------------------


def _drain_queue(buf: tieredbuf.Buffer) -> None:
    w = _worker(buf)
    for b in iter(w.claim, None):
        w.ack(b.sequence)
    w.close()


def _default_reads(buf: tieredbuf.Buffer) -> list[int]:
    from tests.subscriber_util import drain

    c = buf.consumer()
    c.initialize()
    return drain(c)


def test_I9_the_default_consumer_is_protected_from_work_queue_acks_once_it_exists() -> None:
    """docs/subscribers.md: a work queue's acks release an entry for that queue only;
    the default consumer, registered by its first initialize(), still reads them all."""
    buf = tieredbuf.open("memory://")
    fill(buf, 3)
    buf.consumer().initialize()  # it exists: registered, reading nothing yet
    _drain_queue(buf)
    assert _default_reads(buf) == [0, 1, 2]


def test_a_reader_registering_after_the_acks_starts_at_the_earliest_entry_still_held() -> None:
    """Like a new Kafka consumer group with auto.offset.reset=earliest -- except that
    without a retention policy the buffer kept only what a registered subscriber needed."""
    buf = tieredbuf.open("memory://")
    fill(buf, 3)
    _drain_queue(buf)
    assert _default_reads(buf) == []
    kept = tieredbuf.open("memory://")
    fill(kept, 3)
    kept.set_retention(max_age=timedelta(days=7))  # acked history stays until retention
    _drain_queue(kept)
    assert _default_reads(kept) == [0, 1, 2]
