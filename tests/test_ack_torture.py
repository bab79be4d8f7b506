"""I10 under torture: a promise is made only from evidence, whatever happens to the writers.

Six producer processes -- stateless and staged -- write to one buffer.  A chaos loop
SIGKILLs or closes four of them (and starts them again: a staged one on its own stage;
a closing holder hands its lease over) and SIGSTOPs them past half the GC grace period;
all six see some of their uploads held back past it (brownouts), some of their
announcements damaged, and their clocks run apart (the two the chaos spares live long
enough to see what becomes of an upload held back).  GC runs all along at a short
grace, and a consumer reads, acks and dequeues everything as it comes (so GC has
unreferenced objects to delete, and a writer may find its entry dequeued before it
looked).  Whichever process holds the commit lease commits for all of them.

The checker reads every line each process printed, and the queue's whole history: what
the consumer read (in order, each entry once, I9) and what is left at the end:

* every REMOTE-acknowledged record is in the queue exactly once, at the sequence its
  outcome named, in an entry naming the data object its outcome named;
* every entry the consumer read had its data object (GC deleted nothing linked, I5);
* no REMOTE outcome lacks a sequence;
* every record a staged producer acknowledged LOCAL is in the manifest (its stage was
  exported by the producer restarted on it, or drained at the end) -- or still staged;
* no record is in the manifest twice (I2), and each writer's records are in order (I3).

The slow suite runs it for 90 s at a 20 s grace.  By hand, longer or at the default
grace, with a seed::

    python -m tests.test_ack_torture --seed 7 --seconds 600 --grace 600
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import pytest

import tieredbuf
from tieredbuf import gc
from tieredbuf.produce.staged import stage_producer_ids

WORKER = Path(__file__).with_name("ack_torture_worker.py")


@dataclass
class Proc:
    """One incarnation of a writer process and the lines it printed."""

    name: str
    mode: str
    stage: str
    skew_ms: int
    popen: subprocess.Popen[bytes]
    all: list[str] = field(default_factory=list)
    reader: threading.Thread | None = None

    def read(self) -> None:
        assert self.popen.stdout is not None
        for raw in self.popen.stdout:
            self.all.append(raw.decode().rstrip("\n"))

    def finish(self) -> None:
        """The process has exited: every line it printed is read once this returns."""
        if self.reader is not None:
            self.reader.join(timeout=60)
            assert not self.reader.is_alive(), f"{self.name}'s output never ended"


@dataclass
class Totals:
    started: int = 0
    kills: int = 0
    closes: int = 0
    stops: int = 0
    skewed: int = 0
    brownouts: int = 0
    damaged: int = 0
    gc_passes: int = 0
    gc_deleted: int = 0
    consumed: int = 0
    local: int = 0
    remote: int = 0
    failed: int = 0
    no_sequence: int = 0
    lost: int = 0
    duplicates: int = 0
    wrong_place: int = 0
    in_manifest: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    """Writes that failed (never acknowledged), by error."""


def _start(
    url: str, name: str, mode: str, stage: str, skew_ms: int, rng: random.Random, grace_s: float
) -> Proc:
    args = [
        sys.executable,
        str(WORKER),
        url,
        name,
        mode,
        stage,
        str(skew_ms),
        str(rng.randrange(1 << 30)),
        "0.02",  # brownouts: one data upload in 50 held past half the grace period
        str(grace_s * 0.55),
        "0.1",  # one announcement in 10 damaged
    ]
    popen = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    p = Proc(name, mode, stage, skew_ms, popen)
    p.reader = threading.Thread(target=p.read, daemon=True)
    p.reader.start()
    return p


def run_torture(root: Path, seed: int, seconds: float, grace_s: float) -> Totals:
    """The torture run; returns its totals (the checker's assertions fail on a breach)."""
    rng = random.Random(seed)
    url = f"file://{root}/buf"
    buf = tieredbuf.open(url)
    buf.create()
    buf.set_gc_grace_period(timedelta(seconds=grace_s), force=True)
    t = Totals()
    max_skew = int(grace_s * 1000 * 0.25)  # inside the documented bound (0.4 of the grace)
    writers = [("d0", "direct"), ("d1", "direct"), ("s0", "staged"), ("s1", "staged")]
    calm = [("c0", "direct"), ("c1", "staged")]  # only brownouts, damage and skew: they
    # live long enough to see a held-back upload's fate (and to hold the lease a while)
    incarnation: Counter[str] = Counter()
    procs: dict[str, Proc] = {}
    done: list[Proc] = []

    def start(slot: str, mode: str) -> None:
        incarnation[slot] += 1
        name = f"{slot}.{incarnation[slot]}"
        stage = str(root / f"stage-{slot}") if mode == "staged" else "-"
        skew = rng.randint(-max_skew, max_skew) if rng.random() < 0.5 else 0
        t.skewed += int(skew != 0)
        procs[slot] = _start(url, name, mode, stage, skew, rng, grace_s)
        t.started += 1

    for slot, mode in writers + calm:
        start(slot, mode)
    gc_stop = threading.Event()

    def gc_loop() -> None:
        while not gc_stop.wait(1.0):
            try:
                report = gc.run_once(buf)
            except tieredbuf.TieredBufError:
                continue
            t.gc_passes += 1
            t.gc_deleted += len(report.deleted_keys)

    gc_thread = threading.Thread(target=gc_loop, daemon=True)
    gc_thread.start()
    history: list[tuple[int, str, list[bytes]]] = []
    read_errors: list[str] = []
    consumer = buf.consumer(dequeue_every=20)
    consumer.initialize(last_acked_sequence=None)

    def consume() -> None:
        while not gc_stop.is_set():
            try:
                b = consumer.next_batch(timeout=0.5)
                if b is None:
                    continue
                history.append((b.sequence, b.location, list(b.entries)))
                consumer.ack(b.sequence)
            except tieredbuf.TieredBufError as e:  # a missing object: GC deleted it (I5)
                read_errors.append(f"{type(e).__name__}: {e}")
                return
        consumer.flush()

    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    stopped: dict[str, float] = {}
    closing: dict[str, Proc] = {}  # slot -> a process closing (SIGTERM): replaced once gone
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            time.sleep(rng.uniform(1.0, 3.0))  # the chaos's own pace, not synchronisation
            for slot, until in list(stopped.items()):
                if time.monotonic() >= until:
                    procs[slot].popen.send_signal(signal.SIGCONT)
                    del stopped[slot]
            for slot, old in list(closing.items()):
                if old.popen.poll() is not None:  # closed: a new process takes its place
                    done.append(old)
                    del closing[slot]
                    start(slot, dict(writers)[slot])
            slot, mode = rng.choice(writers)
            if slot in stopped or slot in closing:
                continue
            event = rng.random()
            if event < 0.45:  # SIGSTOP past half the grace period
                procs[slot].popen.send_signal(signal.SIGSTOP)
                stopped[slot] = time.monotonic() + grace_s * rng.uniform(0.55, 0.7)
                t.stops += 1
            elif event < 0.75:  # SIGKILL, and a new process (a staged one on its stage)
                old = procs[slot]
                old.popen.send_signal(signal.SIGKILL)
                old.popen.wait(timeout=30)
                done.append(old)
                t.kills += 1
                start(slot, mode)
            elif event < 0.9:  # a clean close: a holder hands its lease over
                procs[slot].popen.send_signal(signal.SIGTERM)
                closing[slot] = procs[slot]
                t.closes += 1
    finally:
        for slot in list(stopped):
            procs[slot].popen.send_signal(signal.SIGCONT)
        for p in procs.values():
            p.popen.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.popen.wait(timeout=180)
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait(timeout=30)
        gc_stop.set()
        gc_thread.join(timeout=60)
        reader.join(timeout=60)
    done.extend(p for p in procs.values() if p not in done)
    for p in done:
        p.finish()
    # what a killed staged producer left is exported by a drain, as an operator would
    for slot, mode in writers + calm:
        if mode == "staged":
            d = root / f"stage-{slot}"
            for pid in stage_producer_ids(d):
                buf.drain_stage(d, pid, timeout=120)
    t.consumed = len(history)
    for e in buf.entries():
        batch = tieredbuf.ConsumedBatch(e.sequence, e.location, e.metadata, buf.read_object(e))
        history.append((e.sequence, e.location, list(batch.entries)))
    check(history, read_errors, done, t)
    return t


def check(
    history: list[tuple[int, str, list[bytes]]],
    read_errors: list[str],
    procs: list[Proc],
    t: Totals,
) -> None:
    """The checker (module doc); ``history``: every entry of the queue, in order."""
    problems = [f"I5: the consumer could not read an entry: {e}" for e in read_errors]
    seqs = [seq for seq, _, _ in history]
    if seqs and seqs != list(range(seqs[0], seqs[0] + len(seqs))):
        problems.append("I3/I9: the queue's history is not contiguous")
    where: dict[str, list[tuple[int, str]]] = {}
    for seq, loc, records in history:
        for r in records:
            where.setdefault(r.decode(), []).append((seq, loc))
    t.in_manifest = len(where)
    dups = {r: at for r, at in where.items() if len(at) > 1}
    t.duplicates = len(dups)
    problems += [f"I2: {r} is in the queue {len(at)} times: {at}" for r, at in list(dups.items())]
    local: set[str] = set()
    for p in procs:
        for line in p.all:
            kind, _, rest = line.partition(" ")
            if kind == "LOCAL":
                local.add(rest)
                t.local += 1
            elif kind == "REMOTE":
                rec, seq, loc = rest.split(" ")
                t.remote += 1
                if seq == "None":
                    t.no_sequence += 1
                    lost = rec not in where
                    t.lost += lost
                    problems.append(
                        f"I10: {rec} REMOTE with no sequence{', in no entry' if lost else ''}"
                    )
                    continue
                at = where.get(rec)
                if not at:
                    t.lost += 1
                    problems.append(f"I1/I10: {rec} REMOTE at {seq} is in no entry")
                elif at[0] != (int(seq), loc):
                    t.wrong_place += 1
                    problems.append(f"I10: {rec} REMOTE at {seq} {loc}, the manifest has {at}")
            elif kind == "FAIL":
                t.failed += 1
                why = rest.split(" ")[1]
                t.failures[why] = t.failures.get(why, 0) + 1
            elif kind == "BROWNOUT":
                t.brownouts += 1
            elif kind == "DAMAGED":
                t.damaged += 1
    for rec in sorted(local - set(where)):
        t.lost += 1
        problems.append(f"I1: {rec} LOCAL-acked by a staged producer, in no entry and no stage")
    for writer in {r.rsplit(":", 1)[0] for r in where}:
        mine = sorted(
            (at[0][0], int(r.rsplit(":", 1)[1]))
            for r, at in where.items()
            if r.rsplit(":", 1)[0] == writer
        )
        order = [i for _, i in mine]
        if order != sorted(order):
            problems.append(f"I3: {writer}'s records out of order")
    assert not problems, "\n".join(problems[:20]) + f"\n{json.dumps(t.__dict__)}"


@pytest.mark.slow
def test_I10_every_promise_holds_under_kills_stops_brownouts_damage_skew_and_gc(
    tmp_path: Path,
) -> None:
    seed = int(os.environ.get("TIEREDBUF_TORTURE_SEED", "20261128"))
    t = run_torture(tmp_path, seed, seconds=90, grace_s=20)
    print(json.dumps(t.__dict__))
    assert t.kills >= 3 and t.stops >= 1, t  # the chaos happened
    assert t.remote > 100 and t.local > 50, t  # and writes were acknowledged through it
    assert t.lost == t.duplicates == t.no_sequence == t.wrong_place == 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=int(time.time()))
    ap.add_argument("--seconds", type=float, default=300)
    ap.add_argument("--grace", type=float, default=20, help="GC grace period, seconds")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        t = run_torture(Path(d), a.seed, a.seconds, a.grace)
    print(json.dumps({"seed": a.seed, **t.__dict__}))


if __name__ == "__main__":
    main()
