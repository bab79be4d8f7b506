"""Subscribers benchmark: shared work queues and what readers cost the producers.

Two rows, each against a same-run baseline, on a moto S3 server over HTTP
(in a child process; writes serialised, so its conditional PUTs are atomic as a real
S3 server's are -- moto 5.2.5 checks If-Match and then writes without a lock; reads
run concurrently, as they do on S3):

1. **Work queue speed-up.**  ``--entries`` entries (default 5,000), each taking
   ``--work-ms`` (20 ms, a sleep: I/O-bound work) to process.  Baseline: one named
   stream consumer reads, processes and acks them in order.  Then ``--workers`` (8)
   worker threads of one shared subscriber claim, process and ack them, once per
   ``--claim-batch`` (8, the default, and 16).  Goal: the workers drain them at least
   4x faster than the consumer.
2. **Append rate with subscribers.**  ``--producers`` (4) producer processes append
   one entry per awaited call for ``--seconds``, unpaced (``--writes-per-s 0``: the
   library's default group commit at 5 appends/s per buffer would cap the row's rate
   whatever the readers do); baseline: no subscriber at all; then
   ``--subscribers`` (4) named subscriber processes read and ack every entry as it
   arrives, waiting at the tail as a real user would: ``next_batch(timeout=--wait-s)``,
   the long poll on the root's 22-byte footer (``tieredbuf.queue.longpoll``).  Goal: the
   append rate drops by at most 10 %.  Control, same run: 4 plain readers
   (``buf.reader()`` + the data GETs, no acks, no progress objects) waiting at the tail
   with the same footer long poll -- what reading alone costs the producers on this
   machine.  ``--spin-ms N`` brings back the earlier loop (both kinds re-poll every N ms
   when caught up: ~100 GETs/s per reader at 10 ms).  After the producers stop, every
   subscriber and reader reads on to the tail: each must have seen every appended entry,
   once, in order (the script fails otherwise), and the lag of each entry (its ack time
   minus its ingestion time) is reported.  The subscribers' root writes (publications) are
   counted: their acks and positions go to their own progress objects, not the root.

Each row runs once per ``--round-trips`` column: ``loopback`` (moto as is, 1-3 ms a
request) and ``20/40`` (``tests/latency_proxy.py`` in front of it adds 20 ms to every GET
and HEAD and 40 ms to every PUT, POST and DELETE: S3's round trips), so that no path is
tuned only for loopback.

Usage::

    flock /tmp/tieredbuf-bench.lock .venv/bin/python bench/subscribers.py
    ... bench/subscribers.py --quick          # 800 entries, 8 s rows
    ... bench/subscribers.py --rows append --repeat 3
    ... bench/subscribers.py --round-trips 20/40  # only the S3 column

Results: a table on stdout and ``bench/results/subscribers.json`` (with the load average).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

from _common import S3Endpoint, print_table, serial_moto, summarize, write_json

import tieredbuf
from tests.latency_proxy import LatencyProxy
from tieredbuf.consume.consumer import IDLE_POLL_MAX_S
from tieredbuf.format.batch import encode_batch
from tieredbuf.format.manifest import MetadataItem, NewEntry
from tieredbuf.keys import data_key
from tieredbuf.queue.longpoll import FooterPoll


def seed(buf: tieredbuf.Buffer, n: int) -> None:
    """``n`` entries of one small object each: objects PUT in parallel, appended 250 a CAS."""

    def put(i: int) -> NewEntry:
        key = data_key(__import__("ulid").ULID())
        body = encode_batch([b"job %d" % i])
        buf.store.put(key, body, mode="create")
        return NewEntry(key, (MetadataItem(0, time.time_ns() // 10**6, b""),), len(body))

    with ThreadPoolExecutor(16) as pool:
        entries = list(pool.map(put, range(n)))
    for i in range(0, n, 250):
        chunk = entries[i : i + 250]
        buf.queue.append(chunk, "seed", i + len(chunk))


# --- row 1: work queue ------------------------------------------------------------------


def row_workers(
    ep: S3Endpoint, entries: int, work_ms: int, workers: int, batches: list[int]
) -> list[dict[str, Any]]:
    buf = tieredbuf.open(f"s3://{ep.new_bucket('sub')}/buf", **ep.options())
    buf.create()
    single = buf.consumer("single")
    single.initialize()
    for cb in batches:  # registered before the entries exist: each sees all of them
        jobs = buf.worker(f"jobs{cb}", claim_batch=cb, lease=timedelta(seconds=60))
        jobs.initialize()
        jobs.close()
    seed(buf, entries)
    work = work_ms / 1000

    t0 = time.perf_counter()
    n = 0
    while n < entries:
        b = single.next_batch()
        if b is None:
            raise RuntimeError("the consumer ran dry before the end")
        time.sleep(work)
        single.ack(b.sequence)
        n += 1
    single.flush()
    t_single = time.perf_counter() - t0
    single.close()
    return [_drain_with_workers(buf, entries, work, workers, cb, t_single) for cb in batches]


def _drain_with_workers(
    buf: tieredbuf.Buffer, entries: int, work: float, workers: int, cb: int, t_single: float
) -> dict[str, Any]:
    counts = [0] * workers
    errors: list[BaseException] = []
    stats: list[dict[str, int]] = []

    def run(i: int) -> None:
        try:
            w = buf.worker(f"jobs{cb}", claim_batch=cb, lease=timedelta(seconds=60))
            while True:
                b = w.claim()  # a refill also applies this worker's buffered acks
                if b is None:
                    if w.subscription.reload().position >= entries:
                        break
                    time.sleep(0.01)  # the rest is leased to others
                    continue
                time.sleep(work)
                w.ack(b.sequence)
                counts[i] += 1
            w.close()
            stats.append(w.stats.snapshot())
        except BaseException as e:
            errors.append(e)

    t0 = time.perf_counter()
    ts = [threading.Thread(target=run, args=(i,)) for i in range(workers)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    t_workers = time.perf_counter() - t0
    if errors:
        raise errors[0]
    assert sum(counts) == entries, counts
    return {
        "entries": entries,
        "work_ms": round(work * 1000),
        "workers": workers,
        "claim_batch": cb,
        "single_consumer_s": round(t_single, 2),
        "workers_s": round(t_workers, 2),
        "single_rate": round(entries / t_single, 1),
        "workers_rate": round(entries / t_workers, 1),
        "speedup": round(t_single / t_workers, 2),
        "per_worker": counts,
        "progress_cas": sum(x.get("cas", 0) for x in stats),
    }


# --- row 2: append rate -----------------------------------------------------------------


def child_producer(
    url: str, opts: dict[str, Any], seconds: float, start_at: float, writes_per_s: float
) -> None:
    buf = tieredbuf.open(url, **opts)
    p = buf.producer(flush_interval=timedelta(0), manifest_writes_per_s=writes_per_s)
    while time.time() < start_at:
        time.sleep(0.005)  # all producers start together
    n = 0
    end = start_at + seconds
    while time.time() < end:
        p.produce([b"x" * 100]).wait(timeout=60)
        n += 1
    last_done = time.time()
    elapsed = last_done - start_at
    p.close()
    print(
        json.dumps(
            {"appends": n, "elapsed": elapsed, "last_done": last_done, **buf.queue.stats.snapshot()}
        ),
        flush=True,
    )


WRITES_PER_S = [0.0]
"""The producers' ``manifest_writes_per_s`` (``--writes-per-s``; set by main)."""

DRAIN_LIMIT_S = 120.0
"""How long a subscriber or reader may take, after the producers stopped, to reach the tail."""


class _Tally:
    """What one subscriber or reader saw: every sequence once, in order, and each lag."""

    def __init__(self, buf: tieredbuf.Buffer, stop: str) -> None:
        self.buf, self.stop = buf, Path(stop)
        self.next_seq = 0
        self.lags_ms: list[int] = []
        self.last_t = 0.0
        self.target: int | None = None
        self.stop_seen = 0.0
        self.behind_at_stop = 0
        self.t0 = time.time()
        self.requests_at_stop: dict[str, Any] = {}

    def done(self) -> bool:
        """True once the producers stopped and everything they appended was seen."""
        if self.target is None and self.stop.exists():
            self.target = int(json.loads(self.stop.read_text())["tail"])
            self.stop_seen = time.time()
            self.behind_at_stop = self.target - self.next_seq
            self.requests_at_stop = self.buf.requests.as_dict()
        if self.target is None:
            return False
        if self.next_seq > self.target:
            raise RuntimeError(f"read sequence {self.next_seq - 1} past the tail {self.target}")
        if self.next_seq == self.target:
            return True
        if time.time() > self.stop_seen + DRAIN_LIMIT_S:
            raise RuntimeError(
                f"still at {self.next_seq} of {self.target} "
                f"{DRAIN_LIMIT_S:.0f} s after the producers stopped"
            )
        return False

    def saw(self, sequence: int, metadata: Any) -> None:
        if sequence != self.next_seq:  # a gap or a repeat: the row is void
            raise RuntimeError(f"expected sequence {self.next_seq}, got {sequence}")
        self.next_seq += 1
        self.last_t = time.time()
        self.lags_ms.append(int(self.last_t * 1000) - metadata[0].ingestion_time_ms)

    def report(self, **extra: Any) -> None:
        window = max(1e-9, self.stop_seen - self.t0)
        print(
            json.dumps(
                {
                    "seen": self.next_seq,
                    "last_t": self.last_t,
                    "behind_at_stop": self.behind_at_stop,
                    "lag_ms": summarize(self.lags_ms),
                    "requests_until_stop": self.requests_at_stop.get("total", 0),
                    "requests_per_s_until_stop": round(
                        self.requests_at_stop.get("total", 0) / window, 1
                    ),
                    "requests_until_stop_by": self.requests_at_stop.get("requests", {}),
                    **self.buf.queue.stats.snapshot(),
                    **extra,
                }
            ),
            flush=True,
        )


def child_subscriber(
    url: str, opts: dict[str, Any], name: str, stop: str, wait_s: float, spin_ms: int
) -> None:
    buf = tieredbuf.open(url, **opts)
    c = buf.consumer(name)
    c.initialize()
    tally = _Tally(buf, stop)
    print("READY", flush=True)
    while not tally.done():
        if spin_ms:  # the earlier loop: one check, then a fixed pause when caught up
            b = c.next_batch()
            if b is None:
                time.sleep(spin_ms / 1000)
                continue
        else:  # what a user writes: the long poll waits at the tail
            b = c.next_batch(timeout=wait_s)
            if b is None:
                continue
        tally.saw(b.sequence, b.metadata)
        c.ack(b.sequence)
    c.close()
    tally.report(
        acked=c.stats.snapshot().get("acks", 0),
        last_acked=c.last_acked_sequence,
        **{f"consumer_{k}": v for k, v in c.stats.snapshot().items()},
    )


def child_reader(url: str, opts: dict[str, Any], stop: str, wait_s: float, spin_ms: int) -> None:
    """The control: reads every entry and its data like a subscriber, acks nothing."""
    buf = tieredbuf.open(url, **opts)
    r = buf.reader()
    # the same footer long poll (and backoff) as Consumer.next_batch(timeout=...)
    waiter = FooterPoll(buf.queue.read_footer, max_s=IDLE_POLL_MAX_S)
    tally = _Tally(buf, stop)
    print("READY", flush=True)
    with ThreadPoolExecutor(8) as pool:
        while not tally.done():
            got = r.poll(max_entries=8)
            if not got:
                if spin_ms:
                    time.sleep(spin_ms / 1000)
                else:
                    waiter.wait(r.next_sequence, wait_s)
                continue
            waiter.reset()
            list(pool.map(buf.read_object, got))
            for e in got:
                tally.saw(e.sequence, e.metadata)
    tally.report(footer_reads=waiter.footer_reads)


def _child(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, __file__, "--child", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _producers(ep: S3Endpoint, url: str, n: int, seconds: float) -> tuple[float, list[Any]]:
    start_at = time.time() + 2.0
    procs = [
        _child(
            "producer",
            url,
            json.dumps(ep.options()),
            str(seconds),
            str(start_at),
            str(WRITES_PER_S[0]),
        )
        for _ in range(n)
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=seconds + 120)
        if p.returncode != 0:
            raise RuntimeError(err)
        outs.append(json.loads(out.strip().splitlines()[-1]))
    appends = sum(o["appends"] for o in outs)
    return appends / max(o["elapsed"] for o in outs), outs


def _with_readers(
    ep: S3Endpoint,
    kind: str,
    n: int,
    producers: int,
    seconds: float,
    tmp: Path,
    wait_s: float,
    spin_ms: int,
) -> tuple[float, list[Any], list[Any], dict[str, Any]]:
    url = f"s3://{ep.new_bucket('app')}/buf"
    buf = tieredbuf.open(url, **ep.options())
    buf.create()
    stop = tmp / f"stop-{time.monotonic_ns()}"
    o = json.dumps(ep.options())
    readers = [
        _child("subscriber", url, o, f"s{i}", str(stop), str(wait_s), str(spin_ms))
        if kind == "subscriber"
        else _child("reader", url, o, str(stop), str(wait_s), str(spin_ms))
        for i in range(n)
    ]
    for r in readers:
        assert r.stdout is not None
        line = r.stdout.readline()
        if not line.startswith("READY"):
            raise RuntimeError(r.stderr.read() if r.stderr else line)
    rate, out = _producers(ep, url, producers, seconds)
    tail = buf.queue.read().root.next_seq
    appended = sum(x["appends"] for x in out)
    if tail != appended:  # I2: every awaited append landed once
        raise RuntimeError(f"the tail is {tail} after {appended} awaited appends")
    last_done = max(x["last_done"] for x in out)
    tmp_stop = stop.with_suffix(".tmp")
    tmp_stop.write_text(json.dumps({"tail": tail}))
    tmp_stop.rename(stop)  # readers see the whole file or none
    r_out = []
    for r in readers:
        got, err = r.communicate(timeout=DRAIN_LIMIT_S + 60)
        if r.returncode != 0:
            raise RuntimeError(err)
        r_out.append(json.loads(got.strip().splitlines()[-1]))
    lags = [x["lag_ms"] for x in r_out]
    summary = {
        "appended": appended,
        "seen": [x["seen"] for x in r_out],
        "behind_at_stop": [x["behind_at_stop"] for x in r_out],
        "end_lag_s": [round(x["last_t"] - last_done, 3) for x in r_out],
        "lag_ms_p50": [round(x["p50"]) for x in lags],
        "lag_ms_p99": [round(x["p99"]) for x in lags],
        "lag_ms_max": [round(x["max"]) for x in lags],
        "requests_per_s": [x["requests_per_s_until_stop"] for x in r_out],
    }
    return rate, out, r_out, summary


def row_append(
    ep: S3Endpoint,
    producers: int,
    subscribers: int,
    seconds: float,
    tmp: Path,
    wait_s: float,
    spin_ms: int,
) -> dict[str, Any]:
    url0 = f"s3://{ep.new_bucket('app')}/buf"
    tieredbuf.open(url0, **ep.options()).create()
    base_rate, base_out = _producers(ep, url0, producers, seconds)
    rate, out, sub_out, sub_sum = _with_readers(
        ep, "subscriber", subscribers, producers, seconds, tmp, wait_s, spin_ms
    )
    ctl_rate, _, ctl_out, ctl_sum = _with_readers(
        ep, "reader", subscribers, producers, seconds, tmp, wait_s, spin_ms
    )
    if any(x["acked"] != x["seen"] or x["last_acked"] != sub_sum["appended"] - 1 for x in sub_out):
        raise RuntimeError(f"a subscriber did not ack every entry: {sub_out}")
    return {
        "producers": producers,
        "subscribers": subscribers,
        "seconds": seconds,
        "manifest_writes_per_s": WRITES_PER_S[0],
        "loop": f"spin {spin_ms} ms" if spin_ms else f"next_batch(timeout={wait_s})",
        "appends_per_s_no_subscribers": round(base_rate, 1),
        "appends_per_s_with_subscribers": round(rate, 1),
        "appends_per_s_with_plain_readers": round(ctl_rate, 1),
        "ratio": round(rate / base_rate, 3),
        "ratio_plain_readers": round(ctl_rate / base_rate, 3),
        "ratio_subscribers_to_plain_readers": round(rate / ctl_rate, 3),
        "conflicts_no_subscribers": sum(o.get("conflicts", 0) for o in base_out),
        "conflicts_with_subscribers": sum(o.get("conflicts", 0) for o in out),
        "appends_with_subscribers": sub_sum["appended"],
        "subscriber_reads": sub_sum,
        "acked_per_subscriber": [o["acked"] for o in sub_out],
        "plain_readers": ctl_sum,
        "subscriber_root_writes": sum(
            o.get("publications", 0) + o.get("registrations", 0) for o in sub_out
        ),
        "subscriber_progress_writes": sum(o.get("progress_writes", 0) for o in sub_out),
        "subscriber_requests_until_stop": [o["requests_until_stop_by"] for o in sub_out],
        "plain_reader_requests_until_stop": [o["requests_until_stop_by"] for o in ctl_out],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rows", default="workers,append")
    ap.add_argument("--entries", type=int, default=5000)
    ap.add_argument("--work-ms", type=int, default=20)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--claim-batch", default="8,16", help="one worker run per value")
    ap.add_argument("--producers", type=int, default=4)
    ap.add_argument("--subscribers", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument(
        "--wait-s",
        type=float,
        default=1.0,
        help="the long poll's timeout: next_batch(timeout=...) at the tail",
    )
    ap.add_argument(
        "--spin-ms",
        type=int,
        default=0,
        help="instead of the long poll, re-poll every N ms when caught up "
        "(the earlier loop; 0: long poll)",
    )
    ap.add_argument(
        "--writes-per-s",
        type=float,
        default=0.0,
        help="the producers' manifest_writes_per_s; 0 (default): no pacing, "
        "so the row measures what readers cost the store (paced at the "
        "library's 5/s, four producers together append ~5/s, whoever reads)",
    )
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument(
        "--round-trips",
        default="loopback,20/40",
        help="one column per value: loopback (moto as is), or GET/PUT ms added "
        "by tests/latency_proxy.py in front of it (20/40: S3's)",
    )
    args = ap.parse_args()
    if args.child:
        kind, *rest = args.child
        if kind == "producer":
            child_producer(
                rest[0], json.loads(rest[1]), float(rest[2]), float(rest[3]), float(rest[4])
            )
        elif kind == "subscriber":
            child_subscriber(
                rest[0], json.loads(rest[1]), rest[2], rest[3], float(rest[4]), int(rest[5])
            )
        else:
            child_reader(rest[0], json.loads(rest[1]), rest[2], float(rest[3]), int(rest[4]))
        return
    WRITES_PER_S[0] = args.writes_per_s
    if args.quick:
        args.entries, args.seconds = 800, 8.0
    rows = set(args.rows.split(","))
    results: dict[str, Any] = {"load_before": os.getloadavg(), "workers": [], "append": []}
    tmp = Path(tempfile.mkdtemp(prefix="tb-bench-subscribers-"))
    with ExitStack() as stack:
        moto = stack.enter_context(serial_moto())
        columns: list[tuple[str, S3Endpoint]] = []
        for rt in args.round_trips.split(","):
            if rt == "loopback":
                columns.append(("loopback", moto))
            else:  # "20/40": GET and HEAD / PUT, POST and DELETE, in ms
                get_ms, put_ms = (float(x) / 1000 for x in rt.split("/"))
                proxy = stack.enter_context(
                    LatencyProxy(
                        moto.endpoint,
                        {
                            "GET": get_ms,
                            "HEAD": get_ms,
                            "PUT": put_ms,
                            "POST": put_ms,
                            "DELETE": put_ms,
                        },
                    )
                )
                columns.append((f"{rt} ms", dataclasses.replace(moto, endpoint=proxy.endpoint)))
        for label, ep in columns:
            if "workers" in rows:
                batches = [int(x) for x in args.claim_batch.split(",")]
                runs = [
                    dict(r, round_trips=label)
                    for _ in range(args.repeat)
                    for r in row_workers(ep, args.entries, args.work_ms, args.workers, batches)
                ]
                results["workers"] += runs
            if "append" in rows:
                runs = [
                    dict(
                        row_append(
                            ep,
                            args.producers,
                            args.subscribers,
                            args.seconds,
                            tmp,
                            args.wait_s,
                            args.spin_ms,
                        ),
                        round_trips=label,
                    )
                    for _ in range(args.repeat)
                ]
                results["append"] += runs
    if results["workers"]:
        print_table(
            [
                "round trips",
                "entries",
                "work",
                "claim_batch",
                "1 consumer s",
                f"{args.workers} workers s",
                "speed-up (goal >= 4)",
                "progress CASes",
            ],
            [
                [
                    r["round_trips"],
                    r["entries"],
                    f"{r['work_ms']} ms",
                    r["claim_batch"],
                    r["single_consumer_s"],
                    r["workers_s"],
                    r["speedup"],
                    r["progress_cas"],
                ]
                for r in results["workers"]
            ],
        )
    if results["append"]:
        runs = results["append"]
        results["append_median_ratio"] = {
            label: statistics.median(r["ratio"] for r in runs if r["round_trips"] == label)
            for label in {r["round_trips"] for r in runs}
        }
        print_table(
            [
                "round trips",
                "producers",
                "appends/s: alone",
                f"with {args.subscribers} subscribers",
                "ratio (goal >= 0.9)",
                f"with {args.subscribers} plain readers",
                "ratio",
                "subscriber root writes",
                "appends",
                "acked per subscriber",
                "lag p50/p99 ms",
                "end lag s",
                "req/s per subscriber",
            ],
            [
                [
                    r["round_trips"],
                    r["producers"],
                    r["appends_per_s_no_subscribers"],
                    r["appends_per_s_with_subscribers"],
                    r["ratio"],
                    r["appends_per_s_with_plain_readers"],
                    r["ratio_plain_readers"],
                    r["subscriber_root_writes"],
                    r["appends_with_subscribers"],
                    r["acked_per_subscriber"],
                    f"{max(r['subscriber_reads']['lag_ms_p50'])}/"
                    f"{max(r['subscriber_reads']['lag_ms_p99'])}",
                    max(r["subscriber_reads"]["end_lag_s"]),
                    r["subscriber_reads"]["requests_per_s"],
                ]
                for r in runs
            ],
        )
        print(
            "plain readers: seen",
            [r["plain_readers"]["seen"] for r in runs],
            "req/s each",
            [r["plain_readers"]["requests_per_s"] for r in runs],
        )
    results["load_after"] = os.getloadavg()
    print(f"load average before {results['load_before']}, after {results['load_after']}")
    print("written to", write_json("subscribers", results))


if __name__ == "__main__":
    main()
