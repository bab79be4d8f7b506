"""Peers benchmark: tieredbuf against what a user would pick instead, in one run.

On one machine, in one run, each side writes the same records (100 B, 1 KiB and
64 KiB) to the same stores -- a directory on this disk ("local") and a moto S3
server over HTTP on loopback ("moto", in a child process; moto keeps objects in
RAM) -- and reports:

1. Throughput: ``--threads`` threads (or asyncio tasks) per writer process call the
   side's write API with ``batch`` records per call (100 at 100 B and 1 KiB, 4 at
   64 KiB) for ``--seconds`` or until ``--budget-mib``; asynchronous APIs keep up to
   ``--window`` calls in flight per thread.  The clock stops at the last ack.
   records/s and MiB/s.
2. Ack latency: one writer puts one record at a time at a steady ``--rate``; each
   put -> durable-ack time, p50 and p99 (the first ``--warmup`` seconds dropped).
   Synchronous APIs that take longer than the schedule allows fall behind: the
   achieved rate is reported beside the figure.

The sides (``--systems``):

* ``persist-queue``: its SQLiteQueue, local only; one commit per put().
* ``slatedb``: ``db.write(WriteBatch)`` and ``await handle.await_durable()``,
  local (``file://``) and on moto; flush_interval = ``--remote-flush-ms``.
* ``slatedb-memmove`` (diagnostic): the same, with the binding's byte-by-byte Python
  copy of every value (UniFFI-generated, slatedb 0.17) replaced by one memmove: the
  engine without that copy.  No released package behaves like this row.
* ``deltalake``: ``write_deltalake(mode="append")`` from 1 and 4 writer processes
  (``deltalake-4w``), local and on moto.
* ``tieredbuf-direct``: the stateless producer (REMOTE acks), flush_interval =
  ``--remote-flush-ms``; local (``file://`` store) and on moto.
* ``tieredbuf-staged``: the staged producer (WAL group commit every 25 ms -> LOCAL;
  segments sealed after ``--remote-flush-ms`` and exported -> REMOTE); both acks are
  timed in the same run.  Local (``file://`` store on the same disk) and on moto.

What an ack means differs by side and store; the table says which rows are
comparable (DURABILITY below).  ``--strace`` (on by default where strace is
installed) checks it: each local side makes N acknowledged single-record writes
under ``strace -f -c -e trace=fsync,fdatasync,sync_file_range`` and the sync
calls per ack (N writes minus a run of 0) are printed and saved.

Every case runs in fresh worker processes (``--_worker``), one moto server per
(side, record size).  Run it under the shared lock, and read the load average
printed with the figures (this is a shared 2-core machine)::

    flock /tmp/tieredbuf-bench.lock .venv/bin/python bench/peers.py           # ~6-8 min
    flock /tmp/tieredbuf-bench.lock .venv/bin/python bench/peers.py --quick   # ~2-3 min
    .venv/bin/python bench/peers.py --systems slatedb,tieredbuf-direct --sizes 1024

Needs the ``bench`` extra (``pip install -e ".[bench]"``).  Results: tables on
stdout and ``bench/results/peers.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

from _common import moto_server, print_table, summarize, write_json

MiB = 1 << 20
SYSTEMS = (
    "persist-queue",
    "slatedb",
    "slatedb-memmove",
    "deltalake",
    "deltalake-4w",
    "tieredbuf-direct",
    "tieredbuf-staged",
)
STORES: dict[str, tuple[str, ...]] = {
    "persist-queue": ("local",),
    "slatedb": ("local", "moto"),
    "slatedb-memmove": ("local", "moto"),
    "deltalake": ("local", "moto"),
    "deltalake-4w": ("local", "moto"),
    "tieredbuf-direct": ("local", "moto"),
    "tieredbuf-staged": ("local", "moto"),
}
SYNC_CALLS = "fsync,fdatasync,sync_file_range"

# (side, store, level) -> (class, what an ack means).  Classes: "local-fsync" (on this
# disk, fdatasync/fsync before the ack), "local-pagecache" (on this disk, acked from the
# page cache: lost on power failure / kernel crash), "remote" (in the object store; moto
# keeps it in RAM, a real S3 would have it replicated).
LOCAL_FSYNC, LOCAL_CACHE, REMOTE = "local-fsync", "local-pagecache", "remote"
DURABILITY: dict[tuple[str, str, str], tuple[str, str]] = {
    ("persist-queue", "local", "ack"): (
        LOCAL_FSYNC,
        "put() returns after its own SQLite commit; SQLite in WAL mode with "
        "the default synchronous=FULL fdatasyncs the WAL file on every commit (no group "
        "commit: one fdatasync per put)",
    ),
    ("slatedb", "local", "ack"): (
        LOCAL_CACHE,
        "await_durable() returns once the WAL SST holding the write is "
        "written through object_store's LocalFileSystem (write + rename): no fsync, "
        "so it is in the page cache only",
    ),
    ("slatedb", "moto", "ack"): (
        REMOTE,
        "await_durable() returns once the WAL SST holding the write is PUT to "
        "the bucket (flush_interval group commit)",
    ),
    ("deltalake", "local", "ack"): (
        LOCAL_CACHE,
        "write_deltalake() returns after the Parquet file is written and "
        "the commit JSON is linked into _delta_log (write + link/rename): no fsync",
    ),
    ("deltalake", "moto", "ack"): (
        REMOTE,
        "write_deltalake() returns after the Parquet PUT and the commit JSON "
        "written put-if-absent (delta-rs 1.x: conditional PUT, no lock provider; retried "
        "on a version conflict)",
    ),
    ("tieredbuf-direct", "local", "ack"): (
        LOCAL_FSYNC,
        "REMOTE on the local-directory store: the data object and the "
        "manifest are each written to a temp file, fsynced, renamed into place and the "
        "directory fsynced before the ack (batched every flush_interval)",
    ),
    ("tieredbuf-direct", "moto", "ack"): (
        REMOTE,
        "REMOTE: data object PUT (If-None-Match), then the buffer's next commit (at "
        "most 5 a second): a LIST of queue/pending/ and the root replaced by CAS "
        "(If-Match); a batch is cut flush_interval after its first record",
    ),
    ("tieredbuf-staged", "local", "LOCAL"): (
        LOCAL_FSYNC,
        "LOCAL: the WAL fdatasync covering the write returned (group "
        "commit every 25 ms); the exporter to the same disk runs meanwhile",
    ),
    ("tieredbuf-staged", "local", "REMOTE"): (
        LOCAL_FSYNC,
        "REMOTE on the local-directory store: segment sealed (fdatasync), "
        "exported (a hard link into the store), manifest CAS fsynced",
    ),
    ("tieredbuf-staged", "moto", "LOCAL"): (
        LOCAL_FSYNC,
        "LOCAL: the WAL fdatasync covering the write returned (group "
        "commit every 25 ms); the exporter uploads to moto meanwhile",
    ),
    ("tieredbuf-staged", "moto", "REMOTE"): (
        REMOTE,
        "REMOTE: WAL fdatasync, segment sealed, uploaded (If-None-Match) and "
        "appended by the buffer's next commit (root CAS, If-Match)",
    ),
}
CLASS_TITLE = {
    LOCAL_FSYNC: "local disk, fsync/fdatasync before the ack",
    LOCAL_CACHE: "local disk, page cache only (no fsync)",
    REMOTE: "object store (moto on loopback, objects in RAM)",
}


def adapter_name(system: str) -> str:
    """The adapter and durability entry a side uses (variants share their system's)."""
    return {"deltalake-4w": "deltalake", "slatedb-memmove": "slatedb"}.get(system, system)


def levels_of(system: str) -> tuple[str, ...]:
    from _peers_sides import LEVELS

    return LEVELS[adapter_name(system)]


# --- the worker process ---------------------------------------------------------------------


def worker_main(spec: dict[str, Any]) -> None:
    """Run one mode of one side; print READY, wait for 'GO <start>', print RESULT json."""
    import _peers_sides as sides

    mode = spec["mode"]
    out: dict[str, Any] = {}
    if mode == "setup":
        sides.delta_setup(spec)
    elif mode == "count":
        out["count"] = sides.delta_count(spec)
    else:
        side = sides.SIDES[spec["system"]](spec)
        if mode in ("throughput", "latency"):
            # one untimed call of the measured shape: no side pays its cold start
            # (deltalake's first append in a process takes ~1 s) inside the clock
            warm = sides.records_for(spec["worker"], 99, spec["batch"], spec["size"])
            side.warm(warm)
            spec["warm_records"] = len(warm)
        print("READY", flush=True)
        start = float(sys.stdin.readline().split()[1])
        if mode == "throughput":
            out = side.throughput(spec, start, start + spec["seconds"])
            if spec["verify"] and hasattr(side, "count"):
                n, expected = side.count(), out["records"] + spec["warm_records"]
                if n != expected:
                    raise AssertionError(f"{spec['system']} holds {n} records, expected {expected}")
                out["verified"] = "read back"
        elif mode == "latency":
            out = side.latency(spec, start)
        elif mode == "probe":
            side.probe(spec, spec["probe_n"])
        else:
            raise ValueError(mode)
        out["start"] = start
        side.close()
    print("RESULT " + json.dumps(out), flush=True)


def run_workers(
    spec: dict[str, Any], mode: str, procs: int, prefix: list[str] | None = None
) -> list[dict[str, Any]]:
    """Start ``procs`` workers, let them set up, start them together, collect results."""
    ws = []
    for i in range(procs):
        arg = json.dumps({**spec, "mode": mode, "worker": i})
        ws.append(
            subprocess.Popen(
                [*(prefix or []), sys.executable, __file__, "--_worker", arg],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
        )
    try:
        if mode not in ("setup", "count"):
            for w in ws:
                assert w.stdout is not None
                line = w.stdout.readline().strip()
                if line != "READY":
                    raise RuntimeError(f"{spec['system']} worker did not start ({line!r})")
            start = time.monotonic() + 0.3
            for w in ws:
                assert w.stdin is not None
                w.stdin.write(f"GO {start}\n")
                w.stdin.flush()
        results = []
        for w in ws:
            assert w.stdout is not None
            lines = w.stdout.read().splitlines()
            rc = w.wait()
            got = [json.loads(x[7:]) for x in lines if x.startswith("RESULT ")]
            if rc != 0 or not got:
                raise RuntimeError(f"{spec['system']} {mode} worker failed (exit {rc})")
            results.append(got[0])
        return results
    finally:
        for w in ws:
            if w.poll() is None:
                w.kill()
                w.wait()


# --- the driver -------------------------------------------------------------------------------


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def batch_for(size: int, args: argparse.Namespace) -> int:
    return args.batch_64k if size >= 65536 else args.batch


def case_spec(
    system: str,
    store: str,
    size: int,
    args: argparse.Namespace,
    d: Path,
    s3: dict[str, str] | None,
    part: str = "throughput",
) -> dict[str, Any]:
    procs = 4 if system == "deltalake-4w" else 1
    # deltalake: one writer per process (threads in one process would only be more
    # writers racing for the same commit versions)
    threads = 1 if adapter_name(system) == "deltalake" else args.threads
    return {
        "system": adapter_name(system),
        "store": store,
        "size": size,
        "dir": str(d),
        "s3": s3,
        "threads": threads,
        "window": args.window,
        "batch": batch_for(size, args),
        "seconds": args.seconds if part == "throughput" else args.seconds_lat,
        "budget_bytes": args.budget_mib * MiB // procs,
        "rate": args.rate / procs,
        "warmup": args.warmup,
        "remote_flush_ms": args.remote_flush_ms,
        "verify": args.verify,
        "probe_n": args.probe_n,
        "procs": procs,
        "slatedb_memmove": system == "slatedb-memmove",
    }


def throughput_case(spec: dict[str, Any], system: str) -> dict[str, Any]:
    procs = spec["procs"]
    if spec["system"] == "deltalake":
        run_workers(spec, "setup", 1)
    res = run_workers(spec, "throughput", procs)
    start = res[0]["start"]
    records = sum(r["records"] for r in res)
    warm = procs * spec["batch"]
    out: dict[str, Any] = {
        "records": records,
        "bytes": records * spec["size"],
        "workers": res,
        "levels": {},
    }
    for lv in levels_of(system):
        secs = max(r["end"][lv] for r in res) - start
        out["levels"][lv] = {
            "seconds": secs,
            "records_per_s": records / secs,
            "mib_per_s": records * spec["size"] / MiB / secs,
        }
    if spec["system"] == "deltalake":
        n = run_workers(spec, "count", 1)[0]["count"]
        if n != records + warm:
            raise AssertionError(f"delta table holds {n} rows, expected {records + warm}")
        out["verified"] = "table count"
    return out


def latency_case(spec: dict[str, Any], system: str) -> dict[str, Any]:
    if spec["system"] == "deltalake":
        run_workers(spec, "setup", 1)
    res = run_workers(spec, "latency", spec["procs"])
    lv_out = {}
    for lv in levels_of(system):
        lv_out[lv] = summarize([x for r in res for x in r["latency_ms"][lv]])
    return {
        "levels": lv_out,
        "target_rate": spec["rate"] * spec["procs"],
        "achieved_rate": sum(r["achieved_rate"] for r in res),
        "behind_schedule_ms": summarize([x for r in res for x in r["behind_ms"]]),
    }


def parse_strace(path: Path) -> dict[str, int]:
    """The calls column of ``strace -c`` output, by syscall."""
    counts: dict[str, int] = {}
    for line in path.read_text().splitlines():
        f = line.split()
        if len(f) >= 5 and f[-1] not in ("total", "syscall") and f[3].isdigit():
            counts[f[-1]] = int(f[3])
    return counts


def strace_case(spec: dict[str, Any], root: Path, level: str) -> dict[str, Any]:
    """Sync calls for ``probe_n`` writes, each awaited to ``level`` one after another,
    less those of a run of 0 writes (setup and close)."""
    runs = {}
    for n in (0, spec["probe_n"]):
        d = Path(tempfile.mkdtemp(prefix="strace-", dir=root))
        out = d / "strace.txt"
        s = {**spec, "dir": str(d), "probe_n": n, "probe_level": level}
        if spec["system"] == "deltalake":
            run_workers(s, "setup", 1)
        run_workers(
            s,
            "probe",
            1,
            prefix=["strace", "-f", "-c", "-e", f"trace={SYNC_CALLS}", "-o", str(out)],
        )
        runs[n] = parse_strace(out)
        shutil.rmtree(d, ignore_errors=True)
    base, full = runs[0], runs[spec["probe_n"]]
    extra = {k: full.get(k, 0) - base.get(k, 0) for k in sorted(set(base) | set(full))}
    return {
        "writes": spec["probe_n"],
        "baseline_calls": base,
        "calls": full,
        "per_write": {k: v / spec["probe_n"] for k, v in extra.items()},
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="tb-peers-", dir=args.tmpdir))
    results: dict[str, Any] = {}
    try:
        for system in args.systems:
            for store in STORES[system]:
                if store not in args.stores:
                    continue
                key = f"{system}/{store}"
                results[key] = {"system": system, "store": store, "sizes": {}}
                for size in args.sizes:
                    with ExitStack() as stack:
                        s3 = None
                        if store == "moto":
                            ep = stack.enter_context(moto_server())
                            s3 = {"endpoint": ep.endpoint, "bucket": ep.new_bucket("peers")}
                        r: dict[str, Any] = {"loadavg_start": loadavg()}
                        for part in ("throughput", "latency"):
                            d = Path(tempfile.mkdtemp(prefix=f"{part}-", dir=root))
                            if s3 is not None:
                                s3 = {**s3, "bucket": ep.new_bucket("peers")}
                            spec = case_spec(system, store, size, args, d, s3, part)
                            print(f"[{key} {size} B] {part} ...", flush=True)
                            t = time.monotonic()
                            fn = throughput_case if part == "throughput" else latency_case
                            r[part] = fn(spec, system)
                            r[part]["wall_seconds"] = time.monotonic() - t
                            print(f"    {r[part]['wall_seconds']:.1f} s", flush=True)
                            shutil.rmtree(d, ignore_errors=True)
                        r["loadavg_end"] = loadavg()
                        results[key]["sizes"][str(size)] = r
                if args.strace and store == "local" and system != "slatedb-memmove":
                    spec = case_spec(system, store, 1024, args, root, None)
                    print(f"[{key}] strace durability check ...", flush=True)
                    results[key]["strace"] = {
                        lv: strace_case(spec, root, lv) for lv in levels_of(system)
                    }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return results


# --- report ---------------------------------------------------------------------------------


def row_keys(results: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(class, system, store, level), grouped by durability class."""
    rows = []
    for r in results.values():
        for lv in levels_of(r["system"]):
            cls = DURABILITY[(adapter_name(r["system"]), r["store"], lv)][0]
            rows.append((cls, r["system"], r["store"], lv))
    order = {LOCAL_FSYNC: 0, LOCAL_CACHE: 1, REMOTE: 2}
    return sorted(rows, key=lambda k: order[k[0]])


CLASS_LABEL = {LOCAL_FSYNC: "local, fsync", LOCAL_CACHE: "local, page cache", REMOTE: "remote"}


def side_label(system: str, store: str, level: str) -> str:
    lv = "" if level == "ack" else f" {level}"
    diag = ", diagnostic" if system == "slatedb-memmove" else ""
    return f"{system}{lv} ({store}){diag}"


def table(headers: list[str], rows: list[list[Any]], markdown: bool) -> None:
    if not markdown:
        print_table(headers, rows)
        return
    print("| " + " | ".join(headers) + " |")
    print("|" + "---|" * len(headers))
    for r in rows:
        print("| " + " | ".join(str(c) for c in r) + " |")


def report(results: dict[str, Any], args: argparse.Namespace) -> None:
    sizes = [str(s) for s in args.sizes]
    names = {"100": "100 B", "1024": "1 KiB", "65536": "64 KiB"}
    print()
    print(
        f"Throughput: {args.threads} threads per writer process (deltalake: 1 writer "
        "process of 1 thread; deltalake-4w: 4 of 1), "
        f"<= {args.window} calls in flight per thread where the API is asynchronous; "
        f"{args.batch} records per call ({args.batch_64k} at 64 KiB); "
        f"{args.seconds:g} s or {args.budget_mib} MiB per case; rec/s (MiB/s)"
    )
    rows = []
    for cls, system, store, lv in row_keys(results):
        r = results[f"{system}/{store}"]["sizes"]
        cells = []
        for s in sizes:
            t = r[s]["throughput"]["levels"][lv]
            cells.append(f"{t['records_per_s']:,.0f} ({t['mib_per_s']:.1f})")
        rows.append([CLASS_LABEL[cls], side_label(system, store, lv), *cells])
    table(["durability", "side", *(names.get(s, s + " B") for s in sizes)], rows, args.markdown)
    print()
    print(
        f"Ack latency: one record per call at {args.rate:g} calls/s for {args.seconds_lat:g} s "
        f"(first {args.warmup:g} s dropped); p50 / p99 ms [achieved calls/s when below "
        "the target]"
    )
    rows = []
    for cls, system, store, lv in row_keys(results):
        r = results[f"{system}/{store}"]["sizes"]
        cells = []
        for s in sizes:
            lat = r[s]["latency"]
            q = lat["levels"][lv]
            behind = (
                f" [{lat['achieved_rate']:.0f}/s]"
                if lat["achieved_rate"] < 0.95 * lat["target_rate"]
                else ""
            )
            cells.append(f"{q['p50']:.1f} / {q['p99']:.1f}{behind}")
        rows.append([CLASS_LABEL[cls], side_label(system, store, lv), *cells])
    table(["durability", "side", *(names.get(s, s + " B") for s in sizes)], rows, args.markdown)
    print()
    print("What an ack meant:")
    for cls, system, store, lv in row_keys(results):
        print(
            f"  [{cls}] {side_label(system, store, lv)}: "
            f"{DURABILITY[(adapter_name(system), store, lv)][1]}"
        )
    checked = {k: v["strace"] for k, v in results.items() if "strace" in v}
    if checked:
        print()
        print(
            f"strace -f -e trace={SYNC_CALLS}: sync calls per acknowledged single-record "
            "write (N writes, less a run of 0), local store, 1 KiB"
        )
        for k, by_level in checked.items():
            for lv, v in by_level.items():
                per = ", ".join(f"{c} {x:.2f}" for c, x in v["per_write"].items() if x)
                name = k if lv == "ack" else f"{k} {lv}"
                print(f"  {name:34} N={v['writes']}: {per or 'none'}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="short cases, ~2-3 min in all")
    p.add_argument(
        "--systems", default=",".join(SYSTEMS), help=f"comma list of: {', '.join(SYSTEMS)}"
    )
    p.add_argument("--stores", default="local,moto", help="comma list of: local, moto")
    p.add_argument("--sizes", default="100,1024,65536", help="record sizes in bytes")
    p.add_argument("--threads", type=int, default=4, help="threads per writer process")
    p.add_argument("--window", type=int, default=64, help="calls in flight per thread (async)")
    p.add_argument("--batch", type=int, default=100, help="records per call (< 64 KiB)")
    p.add_argument("--batch-64k", type=int, default=4, help="records per call at 64 KiB")
    p.add_argument("--seconds", type=float, help="throughput: seconds per case")
    p.add_argument("--budget-mib", type=int, help="throughput: MiB cap per case")
    p.add_argument("--rate", type=float, default=20.0, help="latency: calls per second")
    p.add_argument("--seconds-lat", type=float, help="latency: seconds per case")
    p.add_argument("--warmup", type=float, default=0.5, help="latency: seconds dropped")
    p.add_argument(
        "--remote-flush-ms",
        type=int,
        default=100,
        help="slatedb flush_interval, tieredbuf-direct flush_interval and "
        "tieredbuf-staged segment max_open_duration (ms)",
    )
    p.add_argument(
        "--no-strace", dest="strace", action="store_false", help="skip the strace durability check"
    )
    p.add_argument("--probe-n", type=int, default=20, help="strace check: writes per side")
    p.add_argument(
        "--verify",
        action="store_true",
        help="read every record back after each throughput case (slow)",
    )
    p.add_argument("--tmpdir", help="parent of the local stores (default: $TMPDIR or /tmp)")
    p.add_argument("--out", default="peers", help="results file name under bench/results/")
    p.add_argument(
        "--render",
        metavar="JSON",
        help="print the report of a saved results file instead of running",
    )
    p.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    a = p.parse_args(argv)
    a.systems = [s for s in a.systems.split(",") if s]
    a.stores = [s for s in a.stores.split(",") if s]
    a.sizes = [int(s) for s in a.sizes.split(",") if s]
    for s in a.systems:
        if s not in SYSTEMS:
            p.error(f"unknown system {s!r}")
    a.seconds = a.seconds or (1.0 if a.quick else 3.0)
    a.budget_mib = a.budget_mib or (32 if a.quick else 128)
    a.seconds_lat = a.seconds_lat or (2.0 if a.quick else 5.0)
    if a.warmup >= a.seconds_lat:
        p.error("--warmup must be shorter than --seconds-lat")
    if a.strace and shutil.which("strace") is None:
        print(
            "strace not found (apt-get install -y strace): skipping the durability check",
            file=sys.stderr,
        )
        a.strace = False
    return a


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_worker"]:
        try:
            worker_main(json.loads(argv[1]))
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        sys.stdout.flush()
        os._exit(0)  # skip interpreter teardown: deltalake's runtime aborts in it
    args = parse_args(argv)
    if args.render:
        saved = json.loads(Path(args.render).read_text())
        for k, v in saved["config"].items():
            if k not in ("render", "markdown"):
                setattr(args, k, v)
        report(saved["results"], args)
        print(
            f"\nload average: start {saved['loadavg']['start']}, end "
            f"{saved['loadavg']['end']}; {saved['machine']}"
        )
        return 0
    started = time.monotonic()
    load_start = loadavg()
    print(f"load average {load_start}; {os.cpu_count()} cpus", flush=True)
    results = run(args)
    load_end = loadavg()
    report(results, args)
    print(
        f"\nload average: start {load_start}, end {load_end} ({os.cpu_count()} cpus, "
        "shared with other engineers' tests)"
    )
    path = write_json(
        args.out,
        {
            "benchmark": "peers",
            "config": vars(args),
            "loadavg": {"start": load_start, "end": load_end},
            "durability": {
                f"{s}/{st}/{lv}": {"class": c, "ack": t}
                for (s, st, lv), (c, t) in DURABILITY.items()
            },
            "results": results,
            "wall_seconds": time.monotonic() - started,
        },
    )
    print(f"\nwrote {path} ({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
