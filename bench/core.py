"""Core benchmark: stateless-producer throughput and produce -> consume latency.

Runs against two stores -- a local directory (file://) and a moto S3 server over
HTTP on 127.0.0.1 -- and, in the same run, against a naive baseline on the same
store with the same records:

* local dir: one file per produce call, written and fsynced (no directory fsync);
* moto: one boto3 ``put_object`` per produce call.

1. Throughput: ``--threads`` threads call ``producer.produce()`` with ``--batch``
   records of ``--record-size`` bytes each; the clock stops when ``producer.close()``
   returns, i.e. when every record is REMOTE-durable (object uploaded and appended
   to the queue manifest).  The baseline runs the same calls from the same threads.
2. Latency: one thread produces at a steady ``--rate`` calls/s with a monotonic
   timestamp inside each record; a consumer thread polls ``next_batch()``, acks, and
   measures now - timestamp per record.  REMOTE ack latency (``handle.wait``) and the
   baseline's per-PUT latency at the same rate are reported beside it.  The same runs
   at ``--low-rate`` (5 calls/s: a light load), and both again with the staged
   producer (``staging_dir``; LOCAL and REMOTE acks), so both producers have a
   latency row at a low and a high rate.  Goals: the staged producer's REMOTE ack at
   the low rate p50 <= 150 ms and p99 <= 300 ms; the direct producer's p99 <= 2 x
   flush_interval plus one store round trip (the baseline's PUT p50 at that rate).

Usage::

    python bench/core.py            # full run (a few minutes on 2 cores)
    python bench/core.py --quick    # ~30 s
    python bench/core.py --backends local --repeat 1

moto runs in a child process (``--moto-in-process`` puts it on a thread here, as
the tests do), so its Python work does not share this process's GIL.  Durability
differs by store and is printed with the results: the local directory store fsyncs,
moto keeps everything in RAM.

Results: a table on stdout and ``bench/results/core.json``.
"""

from __future__ import annotations

import argparse
import functools
import os
import queue
import shutil
import statistics
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

from _common import (
    S3Endpoint,
    moto_server,
    print_table,
    run_threads,
    summarize,
    write_json,
)

import tieredbuf
from tieredbuf.format.batch import decode_batch

FLUSH_INTERVAL = timedelta(milliseconds=100)
MiB = 1 << 20

DURABILITY = {
    "local": {
        "tieredbuf": "fsync: each data object and each manifest write is written to a temp "
        "file, fsynced, linked/renamed into place, and the directory fsynced, before the ack",
        "baseline": "fsync of each file (write + fsync + close; no directory fsync)",
    },
    "moto": {
        "tieredbuf": "RAM only: moto keeps every object in memory (no disk durability); "
        "acked once the object PUT and the manifest CAS returned 200",
        "baseline": "RAM only: moto keeps every object in memory; acked when put_object "
        "returned 200",
    },
}


# --- backends ------------------------------------------------------------------------


@dataclass
class Backend:
    """How to get a fresh tieredbuf buffer and a fresh naive-baseline writer on one store."""

    name: str
    new_buffer: Callable[[], tieredbuf.Buffer]
    new_baseline: Callable[[], Callable[[str], Callable[[str, bytes], None]]]
    """Returns ``writer_for_thread(tag)``; each thread's writer is ``write(key, body)``."""


def local_backend(root: Path) -> Backend:
    counter = iter(range(1 << 30))

    def new_buffer() -> tieredbuf.Buffer:
        buf = tieredbuf.open(f"file://{root}/tb-{next(counter)}")
        buf.create()  # the latency run's consumer starts first, and readers never create
        return buf

    def new_baseline() -> Callable[[str], Callable[[str, bytes], None]]:
        d = root / f"naive-{next(counter)}"
        d.mkdir()

        def writer_for(_tag: str) -> Callable[[str, bytes], None]:
            def write(key: str, body: bytes) -> None:
                fd = os.open(d / key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    view = memoryview(body)
                    while view:
                        view = view[os.write(fd, view) :]
                    os.fsync(fd)
                finally:
                    os.close(fd)

            return write

        return writer_for

    return Backend("local", new_buffer, new_baseline)


def moto_backend(ep: S3Endpoint) -> Backend:
    def new_buffer() -> tieredbuf.Buffer:
        buf = tieredbuf.open(f"s3://{ep.new_bucket('tb')}/buf", **ep.options())
        buf.create()
        return buf

    def new_baseline() -> Callable[[str], Callable[[str, bytes], None]]:
        bucket = ep.new_bucket("naive")

        def writer_for(_tag: str) -> Callable[[str, bytes], None]:
            client = ep.boto3_client()  # one client per thread, made before the clock starts

            def write(key: str, body: bytes) -> None:
                client.put_object(Bucket=bucket, Key=f"data/{key}", Body=body)

            return write

        return writer_for

    return Backend("moto", new_buffer, new_baseline)


# --- workload --------------------------------------------------------------------------


def make_calls(threads: int, calls: int, batch: int, size: int) -> list[list[list[bytes]]]:
    """Distinct records, built before any clock starts: [thread][call][record]."""
    base = os.urandom(size)
    return [
        [[struct.pack(">HIH", t, c, j) + base[8:] for j in range(batch)] for c in range(calls)]
        for t in range(threads)
    ]


def frame(records: list[bytes]) -> bytes:
    """The baseline's object body: length-prefixed records (what a naive writer would do)."""
    return b"".join(struct.pack(">I", len(r)) + r for r in records)


def count_records(buf: tieredbuf.Buffer) -> tuple[int, int]:
    """(entries, records) in the queue: reads every data object (not timed)."""
    entries = buf.entries()
    return len(entries), sum(len(decode_batch(buf.read_object(e))) for e in entries)


def tieredbuf_throughput(
    backend: Backend, calls: list[list[list[bytes]]], verify: bool, options: dict[str, Any]
) -> dict[str, Any]:
    buf = backend.new_buffer()
    producer = buf.producer(flush_interval=FLUSH_INTERVAL, **options)
    last: list[Any] = [None] * len(calls)
    marks: dict[str, float] = {}

    def work(i: int, barrier: threading.Barrier) -> None:
        barrier.wait()
        h = None
        for records in calls[i]:
            h = producer.produce(records)
        last[i] = h

    t0 = run_threads(len(calls), work)
    marks["produced"] = time.perf_counter() - t0
    producer.close()
    elapsed = time.perf_counter() - t0
    for h in last:
        assert h is not None and h.result() is not None, "close() returned before REMOTE"
    out: dict[str, Any] = {
        "seconds": elapsed,
        "produce_calls_seconds": marks["produced"],
        "producer_stats": producer.stats.snapshot(),
        "queue_stats": buf.queue.stats.snapshot(),
    }
    if verify:
        n_entries, n_records = count_records(buf)
        expected = sum(len(r) for th in calls for r in th)
        if n_records != expected:
            raise AssertionError(f"queue holds {n_records} records, expected {expected}")
        out["entries"] = n_entries
    buf.close()
    return out


def baseline_throughput(backend: Backend, calls: list[list[list[bytes]]]) -> dict[str, Any]:
    writer_for = backend.new_baseline()
    writers = [writer_for(str(i)) for i in range(len(calls))]
    lat: list[list[float]] = [[] for _ in calls]

    def work(i: int, barrier: threading.Barrier) -> None:
        write, mine = writers[i], lat[i]
        barrier.wait()
        for c, records in enumerate(calls[i]):
            s = time.perf_counter()
            write(f"{i}-{c}", frame(records))
            mine.append(time.perf_counter() - s)

    t0 = run_threads(len(calls), work)
    elapsed = time.perf_counter() - t0
    return {
        "seconds": elapsed,
        "put_latency_ms": summarize([x * 1e3 for xs in lat for x in xs]),
    }


# --- latency -------------------------------------------------------------------------

STAMP = struct.Struct(">QI")  # monotonic_ns at produce, call number


def _stamp(out: list[float], t0_ns: int) -> None:
    """A durability callback: how long since produce() (runs on a producer thread)."""
    out.append((time.monotonic_ns() - t0_ns) / 1e6)


def steady(rate: float, seconds: float) -> Iterator[tuple[int, float]]:
    """(call number, scheduled perf_counter time), sleeping until each is due."""
    start = time.perf_counter()
    n = int(rate * seconds)
    for i in range(n):
        due = start + i / rate
        delay = due - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        yield i, due


def tieredbuf_latency(
    backend: Backend,
    rate: float,
    seconds: float,
    warmup: float,
    batch: int,
    size: int,
    poll: float,
    options: dict[str, Any],
    stage: Path | None = None,
) -> dict[str, Any]:
    """``stage``: a staged producer staging there (LOCAL and REMOTE acks), else direct."""
    buf = backend.new_buffer()
    consumer = buf.consumer()
    consumer.initialize()
    if stage is None:
        producer = buf.producer(flush_interval=FLUSH_INTERVAL, **options)
    else:
        producer = buf.producer(staging_dir=stage, **options)
    pad = os.urandom(max(0, size - STAMP.size))
    n_calls = int(rate * seconds)
    expected = n_calls * batch
    warm_calls = int(rate * warmup)
    handles: queue.Queue[tuple[int, int, Any] | None] = queue.Queue()
    produce_ms: list[float] = []
    ack_ms: list[float] = []
    local_ms: list[float] = []
    e2e_ms: list[float] = []
    behind: list[float] = []
    errors: list[BaseException] = []
    got = 0
    polls = {"empty": 0, "batches": 0}

    def produce_loop() -> None:
        try:
            for i, due in steady(rate, seconds):
                behind.append(time.perf_counter() - due)
                t = time.monotonic_ns()
                records = [STAMP.pack(time.monotonic_ns(), i) + pad for _ in range(batch)]
                h = producer.produce(records)
                produce_ms.append((time.monotonic_ns() - t) / 1e6)
                if i >= warm_calls:  # ack times by callback, as the service waits for them
                    for level, out in (
                        (tieredbuf.Durability.LOCAL, local_ms),
                        (tieredbuf.Durability.REMOTE, ack_ms),
                    ):
                        if stage is not None or level == tieredbuf.Durability.REMOTE:
                            h.watcher.when(level, functools.partial(_stamp, out, t))
                handles.put((i, t, h))
        except BaseException as e:
            errors.append(e)
        finally:
            handles.put(None)

    def ack_loop() -> None:
        try:
            while (item := handles.get()) is not None:
                item[2].wait(timeout=60)  # every write reaches REMOTE (or fails the run)
        except BaseException as e:
            errors.append(e)

    def consume_loop() -> None:
        nonlocal got
        deadline = time.monotonic() + seconds + 60
        try:
            while got < expected and time.monotonic() < deadline and not errors:
                b = consumer.next_batch()
                if b is None:
                    polls["empty"] += 1
                    time.sleep(poll)
                    continue
                now = time.monotonic_ns()
                polls["batches"] += 1
                for rec in b.entries:
                    ts, i = STAMP.unpack_from(rec)
                    if i >= warm_calls:
                        e2e_ms.append((now - ts) / 1e6)
                    got += 1
                consumer.ack(b.sequence)
            consumer.flush()
        except BaseException as e:
            errors.append(e)

    threads = [
        threading.Thread(target=f, name=f.__name__) for f in (consume_loop, ack_loop, produce_loop)
    ]
    for t in threads:
        t.start()
    threads[2].join()
    producer.close()
    for t in threads[:2]:
        t.join()
    consumer.close()
    buf.close()
    if errors:
        raise errors[0]
    if got != expected:
        raise AssertionError(f"consumer saw {got} records, expected {expected}")
    stats = producer.stats if isinstance(producer.stats, dict) else producer.stats.snapshot()
    return {
        "producer": "direct" if stage is None else "staged",
        "rate": rate,
        "calls": n_calls,
        "records": expected,
        "produce_to_consume_ms": summarize(e2e_ms),
        "remote_ack_ms": summarize(ack_ms),
        "local_ack_ms": summarize(local_ms),
        "produce_call_ms": summarize(produce_ms),
        "producer_behind_schedule_ms": summarize([x * 1e3 for x in behind]),
        "consumer_polls": polls,
        "producer_stats": stats,
        "requests": {f"{op}/{kind}": n for (op, kind), n in buf.requests.snapshot().items()},
        "consumer_stats": consumer.stats.snapshot(),
        "queue_stats": buf.queue.stats.snapshot(),
    }


def baseline_latency(
    backend: Backend, rate: float, seconds: float, warmup: float, batch: int, size: int
) -> dict[str, Any]:
    write = backend.new_baseline()("lat")
    pad = os.urandom(max(0, size - STAMP.size))
    warm_calls = int(rate * warmup)
    lat: list[float] = []
    for i, _due in steady(rate, seconds):
        records = [STAMP.pack(time.monotonic_ns(), i) + pad for _ in range(batch)]
        s = time.perf_counter()
        write(f"lat-{i}", frame(records))
        if i >= warm_calls:
            lat.append((time.perf_counter() - s) * 1e3)
    return {"put_latency_ms": summarize(lat)}


# --- driver ----------------------------------------------------------------------------


def rates(records: int, nbytes: int, seconds: float) -> dict[str, float]:
    return {"records_per_s": records / seconds, "mb_per_s": nbytes / seconds / MiB}


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    med = statistics.median_low([r["seconds"] for r in runs])
    return next(r for r in runs if r["seconds"] == med)


def producer_options(args: argparse.Namespace) -> dict[str, Any]:
    """ProducerConfig fields set on the command line (the rest keep their defaults)."""
    out: dict[str, Any] = {}
    if args.max_buffered_inputs is not None:
        out["max_buffered_inputs"] = args.max_buffered_inputs
    if args.writes_per_s is not None:
        out["manifest_writes_per_s"] = args.writes_per_s
    return out


def staged_options(args: argparse.Namespace) -> dict[str, Any]:
    """Staged producer settings from the command line (library defaults otherwise)."""
    out: dict[str, Any] = {}
    if args.writes_per_s is not None:
        out["manifest_writes_per_s"] = args.writes_per_s
    for opt in args.staged_option:
        k, _, v = opt.partition("=")
        out[k] = (
            timedelta(milliseconds=float(v[:-2]))
            if v.endswith("ms")
            else (int(v) if v.isdigit() else v)
        )
    return out


def bench_backend(backend: Backend, args: argparse.Namespace) -> dict[str, Any]:
    per_thread = args.records // (args.threads * args.batch)
    calls = make_calls(args.threads, per_thread, args.batch, args.record_size)
    n_records = args.threads * per_thread * args.batch
    n_bytes = n_records * args.record_size
    tb_runs: list[dict[str, Any]] = []
    base_runs: list[dict[str, Any]] = []
    for rep in range(args.repeat):
        print(f"[{backend.name}] throughput run {rep + 1}/{args.repeat} ...", flush=True)
        tb_runs.append(
            tieredbuf_throughput(backend, calls, args.verify and rep == 0, producer_options(args))
        )
        base_runs.append(baseline_throughput(backend, calls))
    for r in (*tb_runs, *base_runs):
        r.update(rates(n_records, n_bytes, r["seconds"]))
    tb, base = median_run(tb_runs), median_run(base_runs)
    del calls

    print(f"[{backend.name}] latency runs ({args.latency_seconds:g} s each) ...", flush=True)
    lat: dict[str, Any] = {}
    for name, stage in (("direct", None), ("staged", True)):
        for label, rate in (("high", args.rate), ("low", args.low_rate)):
            staging = (
                Path(tempfile.mkdtemp(prefix="tb-bench-stage-", dir=args.tmpdir)) if stage else None
            )
            try:
                lat[f"{name}_{label}"] = tieredbuf_latency(
                    backend,
                    rate,
                    args.latency_seconds,
                    args.warmup,
                    args.batch,
                    args.record_size,
                    args.poll_interval,
                    producer_options(args) if stage is None else staged_options(args),
                    staging,
                )
            finally:
                if staging is not None:
                    shutil.rmtree(staging, ignore_errors=True)
    base_lat = baseline_latency(
        backend, args.rate, args.latency_seconds, args.warmup, args.batch, args.record_size
    )
    base_low = baseline_latency(
        backend,
        args.low_rate,
        args.latency_seconds,
        args.warmup,
        args.batch,
        args.record_size,
    )
    return {
        "durability": DURABILITY[backend.name],
        "throughput": {
            "records": n_records,
            "bytes": n_bytes,
            "tieredbuf": {"median": tb, "runs": tb_runs},
            "baseline": {"median": base, "runs": base_runs},
            "ratio_tieredbuf_over_baseline": tb["records_per_s"] / base["records_per_s"],
        },
        "latency": {"tieredbuf": lat, "baseline": base_lat, "baseline_low": base_low},
    }


def report(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    print()
    print(
        f"Throughput: {args.threads} threads, produce() calls of {args.batch} x "
        f"{args.record_size} B records, flush_interval=100ms"
        f"{''.join(f', {k}={v}' for k, v in producer_options(args).items())}; "
        f"time includes close() (all REMOTE); median of {args.repeat}; objects = data "
        "objects written"
    )
    rows = []
    for name, r in results.items():
        th = r["throughput"]
        for side in ("tieredbuf", "baseline"):
            m = th[side]["median"]
            objects = (
                m["producer_stats"].get("objects_uploaded", 0)
                if side == "tieredbuf"
                else m["put_latency_ms"]["n"]
            )
            spread = [round(x["records_per_s"]) for x in th[side]["runs"]]
            rows.append(
                [
                    name,
                    side,
                    th["records"],
                    f"{th['bytes'] / MiB:.0f}",
                    objects,
                    f"{m['seconds']:.2f}",
                    f"{m['records_per_s']:,.0f}",
                    f"{m['mb_per_s']:.1f}",
                    f"{th['ratio_tieredbuf_over_baseline']:.2f}x" if side == "tieredbuf" else "",
                    spread if len(spread) > 1 else "",
                ]
            )
    print_table(
        [
            "store",
            "system",
            "records",
            "MiB",
            "objects",
            "seconds",
            "rec/s",
            "MiB/s",
            "ratio",
            "runs rec/s",
        ],
        rows,
    )
    print()
    print(
        f"Latency: {args.rate:g} (high) and {args.low_rate:g} (low) calls/s x {args.batch} "
        f"records for {args.latency_seconds:g} s (first {args.warmup:g} s dropped); consumer "
        f"polls every {args.poll_interval * 1e3:g} ms when idle; staged: "
        f"{staged_options(args) or 'library defaults'}"
    )
    rows = []
    for name, r in results.items():
        lb = r["latency"]
        for key in ("direct_high", "direct_low", "staged_high", "staged_low"):
            lt = lb["tieredbuf"][key]
            who, level = key.split("_")
            labels = [
                (f"{who} REMOTE ack (wait)", lt["remote_ack_ms"]),
                (f"{who} produce->consume", lt["produce_to_consume_ms"]),
            ]
            if who == "staged":
                labels.insert(0, ("staged LOCAL ack (wait)", lt["local_ack_ms"]))
            for label, s in labels:
                rows.append(
                    [
                        name,
                        f"{lt['rate']:g}/s",
                        label,
                        s["n"],
                        f"{s['p50']:.2f}",
                        f"{s['p99']:.2f}",
                        f"{s['max']:.2f}",
                    ]
                )
        for label, rate, s in (
            ("baseline PUT (same rate)", args.rate, lb["baseline"]["put_latency_ms"]),
            ("baseline PUT (same rate)", args.low_rate, lb["baseline_low"]["put_latency_ms"]),
            (
                "baseline PUT (under load)",
                None,
                r["throughput"]["baseline"]["median"]["put_latency_ms"],
            ),
        ):
            rows.append(
                [
                    name,
                    f"{rate:g}/s" if rate else "max",
                    label,
                    s["n"],
                    f"{s['p50']:.2f}",
                    f"{s['p99']:.2f}",
                    f"{s['max']:.2f}",
                ]
            )
    print_table(["store", "rate", "metric", "n", "p50 ms", "p99 ms", "max ms"], rows)
    print()
    flush_ms = FLUSH_INTERVAL / timedelta(milliseconds=1)
    for name, r in results.items():
        lt = r["latency"]["tieredbuf"]
        rtt = r["latency"]["baseline_low"]["put_latency_ms"]["p50"]
        for level in ("high", "low"):
            d = lt[f"direct_{level}"]["remote_ack_ms"]["p99"]
            print(
                f"goal [{name}] direct REMOTE p99 at {lt[f'direct_{level}']['rate']:g}/s "
                f"<= 2 x {flush_ms:g} ms + one PUT ({rtt:.1f} ms): {d:.1f} ms -> "
                f"{'met' if d <= 2 * flush_ms + rtt else 'MISSED'}"
            )
        st = lt["staged_low"]["remote_ack_ms"]
        print(
            f"goal [{name}] staged REMOTE at {lt['staged_low']['rate']:g}/s p50 <= 150 ms, "
            f"p99 <= 300 ms: p50 {st['p50']:.1f}, p99 {st['p99']:.1f} -> "
            f"{'met' if st['p50'] <= 150 and st['p99'] <= 300 else 'MISSED'}"
        )
    print()
    print("Durability each side had:")
    for name, r in results.items():
        for side, text in r["durability"].items():
            print(f"  {name:5} {side:9}: {text}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick",
        action="store_true",
        help="small sizes, about 30 s in all (one flush cycle per throughput run)",
    )
    p.add_argument("--backends", default="local,moto", help="comma list of: local, moto")
    p.add_argument("--records", type=int, help="records per throughput run")
    p.add_argument("--threads", type=int, default=4, help="producer threads (throughput)")
    p.add_argument("--batch", type=int, default=10, help="records per produce() call")
    p.add_argument("--record-size", type=int, default=1024, help="bytes per record")
    p.add_argument("--repeat", type=int, help="throughput runs per system (median reported)")
    p.add_argument("--rate", type=float, default=100.0, help="latency: produce calls per second")
    p.add_argument(
        "--low-rate",
        type=float,
        default=5.0,
        help="latency: the light load's produce calls per second",
    )
    p.add_argument(
        "--writes-per-s",
        type=float,
        help="manifest_writes_per_s of both producers (default: the library's)",
    )
    p.add_argument(
        "--staged-option",
        action="append",
        default=[],
        help="a staged producer option, e.g. max_open_duration=100ms (repeatable)",
    )
    p.add_argument("--latency-seconds", type=float, help="latency: seconds of producing")
    p.add_argument("--warmup", type=float, default=1.0, help="latency: seconds dropped")
    p.add_argument(
        "--poll-interval",
        type=float,
        default=0.01,
        help="latency: consumer sleep after an empty poll (s)",
    )
    p.add_argument(
        "--max-buffered-inputs",
        type=int,
        help="ProducerConfig.max_buffered_inputs (default: the library's)",
    )
    p.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="skip counting the queued records after the first throughput run",
    )
    p.add_argument(
        "--moto-in-process",
        action="store_true",
        help="run moto on a thread of this process (shares the GIL), as tests do",
    )
    p.add_argument("--tmpdir", help="parent directory of the local stores (default: $TMPDIR)")
    p.add_argument("--out", default="core", help="results file name under bench/results/")
    a = p.parse_args(argv)
    if a.records is None:
        a.records = 10_000 if a.quick else 50_000
    if a.repeat is None:
        a.repeat = 1 if a.quick else 3
    if a.latency_seconds is None:
        a.latency_seconds = 4.0 if a.quick else 12.0
    if a.warmup >= a.latency_seconds:
        p.error("--warmup must be shorter than --latency-seconds")
    if a.records < a.threads * a.batch:
        p.error("--records must be at least --threads x --batch")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = [n.strip() for n in args.backends.split(",") if n.strip()]
    for n in names:
        if n not in ("local", "moto"):
            raise SystemExit(f"unknown backend {n!r}")
    started = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    with ExitStack() as stack:
        root = Path(tempfile.mkdtemp(prefix="tb-bench-", dir=args.tmpdir))
        stack.callback(shutil.rmtree, root, True)
        for n in names:
            if n == "local":
                backend = local_backend(root)
            else:
                ep = stack.enter_context(moto_server(in_process=args.moto_in_process))
                backend = moto_backend(ep)
            results[n] = bench_backend(backend, args)
    report(results, args)
    path = write_json(
        args.out,
        {
            "benchmark": "core",
            "config": {
                **vars(args),
                "flush_interval_ms": FLUSH_INTERVAL / timedelta(milliseconds=1),
            },
            "moto": "in-process thread" if args.moto_in_process else "child process",
            "results": results,
            "wall_seconds": time.perf_counter() - started,
        },
    )
    print(f"\nwrote {path} ({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
