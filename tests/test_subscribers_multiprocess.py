"""Many readers on one buffer, as processes on a real S3 endpoint (moto over HTTP).

* Three named subscribers at different speeds, two producer processes; one subscriber
  instance hangs (SIGSTOP) and is replaced: the new instance fences it (I4), the other
  two are unaffected; each subscriber commits every entry exactly once, in order (I9);
  GC with a zero grace period runs throughout and never deletes what a subscriber still
  needs (a fourth, idle subscriber holds the head until it is removed).
* Four worker processes on one shared subscriber, one killed with SIGKILL while holding
  leases: every entry acked exactly once, its leases redelivered, rejects listed (I9).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path

import pytest

import tieredbuf
from tieredbuf import gc

HERE = Path(__file__).parent
PROC = HERE / "subscriber_proc.py"
PRODUCER = HERE / "producer_worker.py"
DEADLINE = 240.0


class Proc:
    """A child process whose stdout lines are collected by a thread."""

    def __init__(self, *args: str) -> None:
        self.p = subprocess.Popen(
            [sys.executable, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=HERE.parent,
        )
        self.lines: list[str] = []
        self._t = threading.Thread(target=self._read, daemon=True)
        self._t.start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.lines.append(line.strip())

    def wait_for(self, pred, what: str, timeout: float = DEADLINE) -> None:  # type: ignore[no-untyped-def]
        end = time.monotonic() + timeout
        while not pred():
            if self.p.poll() is not None and not pred():
                self._t.join(5)
                if pred():
                    return
                err = self.p.stderr.read() if self.p.stderr else ""
                raise AssertionError(f"process exited ({self.p.returncode}) before {what}: {err}")
            assert time.monotonic() < end, f"timed out waiting for {what}"
            time.sleep(0.01)  # polling a condition against a deadline

    def finish(self, timeout: float = DEADLINE) -> int:
        try:
            self.p.wait(timeout=timeout)
        finally:
            if self.p.poll() is None:
                self.p.kill()
        self._t.join(10)
        return self.p.returncode

    def stderr(self) -> str:
        return self.p.stderr.read() if self.p.stderr else ""


def _lines(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def _far() -> int:
    return time.time_ns() // 1_000_000 + 10**9


@pytest.mark.s3
@pytest.mark.slow
def test_I4_I9_three_subscribers_two_producers_one_replaced_gc_throughout(
    s3_endpoint,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    url = f"s3://{s3_endpoint.new_bucket()}/buf"
    opts = s3_endpoint.options()
    o = json.dumps(opts)
    buf = tieredbuf.open(url, **opts)
    buf.create()
    stop = tmp_path / "stop"
    outs = {n: tmp_path / f"{n}.out" for n in ("a", "b", "b2", "c")}
    speeds = {"a": 0, "b": 4, "c": 10}
    subs = {
        n: Proc(str(PROC), "consume", url, o, n, str(outs[n]), str(speeds[n]), str(stop))
        for n in ("a", "b", "c")
    }
    for s in subs.values():
        s.wait_for(lambda s=s: any(x.startswith("READY") for x in s.lines), "READY")
    deleted: set[str] = set()
    end = time.monotonic() + DEADLINE

    def gc_pass(grace: timedelta) -> None:
        deleted.update(gc.run_once(buf, grace=grace).deleted_keys)

    def produce(names: tuple[str, ...]) -> None:
        """Producers append while GC runs with its normal grace period: an object uploaded
        but not yet enqueued is protected only by it (RFC 0001), so zero grace is for
        when no producer runs."""
        producers = [Proc(str(PRODUCER), url, o, name, "150") for name in names]
        while any(p.p.poll() is None for p in producers):
            assert time.monotonic() < end, "producers did not finish"
            gc_pass(timedelta(minutes=10))
            time.sleep(0.05)
        for p in producers:
            assert p.finish() == 0, p.stderr()

    def catch_up(names: tuple[str, ...], upto: int) -> None:
        """GC with a zero grace period, over and over, while subscribers catch up (the
        buffer's grace: GC honours a shorter --grace only through it; no producer runs)."""
        buf.set_gc_grace_period(timedelta(0), force=True)

        def committed(n: str) -> int:  # "b": both instances' commits
            return len(_lines(outs[n])) + (len(_lines(outs["b2"])) if n == "b" else 0)

        while any(committed(n) < upto for n in names):
            assert time.monotonic() < end, f"subscribers did not reach {upto}"
            for n in names:  # one that exited early failed (it exits only when done)
                live = "b2" if n == "b" else n
                if committed(n) < upto:
                    assert subs[live].p.poll() is None, subs[live].stderr()
            gc_pass(timedelta(0))
            time.sleep(0.05)
        gc_pass(timedelta(0))  # everyone is past them now: this pass may delete them
        buf.set_gc_grace_period(timedelta(minutes=10))

    os.kill(subs["c"].p.pid, signal.SIGSTOP)  # "c" stalls for the whole first wave
    produce(("p0", "p1"))  # wave 1
    wave1 = buf.snapshot().root.next_seq
    assert buf.snapshot().head == 0  # "c" holds every entry
    os.kill(subs["c"].p.pid, signal.SIGCONT)
    subs["b"].wait_for(lambda: len(_lines(outs["b"])) >= 10, "b to commit some entries")
    os.kill(subs["b"].p.pid, signal.SIGSTOP)  # "b" hangs mid-way ...
    subs["b2"] = Proc(
        str(PROC), "consume", url, o, "b", str(outs["b2"]), str(speeds["b"]), str(stop)
    )  # ... and is restarted: the new instance fences it
    subs["b2"].wait_for(
        lambda: any(x.startswith("READY") for x in subs["b2"].lines), "READY of the new instance"
    )
    os.kill(subs["b"].p.pid, signal.SIGCONT)  # the old instance wakes up, fenced
    catch_up(("a", "b", "c"), wave1)
    assert deleted  # zero grace did delete: what all three were past, and nothing else
    idle = buf.consumer("idle")  # registers at the tail and never reads
    idle.initialize(start="latest")
    idle_at = idle.subscription.position
    idle.close()
    produce(("p2", "p3"))  # wave 2
    total = buf.snapshot().root.next_seq
    stop.write_text(str(total))
    catch_up(("a", "b", "c"), total)
    for n in ("a", "b2", "c"):
        assert subs[n].finish() == 0, subs[n].stderr()
    assert subs["b"].finish() == 3 and any(x.startswith("FENCED") for x in subs["b"].lines)
    everything = list(range(total))
    assert _lines(outs["a"]) == everything  # I9: once each, in order
    assert _lines(outs["c"]) == everything
    old, new = _lines(outs["b"]), _lines(outs["b2"])
    assert old + new == everything and old and new  # the replaced one too, across the restart
    # the idle subscriber holds everything from where it registered: GC kept all of it
    snap = buf.snapshot()
    assert snap.head == idle_at == snap.low
    kept = [e.location for e in snap.iter_from(idle_at)]
    assert len(kept) == total - idle_at and all(buf.store.head(k) for k in kept)
    assert not deleted & set(kept)
    assert buf.remove_subscriber("idle")  # its hold is released ...
    assert buf.snapshot().head == total
    gc.run_once(buf, grace=timedelta(0), now_ms=_far())
    assert list(buf.store.list("data/")) == []  # ... and GC reclaims everything


@pytest.mark.s3
@pytest.mark.slow
def test_I9_four_workers_one_killed_while_holding_leases_every_entry_acked_once(
    s3_endpoint,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    url = f"s3://{s3_endpoint.new_bucket()}/buf"
    opts = s3_endpoint.options()
    o = json.dumps(opts)
    buf = tieredbuf.open(url, **opts)
    with buf.producer(flush_interval=timedelta(0)) as p:
        for i in range(60):  # one entry each: waited for before the next
            p.produce([b"job %d" % i]).wait(timeout=60)
    total = buf.snapshot().root.next_seq
    stop = tmp_path / "stop"
    # the victim starts alone: with three peers refilling ahead it could find every entry
    # leased before it held two (the test then waited for it until its deadline).  It
    # hangs at its second PROCESSING line, so the kill finds it holding leases; what it
    # acked before may still be applied by its refill running ahead (see below)
    victim = Proc(str(PROC), "work", url, o, "jobs", "20", str(stop), "2")
    victim.wait_for(
        lambda: sum(x.startswith("PROCESSING") for x in victim.lines) >= 2,
        "the victim to hold leases",
    )
    os.kill(victim.p.pid, signal.SIGKILL)  # mid-processing: leases held
    workers = [victim] + [
        Proc(str(PROC), "work", url, o, "jobs", "20", str(stop)) for _ in range(3)
    ]
    stop.write_text(str(total))
    assert victim.finish() == -signal.SIGKILL
    for w in workers[1:]:
        assert w.finish() == 0, w.stderr()

    def seqs(w: Proc, tag: str) -> list[int]:
        return [int(x) for ln in w.lines if ln.startswith(tag + " ") for x in ln.split()[1:]]

    applied = Counter(s for w in workers for s in seqs(w, "APPLIED"))
    told = "\n".join(f"worker {i}: {' | '.join(w.lines)}" for i, w in enumerate(workers))
    assert set(applied.values()) == {1}, told
    # the victim acked what it processed before the one it hangs on; a refill running
    # ahead on its CAS thread may have applied those acks with the kill cutting off the
    # APPLIED line.  Only those may go unseen: nobody re-claimed them (else a survivor's
    # APPLIED shows them), and the position below says they are done
    acked_by_victim = set(seqs(victim, "PROCESSING")[:-1])
    unseen = set(range(total)) - set(applied)
    assert set(applied) <= set(range(total)) and unseen <= acked_by_victim, told
    claimed_by_victim = set(seqs(victim, "CLAIMED"))
    lost_with_it = claimed_by_victim - set(seqs(victim, "APPLIED")) - unseen
    assert lost_with_it  # it died holding leases ...
    survivors = {s for w in workers[1:] for s in seqs(w, "APPLIED")}
    assert lost_with_it <= survivors  # ... which were redelivered after they lapsed
    (info,) = buf.subscribers()
    assert info.next_sequence == total and info.work is not None
    assert info.work["leased"] == 0 and info.work["done_above_position"] == 0
    assert sorted(r.seq for r in info.rejected) == [s for s in range(total) if s % 17 == 5]
