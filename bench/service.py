"""Service benchmark: ``tieredbuf serve`` on loopback, requests/s and latency per durability.

Starts the real service (``python -m tieredbuf.cli serve``, ``--workers`` processes)
on 127.0.0.1 in front of a store (a moto S3 server in a child process, or a local
directory), then for each durability level:

* low rate: an open loop of ``--low-rate`` requests per second (5) for
  ``--low-seconds`` (20 s), each on its own connection, the latency a light user sees;
* high rate: ``--requests`` POST /v1/produce requests from ``--threads`` client
  threads with keep-alive connections, as fast as they are answered (closed loop),
  stopping early at ``--time-cap`` seconds.

Each request carries ``--records`` records of ``--record-size`` bytes
(octet-stream framing).  The stage runs with the library's defaults (a segment
seals after 5 s, or at once for a request waiting for ``remote``) unless
``--max-open-duration`` or ``--serve-args`` say otherwise.  A request counts when it
got 200, i.e. when its records were LOCAL (WAL fdatasync returned) or REMOTE
(segment uploaded and in the queue manifest).  Afterwards the service is stopped
with SIGTERM (it drains) and every acknowledged record is counted back through a
consumer.

The client threads run on the same machine as the workers (and moto), so on a
small box they compete for the same cores: the figures are a floor, not a ceiling.

With ``--baseline-tree DIR`` (a checkout of other code, e.g. ``git archive <commit> |
tar -x -C DIR``) everything runs twice in one run, first on the code in DIR (the
service started with ``PYTHONPATH=DIR``), then on this tree, each on its own buffer:
a same-run baseline.

``--memory`` measures instead a worker's peak memory for one request at the body
limit (``--memory-limit``, 16 MiB), per kind of body: ndjson of 1-byte records,
ndjson at the default ``--max-records``, octet-stream of empty records, Arrow of
one-row batches, an Arrow zstd "bomb" decoding to ``--bomb-factor`` x the limit,
Arrow zstd decoding to the limit, Arrow uncompressed at the limit
(bench/_service_memory.py).  Goal: <= 4x the limit.

Usage::

    python bench/service.py                   # moto, 2 workers, 2000 requests per level
    python bench/service.py --store local --requests 500
    python bench/service.py --memory --baseline-tree /tmp/base

Results: a table on stdout and ``bench/results/service.json`` (``service-memory.json``).
"""

from __future__ import annotations

import argparse
import http.client
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import moto_server, print_table, summarize, write_json


def _body(n: int, size: int, tag: str) -> bytes:
    recs = [(f"{tag}-{i}:".encode() + b"x" * size)[:size] for i in range(n)]
    return b"".join(struct.pack("<I", len(r)) + r for r in recs)


def _start(
    url: str,
    stage: Path,
    args: argparse.Namespace,
    env: dict[str, str],
    workers: int | None = None,
    extra: tuple[str, ...] = (),
) -> tuple[subprocess.Popen[str], int]:
    seal = ["--max-open-duration", args.max_open_duration] if args.max_open_duration else []
    if args.manifest_writes_per_s is not None:
        seal += ["--manifest-writes-per-s", str(args.manifest_writes_per_s)]
    cmd = [
        sys.executable,
        "-m",
        "tieredbuf.cli",
        "serve",
        url,
        "--staging",
        str(stage),
        "--port",
        "0",
        "--workers",
        str(workers or args.workers),
        *seal,
        *args.serve_args,
        *extra,
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, **env},
        cwd=tempfile.gettempdir(),
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    port = int(line.split("http://", 1)[1].split()[0].rsplit(":", 1)[1])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/readyz")
            if c.getresponse().status == 200:
                return proc, port
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError("service did not become ready")


def _post(port: int, durability: str, body: bytes) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(
            "POST",
            f"/v1/produce?durability={durability}",
            body,
            {"Content-Type": "application/octet-stream"},
        )
        r = conn.getresponse()
        r.read()
        return r.status
    finally:
        conn.close()


def _run_low(
    port: int, durability: str, args: argparse.Namespace, rate: float | None = None
) -> dict[str, Any]:
    """An open loop: one request every 1/rate s (each on its own thread and connection),
    whatever the earlier ones are doing; ``rate`` s*``--low-seconds`` requests, at least
    ``--low-min-requests``."""
    rate = args.low_rate if rate is None else rate
    lock = threading.Lock()
    lat: list[float] = []
    errors: dict[int, int] = {}
    n = max(int(rate * args.low_seconds), args.low_min_requests)
    load_before = os.getloadavg()

    def one(i: int) -> None:
        body = _body(args.records, args.record_size, f"low-{durability}-{i}")
        t0 = time.perf_counter()
        try:
            status = _post(port, durability, body)
        except OSError:
            status = -1
        dt = time.perf_counter() - t0
        with lock:
            if status == 200:
                lat.append(dt)
            else:
                errors[status] = errors.get(status, 0) + 1

    threads = []
    start = time.perf_counter()
    for i in range(n):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        t = threading.Thread(target=one, args=(i,))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    s = summarize([x * 1000 for x in lat])
    return {
        "durability": durability,
        "load": f"low ({rate:g} req/s)",
        "rate": rate,
        "load_average": [round(x, 2) for x in (*load_before, *os.getloadavg())],
        "ok": len(lat),
        "errors": errors,
        "seconds": round(elapsed, 3),
        "requests_per_s": round(len(lat) / elapsed, 1),
        "records_per_s": round(len(lat) * args.records / elapsed, 1),
        "latency_ms": {k: round(v, 2) for k, v in s.items() if k != "n"},
        "capped": False,
    }


def _run_level(port: int, durability: str, args: argparse.Namespace) -> dict[str, Any]:
    lock = threading.Lock()
    next_i = [0]
    lat: list[float] = []
    errors: dict[int, int] = {}
    stop_at = time.monotonic() + args.time_cap
    load_before = os.getloadavg()

    def client(t: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        while time.monotonic() < stop_at:
            with lock:
                i = next_i[0]
                if i >= args.requests:
                    break
                next_i[0] += 1
            body = _body(args.records, args.record_size, f"{durability}-{i}")
            t0 = time.perf_counter()
            try:
                conn.request(
                    "POST",
                    f"/v1/produce?durability={durability}",
                    body,
                    {"Content-Type": "application/octet-stream"},
                )
                r = conn.getresponse()
                r.read()
            except OSError:
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
                with lock:
                    errors[-1] = errors.get(-1, 0) + 1
                continue
            dt = time.perf_counter() - t0
            with lock:
                if r.status == 200:
                    lat.append(dt)
                else:
                    errors[r.status] = errors.get(r.status, 0) + 1
        conn.close()

    threads = [threading.Thread(target=client, args=(t,)) for t in range(args.threads)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    elapsed = time.perf_counter() - t0
    s = summarize([x * 1000 for x in lat])
    return {
        "durability": durability,
        "load": f"high ({args.threads} threads)",
        "load_average": [round(x, 2) for x in (*load_before, *os.getloadavg())],
        "ok": len(lat),
        "errors": errors,
        "seconds": round(elapsed, 3),
        "requests_per_s": round(len(lat) / elapsed, 1),
        "records_per_s": round(len(lat) * args.records / elapsed, 1),
        "latency_ms": {k: round(v, 2) for k, v in s.items() if k != "n"},
        "capped": len(lat) + sum(errors.values()) < args.requests,
    }


def _count_back(url: str, opts: dict[str, Any]) -> int:
    import tieredbuf

    buf = tieredbuf.open(url, **opts)
    c = buf.consumer()
    c.initialize()
    n = 0
    while (b := c.next_batch()) is not None:
        n += len(b.entries)
        c.ack(b.sequence)
    c.flush()
    c.close()
    return n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", choices=("moto", "local"), default="moto")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--requests", type=int, default=2000, help="per durability level")
    p.add_argument("--records", type=int, default=10, help="records per request")
    p.add_argument("--record-size", type=int, default=200)
    p.add_argument("--time-cap", type=float, default=60.0, help="seconds per level")
    p.add_argument("--low-rate", type=float, default=5.0, help="requests/s of the low rate")
    p.add_argument("--low-seconds", type=float, default=20.0, help="seconds of the low rate")
    p.add_argument(
        "--low-rates",
        type=float,
        nargs="+",
        default=None,
        help="several low rates in one run (one service), in this order; overrides --low-rate",
    )
    p.add_argument(
        "--low-min-requests",
        type=int,
        default=0,
        help="at least this many requests per low rate (longer at low rates)",
    )
    p.add_argument(
        "--durabilities", nargs="+", choices=("local", "remote"), default=["local", "remote"]
    )
    p.add_argument("--no-high", action="store_true", help="skip the high-rate (closed loop) levels")
    p.add_argument(
        "--max-open-duration",
        default=None,
        help="segment seal interval (default: the library's 5 s)",
    )
    p.add_argument(
        "--manifest-writes-per-s",
        type=float,
        default=None,
        help="the buffer's manifest append budget (default: the library's 5/s)",
    )
    p.add_argument("--serve-args", nargs="*", default=[])
    p.add_argument("--no-low", action="store_true", help="skip the low-rate (open loop) levels")
    p.add_argument(
        "--baseline-tree",
        metavar="DIR",
        help="run everything on the code in DIR first (PYTHONPATH=DIR)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="with --baseline-tree: run both this many times, alternating which goes first",
    )
    p.add_argument(
        "--memory",
        action="store_true",
        help="peak worker memory per request at the body limit, not load",
    )
    p.add_argument(
        "--memory-limit",
        type=int,
        default=16 << 20,
        metavar="BYTES",
        help="--max-body of the memory cases (default 16 MiB)",
    )
    p.add_argument(
        "--bomb-factor",
        type=int,
        default=16,
        help="the Arrow bomb decodes to this many times --memory-limit",
    )
    args = p.parse_args()
    codes: list[tuple[str, str | None]] = (
        [("baseline", args.baseline_tree)] if args.baseline_tree else []
    )
    codes.append(("this", None))
    if args.memory:
        _main_memory(args, codes)
        return

    load = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="tb-bench-service-"))
    runs: list[dict[str, Any]] = []
    with ExitStack() as stack:
        if args.store == "moto":
            ep = stack.enter_context(moto_server())
            base, opts = f"s3://{ep.new_bucket()}/svc", ep.options()
            env = {
                "AWS_ACCESS_KEY_ID": ep.access_key_id,
                "AWS_SECRET_ACCESS_KEY": ep.secret_access_key,
            }
            args.serve_args = [
                *args.serve_args,
                "--endpoint",
                ep.endpoint,
                "--region",
                ep.region,
                "--allow-http",
            ]
        else:
            base, opts, env = f"file://{tmp}/buf", {}, {}
        # rounds alternate the order (AB, BA, AB, ...): on a shared, noisy machine the
        # second run of a pair is not always the one that meets the busier minute
        order = [
            pair for r in range(args.rounds) for pair in (codes if r % 2 == 0 else codes[::-1])
        ]
        for i, (code, tree) in enumerate(order):
            url = f"{base}-{code}-{i}"
            code_env = {**env, "PYTHONPATH": tree} if tree else env
            proc, port = _start(url, tmp / f"stage-{code}-{i}", args, code_env)
            try:
                levels = (
                    []
                    if args.no_low
                    else [
                        _run_low(port, d, args, r)
                        for r in (args.low_rates or [args.low_rate])
                        for d in args.durabilities
                    ]
                )
                if not args.no_high:
                    levels += [_run_level(port, d, args) for d in args.durabilities]
            finally:
                proc.send_signal(signal.SIGTERM)
                rc = proc.wait(300)
            for lv in levels:
                lv["code"] = code if args.rounds == 1 else f"{code} #{i + 1}"
            runs.append(
                {
                    "code": code,
                    "tree": tree or "this tree",
                    "levels": levels,
                    "drain_exit_code": rc,
                    "acknowledged_records": sum(lv["ok"] for lv in levels) * args.records,
                    "consumed_records": _count_back(url, opts),
                }
            )
    shutil.rmtree(tmp, ignore_errors=True)

    print(
        f"tieredbuf serve on 127.0.0.1, store {args.store}, {args.workers} workers, "
        f"{args.records} x {args.record_size} B records per request, max_open_duration "
        f"{args.max_open_duration or 'default (5s)'}, manifest_writes_per_s "
        f"{'default (5)' if args.manifest_writes_per_s is None else args.manifest_writes_per_s}"
        f"; load average " + " ".join(f"{x:.2f}" for x in load)
    )
    levels = [lv for run in runs for lv in run["levels"]]
    print_table(
        [
            "code",
            "durability",
            "load",
            "ok",
            "errors",
            "req/s",
            "records/s",
            "p50 ms",
            "p99 ms",
            "max ms",
            "load avg (1 min) before/after",
        ],
        [
            [
                lv["code"],
                lv["durability"],
                lv["load"],
                lv["ok"],
                lv["errors"] or "-",
                lv["requests_per_s"],
                lv["records_per_s"],
                lv["latency_ms"]["p50"],
                lv["latency_ms"]["p99"],
                lv["latency_ms"]["max"],
                f"{lv['load_average'][0]:.2f} / {lv['load_average'][3]:.2f}",
            ]
            for lv in levels
        ],
    )
    for low_remote in (
        lv for lv in levels if lv["durability"] == "remote" and lv["load"].startswith("low")
    ):
        p50, p99 = low_remote["latency_ms"]["p50"], low_remote["latency_ms"]["p99"]
        print(
            f"goal ({low_remote['code']}): remote at {low_remote['load']} p50 <= 150 ms and "
            f"p99 <= 300 ms: p50 {p50}, p99 {p99} -> "
            f"{'met' if p50 <= 150 and p99 <= 300 else 'MISSED'}"
        )
    for n, run in enumerate(runs, start=1):
        exact = run["acknowledged_records"] == run["consumed_records"]
        print(
            f"{run['code']} #{n}: SIGTERM drain exit {run['drain_exit_code']}; acknowledged "
            f"records {run['acknowledged_records']}, consumed back "
            f"{run['consumed_records']} ({'exact' if exact else 'MISMATCH'})"
        )
    path = write_json(
        "service",
        {
            "config": {k: v for k, v in vars(args).items()},
            "durability_meaning": {
                "local": "WAL fdatasync returned on the worker's disk",
                "remote": f"segment uploaded to the {args.store} store and appended to "
                "the manifest",
            },
            "runs": runs,
            "load_average_before": load,
        },
    )
    print(f"results: {path}")


def _main_memory(args: argparse.Namespace, codes: list[tuple[str, str | None]]) -> None:
    from bench import _service_memory as mem

    limit = args.memory_limit
    load = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="tb-bench-service-mem-"))
    rows: list[dict[str, Any]] = []
    for i, (name, ctype, make) in enumerate(mem.cases(limit, args.bomb_factor)):
        body = make()
        for code, tree in codes:
            url = f"file://{tmp}/buf-{i}-{code}"
            env = {"PYTHONPATH": tree} if tree else {}
            proc, port = _start(
                url,
                tmp / f"stage-{i}-{code}",
                args,
                env,
                workers=1,
                extra=("--max-body", str(limit)),
            )
            try:
                (worker,) = (
                    int(p)
                    for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
                )
                load_before = os.getloadavg()[0]
                got = mem.measure(port, worker, ctype, body)
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(600)
            rows.append(
                {
                    "case": name,
                    "code": code,
                    "body_bytes": len(body),
                    "x_limit": round(got["peak_growth_mib"] * (1 << 20) / limit, 2),
                    "load_average_1min": round(load_before, 2),
                    **got,
                }
            )
        del body
    shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"peak worker memory per request, --max-body {limit} B (goal <= 4x), one worker, "
        f"file:// store; load average " + " ".join(f"{x:.2f}" for x in load)
    )
    print_table(
        [
            "case",
            "code",
            "body bytes",
            "status",
            "peak growth MiB",
            "x limit",
            "seconds",
            "load (1 min)",
        ],
        [
            [
                r["case"],
                r["code"],
                r["body_bytes"],
                r["status"],
                r["peak_growth_mib"],
                r["x_limit"],
                r["seconds"],
                r["load_average_1min"],
            ]
            for r in rows
        ],
    )
    path = write_json(
        "service-memory",
        {
            "config": {k: v for k, v in vars(args).items()},
            "memory_limit_bytes": limit,
            "goal": "peak growth <= 4x the body limit",
            "rows": rows,
            "load_average_before": load,
        },
    )
    print(f"results: {path}")


if __name__ == "__main__":
    main()
