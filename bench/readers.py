"""Readers benchmark: do consumers, subscribers and workers keep up at S3's round trips?

Every request goes through ``tests/latency_proxy.py`` in front of a moto S3 server (in a
child process, writes serialised so its conditional PUTs are atomic, as S3's are): by
default 20 ms are added to every GET and HEAD, 40 ms to every PUT, POST and DELETE
(``--get-ms`` / ``--put-ms``; 0 / 0 is loopback).  Each reader runs in a child process,
once on the code of ``--baseline-tree DIR`` (``PYTHONPATH=DIR``: a ``git archive`` of the
commit this work started from) and once on this tree: a same-run baseline.  The buffers
are filled directly against moto (no delay), so only the reading goes through the proxy.

Rows:

1. **backlog**: ``--entries`` (2,000) one-record entries, drained by the default
   consumer (``buf.consumer()``, acking every entry), by a named subscriber
   (``buf.consumer("etl")``), and by ``--workers`` (8) worker threads of one shared work
   queue (``buf.worker("jobs")``, acking every entry).  Each on a fresh buffer.  Goals:
   each >= 150 entries/s at <= 1.2 requests per entry; the named subscriber >= 0.8 of the
   default consumer.  Requests are the reader's own (its buffer's request counter, from
   the first ``next_batch``/``claim`` to the final flush/close); the proxy's count of
   the same window is printed beside them.  A reader still running after ``--time-cap``
   seconds stops there (the baseline's slow readers): its rate is then over what it read.
   Each run checks that every entry was read once (workers: acked exactly once), the
   consumers in order.
2. **large**: ``--large`` (16) entries of ``--large-mib`` (32 MiB) each, drained by one
   default consumer (the time to read them; its final dequeue is timed apart); against 4
   parallel raw GETs (``store.get`` on 4 threads) of the same objects, in the same child,
   ``--large-rounds`` (3) times alternating (the objects appended again for each
   consumer).  Median MB/s of each.
3. **live**: ``--producers`` (16) direct producers (``flush_interval`` 100 ms, the
   library's default pacing), one process each, each producing a 100-byte record every
   10 ms for ``--live-seconds`` (60; ``--smoke``: 5), and one default consumer waiting at
   the tail with ``next_batch(timeout=1)`` and acking every entry.  A sampler reads the
   root's footer directly every 50 ms.  Reported: the consumer's lag in entries (the
   footer's tail minus the entries the consumer had returned, at each sample) and in
   seconds (the time an entry was returned minus the first sample that showed it
   appended), p50/p99/max, and the max lag in the first and the second half of the run
   (bounded: the second half is not behind the first by more than it fell behind then).

Usage::

    git archive $(git merge-base HEAD main) | (mkdir -p /tmp/tb-base && tar -x -C /tmp/tb-base)
    flock /tmp/tieredbuf-bench.lock .venv/bin/python bench/readers.py --baseline-tree /tmp/tb-base
    .venv/bin/python bench/readers.py --smoke          # a few seconds per row, this tree only
    .venv/bin/python bench/readers.py --rows backlog --kinds default,named

Results: a table on stdout and ``bench/results/readers.json`` (``readers-smoke.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import S3Endpoint, percentile, print_table, serial_moto, summarize, write_json

ROOT = Path(__file__).resolve().parent.parent

GOAL_RATE = 150.0
GOAL_REQUESTS = 1.2
GOAL_NAMED_RATIO = 0.8
KINDS = ("default", "named", "workers")


# --- filling a buffer (directly against moto, this tree's code) ------------------------------


def _fill(url: str, opts: dict[str, Any], n: int, size: int) -> None:
    """``n`` entries of one record each (``job <i>``, or ``size`` random bytes), appended
    250 to a CAS, their objects PUT 16 at a time."""
    import ulid

    import tieredbuf
    from tieredbuf.format.batch import encode_batch
    from tieredbuf.format.manifest import MetadataItem, NewEntry
    from tieredbuf.keys import data_key

    buf = tieredbuf.open(url, **opts)
    buf.create()

    def put(i: int) -> NewEntry:
        key = data_key(ulid.ULID())
        body = encode_batch([os.urandom(size) if size else b"job %d" % i])
        buf.store.put(key, body, mode="create")
        return NewEntry(key, (MetadataItem(0, time.time_ns() // 10**6, b""),), len(body))

    with ThreadPoolExecutor(4 if size else 16) as pool:
        entries = list(pool.map(put, range(n)))
    for i in range(0, n, 250):
        chunk = entries[i : i + 250]
        buf.queue.append(chunk, "fill", i + len(chunk))
    buf.close()


# --- children: one reader on one code tree ----------------------------------------------------


def _requests(buf: Any) -> dict[str, Any]:
    return dict(buf.requests.as_dict())


def _minus(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    by = {k: v - before["by_kind"].get(k, 0) for k, v in after["by_kind"].items()}
    ops = {k: v - before["by_op"].get(k, 0) for k, v in after["by_op"].items()}
    nested = {
        op: {k: n - before["requests"].get(op, {}).get(k, 0) for k, n in kinds.items()}
        for op, kinds in after["requests"].items()
    }
    return {
        "total": after["total"] - before["total"],
        "by_kind": {k: v for k, v in by.items() if v},
        "by_op": {k: v for k, v in ops.items() if v},
        "requests": {op: {k: n for k, n in kinds.items() if n} for op, kinds in nested.items()},
    }


def child_backlog(
    url: str, opts: dict[str, Any], kind: str, n: int, workers: int, cap_s: float
) -> dict[str, Any]:
    import tieredbuf

    buf = tieredbuf.open(url, **opts)
    seen: list[int] = []
    worker_stats: dict[str, int] = {}
    if kind == "workers":
        first = buf.worker("jobs")
        first.initialize()
        first.close()
        lock = threading.Lock()
        errors: list[BaseException] = []
        stop_at = [0.0]

        def run() -> None:
            try:
                w = buf.worker("jobs")
                while time.perf_counter() < stop_at[0]:
                    b = w.claim()
                    if b is None:
                        break
                    if b.entries != [b"job %d" % b.sequence]:
                        raise RuntimeError(f"entry {b.sequence} holds {b.entries!r}")
                    w.ack(b.sequence)
                    with lock:
                        seen.append(b.sequence)
                w.close()
                with lock:
                    for k, v in w.stats.snapshot().items():
                        worker_stats[k] = worker_stats.get(k, 0) + v
            except BaseException as e:
                errors.append(e)

        before = _requests(buf)
        t0 = time.perf_counter()
        stop_at[0] = t0 + cap_s
        ts = [threading.Thread(target=run) for _ in range(workers)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        elapsed = time.perf_counter() - t0
        if errors:
            raise errors[0]
        if len(set(seen)) != len(seen):
            raise RuntimeError("an entry was acked twice")
    else:
        c = buf.consumer() if kind == "default" else buf.consumer("etl")
        c.initialize()
        before = _requests(buf)
        t0 = time.perf_counter()
        while len(seen) < n and time.perf_counter() - t0 < cap_s:
            b = c.next_batch()
            if b is None:
                raise RuntimeError(f"ran dry after {len(seen)} of {n}")
            if b.sequence != len(seen) or b.entries != [b"job %d" % b.sequence]:
                raise RuntimeError(f"expected entry {len(seen)}, got {b.sequence} {b.entries}")
            c.ack(b.sequence)
            seen.append(b.sequence)
        c.flush()
        c.close()
        elapsed = time.perf_counter() - t0
    complete = sorted(seen) == list(range(n))
    if not complete and elapsed < cap_s:
        raise RuntimeError(f"read {len(seen)} of {n} entries")
    req = _minus(_requests(buf), before)
    return {
        "kind": kind,
        "entries": n,
        "read": len(seen),
        "complete": complete,
        "seconds": round(elapsed, 3),
        "rate": round(len(seen) / elapsed, 1),
        "requests": req,
        "requests_per_entry": round(req["total"] / max(1, len(seen)), 3),
        "queue_stats": buf.queue.stats.snapshot(),
        "worker_stats": worker_stats,
        "tieredbuf": tieredbuf.__file__,
    }


def child_large(
    url: str, opts: dict[str, Any], n: int, rounds: int, cap_s: float
) -> dict[str, Any]:
    """``rounds`` times: 4 parallel raw GETs of every object, then a fresh default consumer
    drains them (the same objects are appended again before each later round).  The
    medians are compared: the machine is shared, and the two alternate."""
    import statistics

    import tieredbuf
    from tieredbuf.format.manifest import NewEntry

    buf = tieredbuf.open(url, **opts)
    sized = buf.snapshot().sized_entries()
    locations = [e.location for e, _ in sized]
    raw: list[float] = []
    cons: list[float] = []
    flush_s: list[float] = []
    requests: list[int] = []
    for r in range(rounds):
        if r:
            again = [NewEntry(e.location, e.metadata, size) for e, size in sized]
            buf.queue.append(again, f"again-{r}", len(again))
        t0 = time.perf_counter()
        with ThreadPoolExecutor(4) as pool:
            got = sum(pool.map(lambda k: len(buf.store.get(k).data), locations))
        raw.append(got / (time.perf_counter() - t0))
        c = buf.consumer()
        c.initialize()
        before = _requests(buf)
        t0 = time.perf_counter()
        got = count = 0
        while count < n and time.perf_counter() - t0 < cap_s:
            b = c.next_batch()
            if b is None:
                raise RuntimeError(f"ran dry after {count} of {n}")
            got += len(b.data)
            count += 1
            c.ack(b.sequence)
        cons.append(got / (time.perf_counter() - t0))  # reading; the dequeue timed apart
        t1 = time.perf_counter()
        c.flush()
        flush_s.append(time.perf_counter() - t1)
        c.close()
        requests.append(_minus(_requests(buf), before)["total"])
    raw_mb, cons_mb = statistics.median(raw) / 1e6, statistics.median(cons) / 1e6
    return {
        "entries": n,
        "read": count,
        "rounds": rounds,
        "raw_mb_s_rounds": [round(x / 1e6, 1) for x in raw],
        "consumer_mb_s_rounds": [round(x / 1e6, 1) for x in cons],
        "raw_mb_s": round(raw_mb, 1),
        "consumer_mb_s": round(cons_mb, 1),
        "ratio": round(cons_mb / raw_mb, 3),
        "final_flush_s": [round(x, 3) for x in flush_s],
        "requests": {"total": statistics.median(requests), "rounds": requests},
        "tieredbuf": tieredbuf.__file__,
    }


def child_producer(url: str, opts: dict[str, Any], start_at: float, seconds: float) -> None:
    from datetime import timedelta

    import tieredbuf

    buf = tieredbuf.open(url, **opts)
    p = buf.producer(flush_interval=timedelta(milliseconds=100))
    print("READY", flush=True)
    while time.time() < start_at:
        time.sleep(0.005)
    n = 0
    end = start_at + seconds
    next_t = start_at
    while time.time() < end:
        p.produce([b"x" * 100])
        n += 1
        next_t += 0.01
        time.sleep(max(0.0, next_t - time.time()))  # one record every 10 ms
    p.close()
    print(json.dumps({"records": n, **buf.queue.stats.snapshot()}), flush=True)


def child_live(url: str, opts: dict[str, Any], stop: str, out: str) -> None:
    import tieredbuf

    buf = tieredbuf.open(url, **opts)
    c = buf.consumer()
    c.initialize()
    reads: list[tuple[float, int]] = []
    stop_path = Path(stop)
    target: int | None = None
    print("READY", flush=True)
    before = _requests(buf)
    while target is None or len(reads) < target:
        if target is None and stop_path.exists():
            target = int(stop_path.read_text())
        b = c.next_batch(timeout=1)
        if b is None:
            continue
        if b.sequence != len(reads):
            raise RuntimeError(f"expected entry {len(reads)}, got {b.sequence}")
        reads.append((time.time(), b.sequence))
        c.ack(b.sequence)
    c.flush()
    c.close()
    Path(out).write_text(json.dumps(reads))
    print(
        json.dumps(
            {
                "read": len(reads),
                "requests": _minus(_requests(buf), before),
                "tieredbuf": tieredbuf.__file__,
            }
        ),
        flush=True,
    )


# --- the parent ---------------------------------------------------------------------------------


def _child(tree: str | None, *args: str) -> subprocess.Popen[str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if tree:
        env["PYTHONPATH"] = tree  # the baseline's tieredbuf, before the installed one
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--child", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tempfile.gettempdir(),
    )


def _result(p: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    out, err = p.communicate(timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"child failed ({p.returncode}):\n{err[-4000:]}")
    return dict(json.loads(out.strip().splitlines()[-1]))


def _proxy_opts(proxy_endpoint: str, ep: S3Endpoint) -> dict[str, Any]:
    return {**ep.options(), "endpoint": proxy_endpoint, "allow_http": True}


def row_backlog(
    ep: S3Endpoint, proxy: Any, code: str, tree: str | None, kind: str, args: argparse.Namespace
) -> dict[str, Any]:
    url = f"s3://{ep.new_bucket('rd')}/backlog"
    _fill(url, ep.options(), args.entries, 0)
    before = sum(proxy.counts[m] for m in ("GET", "HEAD", "PUT", "POST", "DELETE"))
    p = _child(
        tree,
        "backlog",
        url,
        json.dumps(_proxy_opts(proxy.endpoint, ep)),
        kind,
        str(args.entries),
        str(args.workers),
        str(args.time_cap),
    )
    r = _result(p, args.time_cap + 300)
    after = sum(proxy.counts[m] for m in ("GET", "HEAD", "PUT", "POST", "DELETE"))
    r["proxy_requests_incl_setup"] = after - before
    r["code"] = code
    return r


def row_large(
    ep: S3Endpoint, proxy: Any, code: str, tree: str | None, args: argparse.Namespace
) -> dict[str, Any]:
    url = f"s3://{ep.new_bucket('rd')}/large"
    _fill(url, ep.options(), args.large, args.large_mib << 20)
    p = _child(
        tree,
        "large",
        url,
        json.dumps(_proxy_opts(proxy.endpoint, ep)),
        str(args.large),
        str(args.large_rounds),
        str(args.time_cap),
    )
    r = _result(p, args.time_cap + 600)
    r["code"] = code
    return r


def _sample_footer(
    url: str, ep: S3Endpoint, stop: threading.Event, samples: list[tuple[float, int]]
) -> None:
    import tieredbuf

    buf = tieredbuf.open(url, **ep.options())
    while not stop.is_set():
        samples.append((time.time(), buf.queue.read_footer().next_sequence))
        stop.wait(0.05)


def row_live(
    ep: S3Endpoint, proxy: Any, code: str, tree: str | None, args: argparse.Namespace, tmp: Path
) -> dict[str, Any]:
    url = f"s3://{ep.new_bucket('rd')}/live"
    import tieredbuf

    tieredbuf.open(url, **ep.options()).create()
    o = json.dumps(_proxy_opts(proxy.endpoint, ep))
    stop_file, reads_file = tmp / f"stop-{code}", tmp / f"reads-{code}.json"
    consumer = _child(tree, "live", url, o, str(stop_file), str(reads_file))
    assert consumer.stdout is not None
    if not consumer.stdout.readline().startswith("READY"):
        raise RuntimeError(_result(consumer, 30))
    start_at = time.time() + 4.0 + 0.3 * args.producers  # every producer imported by then
    producers = [
        _child(tree, "producer", url, o, str(start_at), str(args.live_seconds))
        for _ in range(args.producers)
    ]
    samples: list[tuple[float, int]] = []
    halt = threading.Event()
    sampler = threading.Thread(target=_sample_footer, args=(url, ep, halt, samples))
    sampler.start()
    try:
        outs = [_result(p, args.live_seconds + 120) for p in producers]
        tail = tieredbuf.open(url, **ep.options()).queue.read_footer().next_sequence
        (tmp / "stop.tmp").write_text(str(tail))
        (tmp / "stop.tmp").rename(stop_file)
        c_out = _result(consumer, 300)
    finally:
        halt.set()
        sampler.join()
    reads = json.loads(reads_file.read_text())
    return {
        "code": code,
        "producers": args.producers,
        "seconds": args.live_seconds,
        "records": sum(x["records"] for x in outs),
        "entries": tail,
        "appends": sum(x.get("appends", 0) for x in outs),
        **_lag(
            samples, [(float(t), int(s)) for t, s in reads], start_at, start_at + args.live_seconds
        ),
        "consumer_requests": c_out["requests"],
        "requests_per_entry": round(c_out["requests"]["total"] / max(1, tail), 3),
    }


def _lag(
    samples: list[tuple[float, int]], reads: list[tuple[float, int]], t0: float, t1: float
) -> dict[str, Any]:
    """Lag in entries at each footer sample, and in seconds for each entry (returned minus
    first seen appended), while the producers ran."""
    import bisect

    read_times = [t for t, _ in reads]
    lag_n: list[tuple[float, int]] = []
    first_seen: dict[int, float] = {}
    prev = 0
    for t, tail in samples:
        for s in range(prev, tail):
            first_seen[s] = t
        prev = max(prev, tail)
        if t0 <= t <= t1:
            lag_n.append((t, tail - bisect.bisect_right(read_times, t)))
    lag_s = [t - first_seen[s] for t, s in reads if s in first_seen and t0 <= first_seen[s] <= t1]
    mid = (t0 + t1) / 2
    first_half = [n for t, n in lag_n if t < mid]
    second_half = [n for t, n in lag_n if t >= mid]
    entries = [n for _, n in lag_n]
    return {
        "lag_entries": {k: round(v, 1) for k, v in summarize(entries).items()},
        "lag_s": {k: round(v, 3) for k, v in summarize(lag_s).items()},
        "lag_entries_max_first_half": max(first_half, default=0),
        "lag_entries_max_second_half": max(second_half, default=0),
        "lag_entries_p99_second_half": round(percentile(second_half, 99), 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    ap.add_argument(
        "--baseline-tree",
        metavar="DIR",
        help="run every row on the code in DIR first (PYTHONPATH=DIR)",
    )
    ap.add_argument("--rows", default="backlog,large,live")
    ap.add_argument("--kinds", default=",".join(KINDS), help="backlog readers to run")
    ap.add_argument("--entries", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--large", type=int, default=16)
    ap.add_argument("--large-mib", type=int, default=32)
    ap.add_argument(
        "--large-rounds", type=int, default=3, help="raw GETs and consumer, alternating"
    )
    ap.add_argument("--producers", type=int, default=16)
    ap.add_argument("--live-seconds", type=float, default=60.0)
    ap.add_argument(
        "--time-cap",
        type=float,
        default=120.0,
        help="a reader still reading after this many seconds stops there",
    )
    ap.add_argument("--get-ms", type=float, default=20.0, help="added to every GET and HEAD")
    ap.add_argument(
        "--put-ms", type=float, default=40.0, help="added to every PUT, POST and DELETE"
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="a few seconds per row: 200 entries, 4 x 8 MiB, 4 producers for 5 s",
    )
    args = ap.parse_args()
    if args.child:
        _run_child(args.child)
        return
    if args.smoke:
        args.entries, args.large, args.large_mib, args.large_rounds = 200, 4, 8, 1
        args.producers, args.live_seconds, args.time_cap = 4, 5.0, 60.0
    sys.path.insert(1, str(ROOT))  # tests.latency_proxy (the children need only tieredbuf)
    from tests.latency_proxy import LatencyProxy

    codes: list[tuple[str, str | None]] = []
    if args.baseline_tree:
        codes.append(("baseline", str(Path(args.baseline_tree).resolve())))
    codes.append(("this", None))
    rows = set(args.rows.split(","))
    kinds = [k for k in args.kinds.split(",") if k]
    delays = {
        "GET": args.get_ms / 1000,
        "HEAD": args.get_ms / 1000,
        **{m: args.put_ms / 1000 for m in ("PUT", "POST", "DELETE")},
    }
    results: dict[str, Any] = {
        "load_before": os.getloadavg(),
        "delays_ms": {"get": args.get_ms, "put": args.put_ms},
        "codes": dict(codes),
    }
    tmp = Path(tempfile.mkdtemp(prefix="tb-bench-readers-"))
    with ExitStack() as stack:
        ep = stack.enter_context(serial_moto())
        proxy = stack.enter_context(LatencyProxy(ep.endpoint, delays))
        if "backlog" in rows:
            results["backlog"] = [
                row_backlog(ep, proxy, code, tree, kind, args)
                for kind in kinds
                for code, tree in codes
            ]
            _print_backlog(results["backlog"], args)
        if "large" in rows:
            results["large"] = [row_large(ep, proxy, code, tree, args) for code, tree in codes]
            print_table(
                [
                    "code",
                    "entries",
                    "MiB each",
                    "consumer MB/s (median)",
                    "4 raw GETs MB/s (median)",
                    "ratio (goal >= 1)",
                    "rounds: consumer / raw",
                    "consumer requests",
                ],
                [
                    [
                        r["code"],
                        r["read"],
                        args.large_mib,
                        r["consumer_mb_s"],
                        r["raw_mb_s"],
                        r["ratio"],
                        f"{r['consumer_mb_s_rounds']} / {r['raw_mb_s_rounds']}",
                        r["requests"]["total"],
                    ]
                    for r in results["large"]
                ],
            )
        if "live" in rows:
            results["live"] = [row_live(ep, proxy, code, tree, args, tmp) for code, tree in codes]
            print_table(
                [
                    "code",
                    "producers",
                    "s",
                    "entries",
                    "appended/s",
                    "lag entries p50/p99/max",
                    "lag s p50/p99/max",
                    "max lag 1st/2nd half",
                    "req/entry",
                ],
                [
                    [
                        r["code"],
                        r["producers"],
                        r["seconds"],
                        r["entries"],
                        round(r["entries"] / r["seconds"], 1),
                        "/".join(str(r["lag_entries"][k]) for k in ("p50", "p99", "max")),
                        "/".join(str(r["lag_s"][k]) for k in ("p50", "p99", "max")),
                        f"{r['lag_entries_max_first_half']}/{r['lag_entries_max_second_half']}",
                        r["requests_per_entry"],
                    ]
                    for r in results["live"]
                ],
            )
    results["load_after"] = os.getloadavg()
    print(
        f"delays: GET/HEAD {args.get_ms} ms, PUT/POST/DELETE {args.put_ms} ms; load average "
        f"before {results['load_before']}, after {results['load_after']}"
    )
    print("written to", write_json("readers-smoke" if args.smoke else "readers", results))


def _print_backlog(runs: list[dict[str, Any]], args: argparse.Namespace) -> None:
    default = {r["code"]: r["rate"] for r in runs if r["kind"] == "default"}
    rows = []
    for r in runs:
        label = {
            "default": "buf.consumer()",
            "named": 'buf.consumer("etl")',
            "workers": f"{args.workers} workers",
        }[r["kind"]]
        vs = (
            f"{r['rate'] / default[r['code']]:.2f}"
            if r["kind"] == "named" and default.get(r["code"])
            else ""
        )
        ok = r["rate"] >= GOAL_RATE and r["requests_per_entry"] <= GOAL_REQUESTS
        rows.append(
            [
                r["code"],
                label,
                f"{r['read']}/{r['entries']}",
                r["seconds"],
                r["rate"],
                r["requests_per_entry"],
                vs,
                "yes" if ok else "no",
                json.dumps(r["requests"]["by_kind"]),
            ]
        )
    print_table(
        [
            "code",
            "reader",
            "read",
            "s",
            "entries/s (goal >= 150)",
            "requests/entry (<= 1.2)",
            "named/default (>= 0.8)",
            "goals met",
            "requests by object",
        ],
        rows,
    )


def _run_child(argv: list[str]) -> None:
    kind, *rest = argv
    if kind == "backlog":
        out = child_backlog(
            rest[0], json.loads(rest[1]), rest[2], int(rest[3]), int(rest[4]), float(rest[5])
        )
    elif kind == "large":
        out = child_large(rest[0], json.loads(rest[1]), int(rest[2]), int(rest[3]), float(rest[4]))
    elif kind == "producer":
        child_producer(rest[0], json.loads(rest[1]), float(rest[2]), float(rest[3]))
        return
    elif kind == "live":
        child_live(rest[0], json.loads(rest[1]), rest[2], rest[3])
        return
    else:
        raise SystemExit(f"unknown child {kind}")
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
