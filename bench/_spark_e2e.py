"""End to end into Spark: produce() -> foreachBatch latency, for bench/spark_read.py.

Rows, each on a fresh buffer with a fresh streaming query (``startingOffsets``
latest, ``processingTime`` 0, ``foreachBatch`` collecting the values on the driver):

* **busy**, for each N of ``--latency-producers`` (1, 16): N stateless producers
  with the library's defaults (``flush_interval`` 100 ms, ``manifest_writes_per_s``
  5), in ``min(N, --latency-processes)`` processes (16 = 4 processes x 4 threads,
  one Buffer per process, as bench/fanin.py runs them: the processes' writes meet in
  fan-in's cross-process commit), each producing one record at a time:
  ``produce()``, wait for REMOTE, pause ``--latency-pause-ms`` (200), for
  ``--latency-records`` (30) records, the producers' phases spread over the pause;
* **idle**, for each cap of ``--idle-caps`` (the default ``idlePollMaxMs``, 2000,
  and 200): one producer, each of ``--idle-records`` (8) records produced after
  ``--idle-s`` (5) + U(0, 2) s of nothing (the uniform part spreads the record over
  the reader's backoff phase: the default cap is 2 s).

A record carries the wall-clock time just before its ``produce()``; its latency is the
time its micro-batch's rows were collected in ``foreachBatch`` less that (one host,
one clock).  Each producer's first record is dropped (its process's first commit, the
query's first micro-batch with data).  Beside it: the same records' produce ->
REMOTE, from the producer processes.

Idle requests.  The query's own reader runs in Spark's Python streaming-source
process, so its Buffer's request counter is out of reach here; in the idle rows a
shadow reader -- the same ``tieredbuf.spark.stream.StreamReader`` with the same
options, in this process, asked for its latest offset every 10 ms as Spark's
``pollingDelay`` asks the real one -- counts the footer GETs (ranged GETs of the root)
between 1 s after a record's arrival and the next record's ``produce()`` (the
producer's commit hub is quiet by then); with ``--s3`` the moto server counts what the
real query sent in the same windows (the server's count less the shadow's).  The
steady idle rate is ``60,000 / idlePollMaxMs`` footer GETs a minute once the backoff
(0.1 s doubling to the cap) has reached the cap.

``python bench/_spark_e2e.py CONFIG_JSON`` is one producer process (it prints READY,
reads the wall-clock start from stdin and prints one JSON line).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import select
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _common import percentile, print_table

ROOT = Path(__file__).resolve().parents[1]
POLLING_DELAY_S = 0.01
"""spark.sql.streaming.pollingDelay's default: how often Spark asks an idle source."""
DEFAULT_CAP_MS = 2000
"""idlePollMaxMs's default (tieredbuf/spark/options.py IDLE_POLL_MAX_MS)."""
QUIET_AFTER_ARRIVAL_S = 1.0
IDLE_RAMP_S = 5.0
"""The steady tail is counted from this long after the last arrival: the backoff has
reached the default cap by then (0.1 + 0.2 + 0.4 + 0.8 + 1.6 s)."""
"""An idle window starts this long after a record's arrival (the producer's hub and
the query's micro-batch are done by then)."""


# --- a producer process -----------------------------------------------------------------


def _worker() -> None:
    cfg = json.loads(sys.argv[1])
    import tieredbuf

    buf = tieredbuf.open(cfg["url"], **cfg["store_options"])
    producers = [buf.producer() for _ in range(cfg["threads"])]  # the library's defaults
    print("READY", flush=True)
    start = float(sys.stdin.readline())
    t_start = time.monotonic() + (start - time.time())
    out: list[list[Any]] = []
    lock = threading.Lock()
    stop = threading.Event()
    done = [threading.Event() for _ in producers]

    def run(k: int) -> None:
        g = cfg["first_index"] + k
        rng = random.Random(cfg["seed"] * 1000 + g)
        p = producers[k]
        at = t_start + g / cfg["n"] * cfg["pause_s"]
        i = 0
        while i < cfg["records"] or not stop.is_set():
            if i == cfg["records"]:
                done[k].set()  # the rest are the tail: untimed, until every process is done
                if not cfg["tail"]:
                    stop.wait()
                    return
            if cfg["idle_s"]:
                at += cfg["idle_s"] + rng.uniform(0.0, cfg["jitter_s"])
            if stop.wait(max(0.0, at - time.monotonic())) and i >= cfg["records"]:
                return
            sent = time.time()
            h = p.produce([b"%d:%d:%.6f" % (g, i, sent)])
            err = None
            try:
                h.wait(tieredbuf.Durability.REMOTE, timeout=cfg["timeout_s"])
                remote = time.time() - sent
            except Exception as e:  # reported: never a latency
                remote, err = None, repr(e)[:200]
            with lock:
                out.append([g, i, sent, remote, err])
            at = time.monotonic() + cfg["pause_s"]
            i += 1
        done[k].set()

    threads = [threading.Thread(target=run, args=(k,)) for k in range(cfg["threads"])]
    for t in threads:
        t.start()
    for d in done:
        d.wait()
    # every producer keeps producing (the untimed tail) until every process has produced
    # its timed records: one that went quiet early would leave the others' last records
    # to a commit hand-over instead of the steady state measured here
    print("DONE", flush=True)
    sys.stdin.readline()
    stop.set()
    for t in threads:
        t.join()
    for p in producers:
        p.close(timeout=30)
    print(json.dumps({"records": out, "tieredbuf": tieredbuf.__file__}), flush=True)
    buf.close()


def _run_producers(
    url: str, store_options: dict[str, Any], n: int, cfg: dict[str, Any], processes: int
) -> list[list[Any]]:
    """N producers in min(N, processes) processes; every record they produced."""
    nproc = max(1, min(n, processes))
    layout = [n // nproc + (1 if i < n % nproc else 0) for i in range(nproc)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this tree's tieredbuf
    procs, first = [], 0
    for threads in layout:
        c = {
            **cfg,
            "url": url,
            "store_options": store_options,
            "n": n,
            "threads": threads,
            "first_index": first,
        }
        first += threads
        procs.append(
            subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), json.dumps(c)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
                cwd=tempfile.gettempdir(),
            )
        )
    limit = (
        cfg["records"] * (cfg["idle_s"] + cfg["jitter_s"] + cfg["pause_s"] + cfg["timeout_s"]) + 60
    )
    try:
        _expect(procs, "READY", 120)
        _tell(procs, f"{time.time() + 0.5}")  # the start, shared by every process
        _expect(procs, "DONE", limit)
        _tell(procs, "CLOSE")
        records: list[list[Any]] = []
        for p in procs:
            out, _ = p.communicate(timeout=120)
            if p.returncode != 0 or not out.strip():
                raise RuntimeError(f"a producer process exited with {p.returncode}")
            got = json.loads(out.strip().splitlines()[-1])
            if Path(got["tieredbuf"]).resolve().parents[1] != ROOT:
                raise RuntimeError(f"a producer imported {got['tieredbuf']}, not {ROOT}'s")
            records.extend(got["records"])
        return records
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _expect(procs: list[subprocess.Popen[str]], word: str, timeout: float) -> None:
    """Wait (up to ``timeout`` s) for every process's next line to be ``word``."""
    deadline = time.monotonic() + timeout
    for p in procs:
        assert p.stdout is not None
        ready, _, _ = select.select([p.stdout], [], [], max(0.0, deadline - time.monotonic()))
        line = p.stdout.readline().strip() if ready else "(nothing in time)"
        if line != word:
            raise RuntimeError(f"a producer process said {line!r}, not {word}")


def _tell(procs: list[subprocess.Popen[str]], line: str) -> None:
    for p in procs:
        assert p.stdin is not None
        p.stdin.write(f"{line}\n")
        p.stdin.flush()


# --- the idle requests --------------------------------------------------------------------


class _Idle:
    """The shadow reader (see the module docstring) and a sampler of footer-read counts:
    the shadow's, and with a recording server the server's."""

    def __init__(self, opts: dict[str, str], rec: Any) -> None:
        from tieredbuf.spark import options as opt
        from tieredbuf.spark.executor import shared_buffer
        from tieredbuf.spark.source import records_struct
        from tieredbuf.spark.stream import StreamReader

        ro = opt.parse_read_options(opts)
        self.reader = StreamReader(ro, records_struct())
        self.buf = shared_buffer(ro.url, ro.store)
        self.rec = rec
        self.samples: list[tuple[float, int, int]] = []  # (time, shadow's, server's)
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._poll, daemon=True),
            threading.Thread(target=self._sample, daemon=True),
        ]

    def _footers(self) -> tuple[int, int]:
        mine = self.buf.requests.total("get_range", "root")
        seen = self.rec.seen[("get_range", "root")] if self.rec is not None else 0
        return mine, seen

    def _poll(self) -> None:
        from pyspark.sql.streaming.datasource import ReadAllAvailable

        offset = self.reader.initialOffset()
        while not self._stop.wait(POLLING_DELAY_S):
            try:
                offset = self.reader.latestOffset(offset, ReadAllAvailable())
            except Exception as e:  # reported; the shadow stops
                self.errors.append(repr(e)[:200])
                return

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            self.samples.append((time.time(), *self._footers()))

    def __enter__(self) -> _Idle:
        self.samples.append((time.time(), *self._footers()))
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=10)

    def at(self, t: float) -> tuple[int, int]:
        """The counts of the last sample at or before ``t``."""
        best = self.samples[0]
        for s in self.samples:
            if s[0] > t:
                break
            best = s
        return best[1], best[2]


# --- the rows -------------------------------------------------------------------------


def _row(
    spark: Any,
    work: Path,
    name: str,
    url: str,
    store: dict[str, Any],
    rec: Any,
    n: int,
    cap: int | None,
    cfg: dict[str, Any],
    processes: int,
) -> dict[str, Any]:
    import tieredbuf

    tieredbuf.open(url, **store).create()
    opts = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in store.items()}
    opts["startingOffsets"] = "latest"
    if cap is not None:
        opts["idlePollMaxMs"] = str(cap)
    cond = threading.Condition()
    arrivals: dict[tuple[int, int], tuple[float, float]] = {}
    batches: list[tuple[int, int, float]] = []
    dups: list[tuple[int, int]] = []

    def sink(df: Any, batch_id: int) -> None:
        entered = time.time()
        rows = df.select("value").collect()
        got = time.time()
        with cond:
            batches.append((batch_id, len(rows), got - entered))
            for r in rows:
                g, i, _ = bytes(r.value).split(b":")
                key = (int(g), int(i))
                if key in arrivals:
                    dups.append(key)
                arrivals[key] = (entered, got)
            cond.notify_all()

    q = (
        spark.readStream.format("tieredbuf")
        .options(**opts)
        .load(url)
        .writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(work / "checkpoint"))
        .trigger(processingTime="0 seconds")
        .start()
    )
    idle: _Idle | None = None
    load = os.getloadavg()[0]
    try:
        q.processAllAvailable()  # the query is at the tail before anything is produced
        if cfg["idle_s"]:
            idle = _Idle({**opts, "path": url}, rec).__enter__()
        records = _run_producers(url, store, n, cfg, processes)
        ok = {(g, i) for g, i, _, remote, err in records if err is None}
        with cond:
            cond.wait_for(lambda: ok <= arrivals.keys(), timeout=60)
            arrived = dict(arrivals)
        if idle is not None and arrived:  # the idle tail: nothing produced, the query runs
            tail_end = max(a[1] for a in arrived.values()) + cfg["tail_s"]
            threading.Event().wait(max(0.0, tail_end - time.time()))
        progress = _batch_durations(q.recentProgress)
    finally:
        if idle is not None:
            idle.__exit__(None, None, None)
        q.stop()
    # each producer's first record dropped, and the untimed tail
    timed = [r for r in records if 0 < r[1] < cfg["records"] and r[4] is None]
    e2e = sorted(
        (arrived[(g, i)][1] - sent) * 1000 for g, i, sent, _, _ in timed if (g, i) in arrived
    )
    entry = sorted(
        (arrived[(g, i)][0] - sent) * 1000 for g, i, sent, _, _ in timed if (g, i) in arrived
    )
    remote = sorted(r[3] * 1000 for r in timed)
    out: dict[str, Any] = {
        "row": name,
        "producers": n,
        "processes": max(1, min(n, processes)),
        "idle_poll_max_ms": cap if cap is not None else DEFAULT_CAP_MS,
        "idle_s": cfg["idle_s"],
        "idle_jitter_s": cfg["jitter_s"] if cfg["idle_s"] else 0,
        "produced": len(records),
        "failed": sum(1 for r in records if r[4] is not None),
        "received": len(arrived),
        "duplicates": len(dups),
        "missing": len({(g, i) for g, i, *_ in records} - arrived.keys()),
        "timed": len(e2e),
        "tail_records": sum(1 for r in records if r[1] >= cfg["records"]),
        "micro_batches": len(batches),
        "load_avg_1m": round(load, 2),
        "e2e_ms": _pcts(e2e),
        "foreach_batch_entry_ms": _pcts(entry),
        "remote_ms": _pcts(remote),
        "spark_batch_duration_ms_p50": progress,
        # every record: producer, index, produced at (wall s), REMOTE s, error, and when
        # its micro-batch entered foreachBatch and had the rows collected (wall s)
        "records": [[*r, *arrived.get((r[0], r[1]), (None, None))] for r in records],
        "batch_collect_ms_p50": round(percentile([b[2] * 1000 for b in batches], 50), 1)
        if batches
        else None,
    }
    if idle is not None:
        out["idle_requests"] = _idle_counts(idle, records, arrived, cap, cfg["tail_s"])
    return out


def _idle_counts(
    idle: _Idle,
    records: list[list[Any]],
    arrived: dict[tuple[int, int], tuple[float, float]],
    cap: int | None,
    tail_s: float,
) -> dict[str, Any]:
    """Footer GETs in the idle spells (from 1 s after a record's arrival to the next
    record's produce(); one producer, its records in order), and in the steady tail
    (from ``IDLE_RAMP_S`` after the last arrival to ``tail_s`` after it)."""
    recs = sorted(records, key=lambda r: r[1])
    spells: list[tuple[float, float]] = []
    for prev, nxt in itertools.pairwise(recs):
        if (prev[0], prev[1]) in arrived:
            lo = arrived[(prev[0], prev[1])][1] + QUIET_AFTER_ARRIVAL_S
            if nxt[2] > lo:
                spells.append((lo, nxt[2]))
    last = max(a[1] for a in arrived.values())

    def count(windows: list[tuple[float, float]]) -> dict[str, Any]:
        seconds = 0.0
        shadow = server = 0
        for lo, hi in windows:
            (a0, b0), (a1, b1) = idle.at(lo), idle.at(hi)
            seconds += hi - lo
            shadow += a1 - a0
            server += b1 - b0
        out: dict[str, Any] = {
            "windows": len(windows),
            "seconds": round(seconds, 1),
            "shadow_footer_gets": shadow,
            "shadow_per_min": round(shadow * 60 / seconds, 1) if seconds else None,
        }
        if idle.rec is not None:  # the real query's: the server's count less the shadow's
            out["spark_footer_gets"] = server - shadow
            out["spark_per_min"] = round((server - shadow) * 60 / seconds, 1) if seconds else None
        return out

    tail = [(last + IDLE_RAMP_S, last + tail_s)] if tail_s > IDLE_RAMP_S else []
    return {
        "spells": count(spells),
        "steady_tail": count(tail),
        "steady_formula_per_min": round(60_000 / (cap or DEFAULT_CAP_MS), 1),
        "shadow_errors": idle.errors,
    }


def _batch_durations(progress: list[Any]) -> dict[str, float]:
    """The p50 of each part of Spark's trigger (its progress's durationMs: latestOffset,
    walCommit, queryPlanning, addBatch (foreachBatch), triggerExecution, ...) over the
    micro-batches that read rows (Spark keeps the last 100 progress reports)."""
    parts: dict[str, list[float]] = {}
    for p in progress:
        d = p if isinstance(p, dict) else json.loads(p.json)
        if (d.get("numInputRows") or 0) > 0:
            for k, v in d.get("durationMs", {}).items():
                parts.setdefault(k, []).append(float(v))
    return {k: round(percentile(v, 50), 1) for k, v in sorted(parts.items())}


def _pcts(xs: list[float]) -> dict[str, float | int]:
    if not xs:
        return {"n": 0}
    return {
        "n": len(xs),
        **{f"p{p}": round(percentile(xs, p), 1) for p in (50, 90, 99)},
        "max": round(max(xs), 1),
    }


def run(spark: Any, work: Path, ep: Any, rec: Any, args: Any) -> dict[str, Any]:
    """Every row of the module docstring; ``ep``: an S3 endpoint (a bucket per row) or
    None (a local directory); ``rec``: the server's request recorder or None."""
    base = {
        "records": args.latency_records,
        "pause_s": args.latency_pause_ms / 1000,
        "idle_s": 0.0,
        "jitter_s": 0.0,
        "tail_s": 0.0,
        "tail": True,
        "timeout_s": 60.0,
        "seed": 18,
    }
    plan: list[tuple[str, int, int | None, dict[str, Any]]] = [
        (f"busy-{n}", n, None, base) for n in args.latency_producers
    ]
    idle_cfg = {
        **base,
        "records": args.idle_records,
        "pause_s": 0.0,
        "idle_s": args.idle_s,
        "jitter_s": DEFAULT_CAP_MS / 1000,
        "tail_s": args.idle_tail_s,
        "tail": False,
    }
    plan += [(f"idle-{cap or DEFAULT_CAP_MS}", 1, cap, idle_cfg) for cap in args.idle_caps]
    # warm-up, not reported: the session's first micro-batch with data starts the
    # executors' Python workers (seconds; reused by every later query)
    plan.insert(0, ("warmup", 1, None, {**base, "records": 3}))
    rows = []
    for k, (name, n, cap, cfg) in enumerate(plan):
        work_k = work / f"e2e-{k}"  # every row its own buffer and checkpoint
        if ep is None:
            url, store = f"file://{work_k}/buf", {}
        else:
            bucket = ep.new_bucket()
            if rec is not None:
                rec.bucket, rec.prefix = bucket, "buf/"
            url, store = f"s3://{bucket}/buf", ep.options()
        print(f"[e2e {name}] ...", flush=True)
        rows.append(_row(spark, work_k, name, url, store, rec, n, cap, cfg, args.latency_processes))
    warmup = rows.pop(0)
    report(rows)
    return {
        "warmup": warmup,
        "note": "produce() -> REMOTE (the library's default flush_interval 100 ms and "
        "manifest_writes_per_s 5) -> Spark trigger (processingTime 0) -> micro-batch -> "
        "rows collected in foreachBatch on the driver; each producer's first record "
        "dropped; see bench/_spark_e2e.py",
        "rows": rows,
    }


def report(rows: list[dict[str, Any]]) -> None:
    def ms(d: dict[str, Any]) -> str:
        if not d.get("n"):
            return "-"
        return f"{d['p50']:.0f} / {d['p90']:.0f} / {d['p99']:.0f} / {d['max']:.0f}"

    def gets(r: dict[str, Any], part: str) -> str:
        if "idle_requests" not in r:
            return "-"
        c = r["idle_requests"][part]
        spark = f" ({c['spark_per_min']:g})" if c.get("spark_per_min") is not None else ""
        return "-" if c["shadow_per_min"] is None else f"{c['shadow_per_min']:g}{spark}"

    print()
    print(
        "produce() -> rows collected in foreachBatch, ms (p50 / p90 / p99 / max), each "
        "producer's first record dropped; footer GETs a minute while idle: the shadow "
        "reader's (the real query's, counted by the server), in the spells between records "
        "and in the steady tail, beside 60,000 / idlePollMaxMs"
    )
    print_table(
        [
            "row",
            "N (procs)",
            "idlePollMaxMs",
            "timed (+untimed)",
            "e2e",
            "foreachBatch entry",
            "REMOTE",
            "batches",
            "GETs/min spells",
            "GETs/min tail",
            "formula",
            "load",
        ],
        [
            [
                r["row"],
                f"{r['producers']} ({r['processes']})",
                r["idle_poll_max_ms"],
                f"{r['timed']} (+{r['produced'] - r['timed']})",
                ms(r["e2e_ms"]),
                ms(r["foreach_batch_entry_ms"]),
                ms(r["remote_ms"]),
                r["micro_batches"],
                gets(r, "spells"),
                gets(r, "steady_tail"),
                r["idle_requests"]["steady_formula_per_min"] if "idle_requests" in r else "-",
                r["load_avg_1m"],
            ]
            for r in rows
        ],
    )
    bad = [r["row"] for r in rows if r["missing"] or r["duplicates"] or r["failed"]]
    if bad:
        print(f"MISSING, DUPLICATED OR FAILED RECORDS in {bad}")


if __name__ == "__main__":
    _worker()
