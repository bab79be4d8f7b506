"""Direct producers or the service, at 16, 64 and 256 producers: what the store is sent,
what that costs, and REMOTE latency (issue 36).

For each producer count N (``--producers``: 16, 64, 256), in one run on one store
(``--store``: ``file``, a local directory, or ``moto``, a moto S3 server), a row per
side on fresh buffers, the order reversed from N to N:

* ``direct``: N stateless producers (``buf.producer()``) in ``--processes`` (4)
  processes of N/4 threads (bench/_fanin_worker.py, as bench/fanin.py runs them);
* ``staged``: one staged producer per process (``buf.producer(staging_dir=...)``,
  the local tier's deployment), shared by the process's N/4 threads, REMOTE waited on;
* ``service``: ``--instances`` (2) ``tieredbuf serve`` instances on the same buffer,
  each with its own stage and ``--service-workers`` (1) workers, and N service producers
  (``tieredbuf.service_producer`` listing both instances) in the same processes and
  threads.

Both carry the same load: each producer one ``--record-bytes`` (100 B) record every
``--period-ms`` (100 ms), ``flush_interval`` ``--flush-ms`` (100 ms), for ``--warmup``
+ ``--seconds``.  Per row:

* **store requests/s**: every request the writers sent the store in the measured
  window -- the direct producers' own counts (``Buffer.requests``), the instances'
  ``tieredbuf_store_requests_total`` (``GET /metrics`` at the window's start and end;
  a scrape reads the root, at most once per 5 s: counted with the rest);
* **data PUTs/s**: data objects written; **HTTP requests/s** (service): one per batch,
  retries included;
* **$/month** of those requests at S3 Standard's prices (PUT, COPY, POST, LIST
  $0.005 per 1,000; GET and HEAD $0.0004 per 1,000; 30 days), and per producer;
* **REMOTE p50 / p99**: from ``produce()`` to the handle's REMOTE (writes not REMOTE
  within ``--drain`` s after the window enter as lower bounds, marked ``>=``).

Goals (issue 36): through the service, data PUTs/s flat in N (<= 2 x the commit
budget: 10/s at the default 5); store requests at 64 <= 1/10 of direct's; REMOTE p99
at 256 <= 600 ms.

The machine's load average is printed per row: on a shared box the producers, the
instances and the store share its cores.

Usage::

    python bench/fanin_service.py                       # 16, 64, 256 on file:// (~10 min)
    python bench/fanin_service.py --store moto --producers 64
    python bench/fanin_service.py --smoke               # a few seconds (CI)

Results: a table on stdout and ``bench/results/fanin-service.json``
(``fanin-service-smoke.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import moto_server, percentile, print_table, write_json  # noqa: E402

WORKER = Path(__file__).with_name("_fanin_worker.py")
SECONDS_PER_MONTH = 2_592_000  # 30 days
PUT_CLASS = ("put", "put_conditional", "copy", "list", "delete")
PUT_PER_1000, GET_PER_1000 = 0.005, 0.0004
COMMIT_BUDGET = 5.0


def dollars_per_month(per_s: dict[str, float]) -> float:
    """S3 Standard's request price of ``per_s`` ({"op/kind": requests per second})."""
    put = sum(v for k, v in per_s.items() if k.split("/")[0] in PUT_CLASS)
    get = sum(v for k, v in per_s.items() if k.split("/")[0] not in PUT_CLASS)
    return (put * PUT_PER_1000 + get * GET_PER_1000) / 1000 * SECONDS_PER_MONTH


def _layout(n: int, processes: int) -> list[int]:
    p = max(1, min(n, processes))
    return [n // p + (1 if i < n % p else 0) for i in range(p)]


# --- the service's instances ----------------------------------------------------------


class Instance:
    """One ``tieredbuf serve`` on the buffer, with a stage of its own."""

    def __init__(self, url: str, stage: Path, options: dict[str, Any], args: Any) -> None:
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
            str(args.service_workers),
            "--max-connections",
            "4096",
        ]
        env = dict(os.environ)
        if options:
            cmd += ["--endpoint", options["endpoint"], "--region", options["region"]]
            cmd += ["--allow-http"]
            env["AWS_ACCESS_KEY_ID"] = options["access_key_id"]
            env["AWS_SECRET_ACCESS_KEY"] = options["secret_access_key"]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
            cwd=tempfile.gettempdir(),
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if "listening on http://" not in line:
            self.proc.kill()
            raise RuntimeError(f"tieredbuf serve did not start: {line!r}")
        self.port = int(line.split("http://", 1)[1].split()[0].rsplit(":", 1)[1])
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/readyz", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("tieredbuf serve not ready in 60 s")
            time.sleep(0.05)  # polling readiness against a deadline

    def store_requests(self) -> dict[str, float]:
        """{"op/kind": count} from the instance's /metrics (every worker's)."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == "tieredbuf_store_requests_total" and s.value:
                    key = f"{s.labels['op']}/{s.labels['kind']}"
                    out[key] = out.get(key, 0.0) + s.value
        return out

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(600)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


# --- one row ---------------------------------------------------------------------------


def _run_clients(
    url: str,
    options: dict[str, Any],
    n: int,
    args: Any,
    service: str | None,
    at_window: Any,
    staging: Path | None = None,
) -> tuple[list[dict[str, Any]], float]:
    """Start the producer processes, give them one start time, collect their JSON; calls
    ``at_window(t_begin_wall, t_end_wall)`` once the start is fixed (the service side
    scrapes its instances then).  Returns the outputs and the start's wall time."""
    procs = []
    first = 0
    for i, threads in enumerate(_layout(n, args.processes)):
        cfg = {
            "url": url,
            "store_options": options,
            "service": service,
            "max_in_flight": args.max_in_flight,
            "staging": None if staging is None else str(staging / f"p{i}"),
            "n": n,
            "threads": threads,
            "first_index": first,
            "index": i,
            "name": f"w{i}",
            "rate": COMMIT_BUDGET,
            "period_s": args.period_ms / 1000,
            "flush_ms": args.flush_ms,
            "record_bytes": args.record_bytes,
            "warmup_s": args.warmup,
            "seconds": args.seconds,
            "drain_s": args.drain,
            "close_s": args.close,
        }
        first += threads
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), json.dumps(cfg)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
                cwd=tempfile.gettempdir(),
            )
        )
    for proc in procs:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        if line != "READY":
            for q in procs:
                q.kill()
            err = proc.stderr.read()[-2000:] if proc.stderr else ""
            raise RuntimeError(f"producer process did not start: {line!r} {err}")
    start = time.time() + 1.0
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write(f"{start}\n")
        proc.stdin.flush()
    at_window(start + args.warmup, start + args.warmup + args.seconds)
    outs = []
    limit = args.warmup + args.seconds + args.drain + args.close * 2 + 180
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        if proc.returncode != 0 or not out.strip():
            raise RuntimeError(f"producer process exited {proc.returncode}: {err[-2000:]}")
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs, start


def _latencies(outs: list[dict[str, Any]]) -> dict[str, Any]:
    lat = [x[1] * 1000 for o in outs for x in o["latency"]]
    waited = [w * 1000 for o in outs for w in o["unresolved_waited_s"]]
    values = lat + waited
    return {
        "records": len(lat),
        "unresolved": len(waited),
        "failed": sum(len(o["failed"]) for o in outs),
        "failures": [f for o in outs for f in o["failed"]][:5],
        "latency_ms": {
            "p50": percentile(values, 50),
            "p99": percentile(values, 99),
            "max": max(values, default=float("nan")),
            "lower_bound": bool(waited),
        },
    }


def _per_s(counts: dict[str, float], seconds: float) -> dict[str, float]:
    return {k: v / seconds for k, v in sorted(counts.items()) if v}


def _row(side: str, n: int, per_s: dict[str, float], lat: dict[str, Any]) -> dict[str, Any]:
    total = sum(per_s.values())
    data_puts = sum(v for k, v in per_s.items() if k.endswith("/data") and k.startswith("put"))
    cost = dollars_per_month(per_s)
    return {
        "side": side,
        "producers": n,
        "store_requests_per_s": total,
        "data_puts_per_s": data_puts,
        "dollars_per_month": cost,
        "dollars_per_month_per_producer": cost / n,
        "requests_per_s": per_s,
        **lat,
    }


def direct_row(
    url: str, options: dict[str, Any], n: int, args: Any, staging: Path | None = None
) -> dict[str, Any]:
    """Direct producers: N stateless ones, or (``staging``) one staged producer per
    process shared by its threads."""
    load = os.getloadavg()
    outs, _ = _run_clients(url, options, n, args, None, lambda a, b: None, staging)
    counts: dict[str, float] = {}
    for o in outs:
        begin = {f"{op}/{k}": c for op, k, c in o["begin"]["requests"]}
        for op, k, c in o["end"]["requests"]:
            key = f"{op}/{k}"
            counts[key] = counts.get(key, 0) + c - begin.get(key, 0)
    window = max(o["window_s"] for o in outs)
    side = "direct" if staging is None else "staged"
    row = _row(side, n, _per_s(counts, window), _latencies(outs))
    row["load_average"] = [round(x, 2) for x in (*load, *os.getloadavg())]
    return row


def service_row(
    url: str, options: dict[str, Any], n: int, args: Any, tmp: Path, tag: str
) -> dict[str, Any]:
    load = os.getloadavg()
    instances = [
        Instance(url, tmp / f"stage-{tag}-{i}", options, args) for i in range(args.instances)
    ]
    snaps: dict[str, tuple[float, list[dict[str, float]]]] = {}

    def scrape_at(name: str, wall: float) -> None:
        delay = wall - time.time()
        if delay > 0:
            time.sleep(delay)
        t = time.monotonic()
        snaps[name] = (t, [i.store_requests() for i in instances])

    scrapers: list[threading.Thread] = []

    def at_window(begin: float, end: float) -> None:
        for name, wall in (("begin", begin), ("end", end)):
            t = threading.Thread(target=scrape_at, args=(name, wall), daemon=True)
            t.start()
            scrapers.append(t)

    try:
        outs, _ = _run_clients(url, options, n, args, ",".join(i.url for i in instances), at_window)
        for t in scrapers:
            t.join(timeout=120)
    finally:
        codes = [i.stop() for i in instances]
    counts: dict[str, float] = {}
    (t0, begin), (t1, end) = snaps["begin"], snaps["end"]
    for b, e in zip(begin, end, strict=True):
        for k in set(b) | set(e):
            counts[k] = counts.get(k, 0) + e.get(k, 0) - b.get(k, 0)
    window = t1 - t0
    row = _row("service", n, _per_s(counts, window), _latencies(outs))
    http = sum(o["end"]["http_requests"] - o["begin"]["http_requests"] for o in outs)
    attempts = sum(o["end"]["http_attempts"] - o["begin"]["http_attempts"] for o in outs)
    row["http_requests_per_s"] = http / window
    row["http_attempts_per_s"] = attempts / window
    row["drain_exit_codes"] = codes
    row["load_average"] = [round(x, 2) for x in (*load, *os.getloadavg())]
    return row


# --- report ----------------------------------------------------------------------------


def _ms(row: dict[str, Any], p: str) -> str:
    lat = row["latency_ms"]
    return f"{'>=' if lat['lower_bound'] else ''}{lat[p]:,.0f}"


def report(rows: list[dict[str, Any]]) -> list[str]:
    print_table(
        [
            "N",
            "side",
            "store req/s",
            "data PUT/s",
            "$/month",
            "$/month/producer",
            "HTTP req/s",
            "p50 ms",
            "p99 ms",
            "records",
            "unresolved",
            "failed",
            "load 1m before/after",
        ],
        [
            [
                r["producers"],
                r["side"],
                f"{r['store_requests_per_s']:.1f}",
                f"{r['data_puts_per_s']:.1f}",
                f"{r['dollars_per_month']:,.0f}",
                f"{r['dollars_per_month_per_producer']:.2f}",
                f"{r['http_requests_per_s']:.0f}" if "http_requests_per_s" in r else "-",
                _ms(r, "p50"),
                _ms(r, "p99"),
                r["records"],
                r["unresolved"],
                r["failed"],
                f"{r['load_average'][0]:.2f} / {r['load_average'][3]:.2f}",
            ]
            for r in rows
        ],
    )
    return goals(rows)


def goals(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    svc = {r["producers"]: r for r in rows if r["side"] == "service"}
    direct = {r["producers"]: r for r in rows if r["side"] == "direct"}
    if svc:
        worst = max(r["data_puts_per_s"] for r in svc.values())
        limit = 2 * COMMIT_BUDGET
        spread = ", ".join(f"{n}: {r['data_puts_per_s']:.1f}" for n, r in sorted(svc.items()))
        lines.append(
            f"service data PUTs/s ({spread}) <= 2 x the commit budget ({limit:g}): "
            f"{'met' if worst <= limit else 'MISSED'}"
        )
    if 64 in svc and 64 in direct:
        a, b = svc[64]["store_requests_per_s"], direct[64]["store_requests_per_s"]
        lines.append(
            f"store requests at 64: service {a:.1f}/s vs direct {b:.1f}/s = {a / b:.3f} "
            f"<= 0.1: {'met' if a <= b / 10 else 'MISSED'}"
        )
    if 256 in svc:
        p99 = svc[256]["latency_ms"]["p99"]
        lines.append(
            f"service REMOTE p99 at 256 {p99:.0f} ms <= 600: {'met' if p99 <= 600 else 'MISSED'}"
        )
    return lines


# --- driver ----------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="a few seconds: 4 producers, file://")
    p.add_argument("--store", choices=("file", "moto"), default="file")
    p.add_argument("--producers", default="16,64,256")
    p.add_argument("--sides", default="direct,staged,service", help="direct, staged, service")
    p.add_argument("--processes", type=int, default=4)
    p.add_argument("--instances", type=int, default=2, help="service instances on the buffer")
    p.add_argument("--service-workers", type=int, default=1, help="workers per instance")
    p.add_argument(
        "--max-in-flight",
        type=int,
        default=None,
        help="each service producer's max_in_flight (default: the client's default)",
    )
    p.add_argument("--period-ms", type=float, default=100.0)
    p.add_argument("--flush-ms", type=float, default=100.0)
    p.add_argument("--record-bytes", type=int, default=100)
    p.add_argument("--warmup", type=float, default=4.0)
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--drain", type=float, default=60.0)
    p.add_argument("--close", type=float, default=60.0)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.smoke:
        a.producers, a.warmup, a.seconds, a.drain, a.processes = "4", 1.0, 3.0, 20.0, 2
    a.producers = [int(x) for x in a.producers.split(",") if x]
    a.sides = [s for s in a.sides.split(",") if s]
    a.out = a.out or ("fanin-service-smoke" if a.smoke else "fanin-service")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    load = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="tb-fanin-svc-"))
    rows: list[dict[str, Any]] = []
    try:
        with ExitStack() as stack:
            if args.store == "moto":
                ep = stack.enter_context(moto_server())
                base, options = f"s3://{ep.new_bucket('fanin-svc')}", ep.options()
            else:
                base, options = f"file://{tmp}/store", {}
            for k, n in enumerate(args.producers):
                sides = args.sides if k % 2 == 0 else args.sides[::-1]
                for side in sides:
                    url = f"{base}/n{n}-{side}"
                    print(f"[N={n} {side}] ...", flush=True)
                    if side == "direct":
                        row = direct_row(url, options, n, args)
                    elif side == "staged":
                        row = direct_row(url, options, n, args, tmp / f"staged-n{n}")
                    else:
                        row = service_row(url, options, n, args, tmp, f"n{n}")
                    print(
                        f"  store req/s {row['store_requests_per_s']:.1f}, data PUT/s "
                        f"{row['data_puts_per_s']:.1f}, p50 {_ms(row, 'p50')} p99 "
                        f"{_ms(row, 'p99')} ms, load {row['load_average'][3]:.2f}",
                        flush=True,
                    )
                    rows.append(row)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print()
    print(
        f"one {args.record_bytes} B record per producer every {args.period_ms:g} ms, "
        f"flush_interval {args.flush_ms:g} ms, {args.warmup:g} s warm-up, {args.seconds:g} s "
        f"measured, {args.processes} producer processes, store {args.store}; service: "
        f"{args.instances} instance(s) x {args.service_workers} worker(s); load average before "
        + " ".join(f"{x:.2f}" for x in load)
    )
    lines = report(rows)
    print()
    for line in lines:
        print("goal: " + line)
    path = write_json(
        args.out,
        {
            "benchmark": "fanin-service",
            "config": vars(args),
            "load_average_before": load,
            "rows": rows,
            "goals": lines,
            "seconds": time.perf_counter() - started,
        },
    )
    print(f"results: {path} ({time.perf_counter() - started:.0f} s)")
    return 1 if any(r["failed"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
