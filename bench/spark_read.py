"""Spark read throughput of the tieredbuf source vs Spark's Parquet reader, and the
streaming produce -> Spark end-to-end latency.

    python bench/spark_read.py [--rows 2000000] [--value-bytes 100]
        [--objects 16] [--s3] [--varied] [--latency-records 30] [--split-streams 8]
    python bench/spark_read.py --latency-only [--s3] [--latency-producers 1,16]
        [--idle-caps default,200]

Both reads scan the same rows (tieredbuf's record schema, written once to Parquet
by Spark) in the same session, with a ``noop`` sink that materializes every row.
A third side, the Python-source ceiling (bench/_spark_floor.py), yields cached Arrow
batches of the same rows in as many partitions with no I/O and no decoding: what any
Python data source pays Spark here, so ``tieredbuf_over_ceiling`` is tieredbuf's own
share.  ``--s3`` puts the buffer and the Parquet copy on a moto server over HTTP (moto is
an in-RAM Python server, so that measures moto more than tieredbuf).
``--split-streams N`` (N > 0) also reads one large ``.qseg`` object whose slot has N
streams (of about ``rows * value_bytes / N`` bytes each) as bundles, whole
(``splitStreamsBytes=0``) and split by stream (one partition per stream).
``--planning`` times only the streaming planning row (no Spark session): the driver's
work per trigger -- latestOffset + partitions for a micro-batch of
``--planning-batch`` objects, read from half-way through the backlog -- at 1 k, 100 k
and 1 M queued entries (``--planning-sizes``), each buffer built through
bench/tree.py's bulk path (no 1 M CAS round trips; the objects themselves are never
read, so they are not written).  Beside it, in the same run, the full scan of every
queued entry that each trigger did before (``snapshot().sized_entries()`` into a
dict), and each trigger's exact request counts.  The full run includes the row.

The streaming latency rows (bench/_spark_e2e.py has the method): produce() ->
``foreachBatch`` with 1 and 16 stateless producers (16 = 4 processes x 4 threads) at
the library's defaults, and one producer after idle spells under ``idlePollMaxMs`` at
its default (2000) and 200 ms, with the idle footer GETs a minute each costs.
``--latency-only`` runs only those (a ``local[2]`` session, no scan, no planning; a few
minutes); with ``--s3`` the moto server counts the real query's idle requests.
Prints the figures and writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _spark_e2e
from _common import machine_info, moto_server, write_json

ROOT = Path(__file__).resolve().parents[1]


def _session() -> Any:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), str(ROOT / "bench"), os.environ.get("PYTHONPATH", "")) if p
    )
    sys.path.insert(0, str(ROOT / "bench"))
    from pyspark.sql import SparkSession

    import tieredbuf.spark

    spark = (
        SparkSession.builder.master("local[2]")
        .appName("tieredbuf-bench")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.driver.memory", "4g")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    tieredbuf.spark.register(spark)
    from _spark_floor import FloorSource

    spark.dataSource.register(FloorSource)
    return spark


def _fill(
    url: str, store: dict[str, Any], rows: int, value_bytes: int, objects: int, varied: bool = False
) -> None:
    """``objects`` data objects of ``rows / objects`` records, appended in one go;
    ``varied``: record lengths spread over [value_bytes / 2, 3 * value_bytes / 2)."""
    from ulid import ULID

    import tieredbuf
    from tieredbuf import keys
    from tieredbuf.format.batch import encode_batch
    from tieredbuf.format.manifest import MetadataItem, NewEntry

    buf = tieredbuf.open(url, **store)
    per = rows // objects
    entries = []
    now = time.time_ns() // 1_000_000
    for o in range(objects):
        base = os.urandom(value_bytes)
        recs = [base[:-8] + i.to_bytes(8, "little") for i in range(o * per, (o + 1) * per)]
        if varied:
            half = value_bytes // 2
            recs = [r[: half + (i * 7919) % (2 * half)] + r[-8:] for i, r in enumerate(recs)]
        key = keys.data_key(ULID(), keys.BATCH_SUFFIX)
        body = encode_batch(recs)
        if len(body) > 16 << 20:
            view = memoryview(body)
            buf.store.put_multipart(
                key,
                (view[i : i + (8 << 20)] for i in range(0, len(view), 8 << 20)),
                mode="create",
            )
        else:
            buf.store.put(key, body, mode="create")
        entries.append(NewEntry(key, (MetadataItem(0, now, b"bench"),)))
    buf.queue.append(entries, f"bench-{ULID()}", len(entries))


def _fill_segment(
    url: str, store: dict[str, Any], rows: int, value_bytes: int, streams: int
) -> int:
    """One .qseg object whose slot 0 has ``streams`` streams (each its own dictionary);
    returns its size in bytes."""
    import pyarrow as pa
    from ulid import ULID

    import tieredbuf
    from tieredbuf import keys
    from tieredbuf.format.manifest import MetadataItem, NewEntry
    from tieredbuf.format.segment import SegmentBuilder, SegmentBundle

    buf = tieredbuf.open(url, **store)
    builder = SegmentBuilder()
    per_stream = rows // streams
    per_bundle = 1 << 16
    seq = 0
    for s in range(streams):
        tag = pa.array([f"stream-{s}"]).dictionary_encode()
        for lo in range(0, per_stream, per_bundle):
            n = min(per_bundle, per_stream - lo)
            vals = pa.array([os.urandom(value_bytes)] * n, pa.binary())
            idx = pa.array([0] * n, pa.int32())
            batch = pa.record_batch(
                {
                    "v": vals,
                    "i": pa.array(range(lo, lo + n), pa.int64()),
                    "tag": pa.DictionaryArray.from_arrays(idx, tag.dictionary),
                }
            )
            builder.add(SegmentBundle({0: batch}, time.time_ns(), seq))
            seq += 1
    body = b"".join(p if isinstance(p, bytes) else p.to_pybytes() for p in builder.finish())
    key = keys.data_key(ULID(), keys.SEGMENT_SUFFIX)
    view = memoryview(body)
    buf.store.put_multipart(
        key, (view[i : i + (8 << 20)] for i in range(0, len(view), 8 << 20)), mode="create"
    )
    now = time.time_ns() // 1_000_000
    buf.queue.append([NewEntry(key, (MetadataItem(0, now, b"bench"),))], f"bench-{ULID()}", 1)
    return len(body)


def _split_bench(
    spark: Any,
    url: str,
    store: dict[str, Any],
    rows: int,
    value_bytes: int,
    streams: int,
    repeats: int,
) -> dict[str, Any]:
    size = _fill_segment(url, store, rows, value_bytes, streams)
    opts = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in store.items()}
    out: dict[str, Any] = {
        "object_bytes": size,
        "streams": streams,
        "rows": rows // streams * streams,
    }
    for name, split in (("whole", "0"), ("split", "1")):
        df = (
            spark.read.format("tieredbuf")
            .options(**opts)
            .option("slot", "0")
            .option("splitStreamsBytes", split)
            .load(url)
        )
        _timed_scan(df, 1)
        out[name] = {
            "partitions": df.rdd.getNumPartitions(),
            "seconds": round(_timed_scan(df, repeats), 3),
        }
    return out


def _timed_scan(df: Any, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        df.write.format("noop").mode("overwrite").save()
        best = min(best, time.perf_counter() - t0)
    return best


def _planning(work: Path, sizes: list[int], batch: int, triggers: int) -> dict[str, Any]:
    """Driver time per streaming trigger, against the backlog (see the module docstring).

    All buffers are built first; then the triggers run round-robin across the sizes (one
    trigger of each size per round), so a shared host's load falls on every size alike."""
    sys.path.insert(0, str(ROOT / "bench"))
    import tree as tree_bench  # bench/tree.py: the same bulk path

    import tieredbuf
    from tests.faults import CountingStore
    from tieredbuf.queue.manifest_queue import ManifestQueue
    from tieredbuf.spark import executor
    from tieredbuf.spark import options as opt
    from tieredbuf.spark.source import records_struct
    from tieredbuf.spark.stream import StreamReader
    from tieredbuf.store import open_store

    if any(n // 2 < batch * (triggers + 1) for n in sizes):
        raise SystemExit("--planning-batch x --planning-triggers must fit in half the backlog")
    runs: dict[int, dict[str, Any]] = {}
    for n in sizes:
        url = f"file://{work}/plan-{n}"
        store = open_store(url)
        t0 = time.perf_counter()
        tree_bench.bulk_tree(store, ManifestQueue(store), n)
        counting = CountingStore(store)
        executor._buffers[(url, ())] = tieredbuf.Buffer(counting)
        ro = opt.parse_read_options(
            {"path": url, "maxOffsetsPerTrigger": str(batch), "startingOffsets": str(n // 2)}
        )
        reader = StreamReader(ro, records_struct())
        runs[n] = {
            "store": store,
            "counting": counting,
            "reader": reader,
            "offset": reader.initialOffset(),
            "build_s": time.perf_counter() - t0,
            "wall": [],
            "cpu": [],
            "requests": [],
            "root_bytes": len(store.get("queue/manifest").data),
        }

    def trigger(r: dict[str, Any]) -> None:
        reader, counting = r["reader"], r["counting"]
        counting.reset()
        c, t = time.thread_time(), time.perf_counter()
        end = reader.latestOffset(r["offset"], reader.getDefaultReadLimit())
        parts = reader.partitions(r["offset"], end)
        r["wall"].append((time.perf_counter() - t) * 1000)
        r["cpu"].append((time.thread_time() - c) * 1000)
        r["requests"].append(counting.counts["get"] + counting.counts["head"])
        assert sum(len(p.refs) for p in parts) == batch
        r["offset"] = end

    for r in runs.values():
        trigger(r)  # the first trigger of each loads its path's nodes (reported as cold)
    cold = {n: (r["wall"].pop(), r["cpu"].pop(), r["requests"].pop()) for n, r in runs.items()}
    for _ in range(triggers):
        for r in runs.values():
            trigger(r)
    rows = []
    for n, r in runs.items():
        full = []
        for _ in range(3):
            t = time.perf_counter()
            entries = {
                e.sequence: (e, size)
                for e, size in tieredbuf.Buffer(r["store"]).snapshot().sized_entries()
            }
            full.append((time.perf_counter() - t) * 1000)
            assert len(entries) == n
        rows.append(
            {
                "queued": n,
                "build_s": round(r["build_s"], 1),
                "root_bytes": r["root_bytes"],
                "trigger_ms": {
                    "p50": round(statistics.median(r["wall"]), 3),
                    "min": round(min(r["wall"]), 3),
                    "max": round(max(r["wall"]), 3),
                },
                "trigger_cpu_ms_p50": round(statistics.median(r["cpu"]), 3),
                "requests_per_trigger": {"min": min(r["requests"]), "max": max(r["requests"])},
                "first_trigger": {"ms": round(cold[n][0], 3), "requests": cold[n][2]},
                "main_full_scan_ms": round(min(full), 1),
            }
        )
        print(
            f"planning: {n:>9} queued (root {r['root_bytes']} B): trigger p50 "
            f"{statistics.median(r['wall']):7.3f} ms, cpu {statistics.median(r['cpu']):7.3f}"
            f" ms, requests {min(r['requests'])}-{max(r['requests'])} (first: "
            f"{cold[n][2]}); main's full scan {min(full):9.1f} ms",
            flush=True,
        )
    lo, hi = rows[0], rows[-1]
    return {
        "note": f"driver time of latestOffset + partitions per trigger ({batch} objects per "
        f"micro-batch, maxOffsetsPerTrigger), {triggers} triggers per size from half-"
        "way through the backlog, sizes interleaved, local directory; "
        "main_full_scan_ms: the dict of every queued entry each trigger built before",
        "rows": rows,
        "ratio_largest_over_smallest_p50": round(
            hi["trigger_ms"]["p50"] / lo["trigger_ms"]["p50"], 3
        ),
        "ratio_largest_over_smallest_cpu_p50": round(
            hi["trigger_cpu_ms_p50"] / lo["trigger_cpu_ms_p50"], 3
        ),
        "goal": "largest within 1.5x of smallest",
    }


def _latency_only(args: argparse.Namespace) -> None:
    """The end-to-end rows alone: a local[2] session, a local directory or (``--s3``) a
    moto server on a thread that counts what it receives (the real query's idle reads)."""
    work = Path(tempfile.mkdtemp(prefix="tb-e2e-"))
    load = os.getloadavg()
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, work, ignore_errors=True)
        ep = rec = None
        if args.s3:
            sys.path.insert(0, str(ROOT))
            from tests.servers import recording_moto_server

            logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request

            ep, rec = cleanup.enter_context(recording_moto_server())
        spark = _session()
        cleanup.callback(spark.stop)
        latency = _spark_e2e.run(spark, work, ep, rec, args)
    result = {
        "bench": "spark_e2e",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {**machine_info(), "spark_master": "local[2]"},
        "load_avg_before": load,
        "load_avg_after": os.getloadavg(),
        "backend": "s3 (moto over HTTP, serialised, counting)" if args.s3 else "local directory",
        "streaming_latency": latency,
    }
    print(f"load average before: {load}; after: {result['load_avg_after']}")
    stamp = time.strftime("%Y%m%dT%H%M%S")
    print(f"wrote {write_json(f'spark_e2e-{stamp}', result)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--value-bytes", type=int, default=100)
    ap.add_argument("--objects", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--latency-only",
        action="store_true",
        help="only the produce -> foreachBatch rows (no scan, no planning)",
    )
    ap.add_argument("--latency-producers", default="1,16", help="producer counts (busy rows)")
    ap.add_argument("--latency-processes", type=int, default=4, help="at most this many")
    ap.add_argument("--latency-records", type=int, default=30, help="per producer")
    ap.add_argument("--latency-pause-ms", type=float, default=200.0)
    ap.add_argument(
        "--idle-caps",
        default="default,200",
        help="idlePollMaxMs of the idle rows ('default': the option unset)",
    )
    ap.add_argument("--idle-records", type=int, default=8)
    ap.add_argument(
        "--idle-tail-s", type=float, default=20.0, help="idle after the last record (counted)"
    )
    ap.add_argument("--idle-s", type=float, default=5.0, help="idle before each record (+ U(0, 2))")
    ap.add_argument("--s3", action="store_true", help="use a moto S3 server over HTTP")
    ap.add_argument(
        "--varied",
        action="store_true",
        help="records of varied length (the decoder walks the length prefixes)",
    )
    ap.add_argument(
        "--split-streams",
        type=int,
        default=0,
        help="also time a bundle read of one .qseg with this many streams",
    )
    ap.add_argument(
        "--planning", action="store_true", help="only the streaming planning row (no Spark session)"
    )
    ap.add_argument("--planning-sizes", default="1000,100000,1000000")
    ap.add_argument("--planning-batch", type=int, default=16)
    ap.add_argument("--planning-triggers", type=int, default=30)
    args = ap.parse_args()
    sizes = [int(x) for x in args.planning_sizes.split(",")]
    args.latency_producers = [int(x) for x in args.latency_producers.split(",") if x]
    args.idle_caps = [None if x == "default" else int(x) for x in args.idle_caps.split(",") if x]
    if args.latency_only:
        _latency_only(args)
        return
    if args.planning:
        with tempfile.TemporaryDirectory(prefix="tb-plan-") as tmp:
            planning = _planning(Path(tmp), sizes, args.planning_batch, args.planning_triggers)
        result = {
            "bench": "spark_planning",
            "machine": {**machine_info(), "load_avg_1m": round(os.getloadavg()[0], 2)},
            "streaming_planning": planning,
        }
        print(json.dumps(result, indent=2))
        print(f"wrote {write_json('spark_planning', result)}")
        return

    work = Path(tempfile.mkdtemp(prefix="tb-bench-"))
    parquet = str(work / "parquet")  # Spark's Parquet reader on local disk, always
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, work, ignore_errors=True)
        store: dict[str, Any] = {}
        s3 = None
        if args.s3:
            s3 = cleanup.enter_context(moto_server(in_process=True))
            bucket = s3.new_bucket()
            store = s3.options()
            url = f"s3://{bucket}/buf"
        else:
            url = f"file://{work}/buf"
        spark = _session()
        t0 = time.perf_counter()
        _fill(url, store, args.rows, args.value_bytes, args.objects, args.varied)
        fill_s = time.perf_counter() - t0
        opts = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in store.items()}
        tb = spark.read.format("tieredbuf").options(**opts).load(url)
        tb.write.mode("overwrite").parquet(parquet)
        pq = spark.read.parquet(parquet)
        rows = args.rows // args.objects * args.objects
        assert pq.count() == rows
        payload_mb = rows * args.value_bytes / 1e6
        floor = (
            spark.read.format("tb_bench_floor")
            .option("partitions", tb.rdd.getNumPartitions())
            .option("rows", rows)
            .option("rows_per_batch", rows // args.objects)
            .option("value_bytes", args.value_bytes)
            .load()
        )
        _timed_scan(pq, 1)  # warm the JVM and the Python workers
        _timed_scan(tb, 1)
        _timed_scan(floor, 1)
        # Interleaved, best of each: a shared host's load hits every side alike.
        rounds: list[tuple[float, float, float]] = []
        for _ in range(args.repeats):
            rounds.append((_timed_scan(tb, 1), _timed_scan(pq, 1), _timed_scan(floor, 1)))
        t_tb, t_pq, t_floor = (min(r[i] for r in rounds) for i in range(3))
        # Each round's sides ran back to back, under about the same load.
        round_ratios = sorted(p / t for t, p, _ in rounds)
        load = os.getloadavg()[0]
        latency = _spark_e2e.run(spark, work, s3, None, args)
        split = None
        if args.split_streams > 0:
            split = _split_bench(
                spark,
                url.replace("/buf", "/seg"),
                store,
                args.rows,
                args.value_bytes,
                args.split_streams,
                args.repeats,
            )
        result = {
            "bench": "spark_read",
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": {
                **machine_info(),
                "spark_master": "local[2]",
                "load_avg_1m": round(load, 2),
            },
            "backend": "s3 (moto over HTTP)" if args.s3 else "local directory",
            "rows": rows,
            "value_bytes": args.value_bytes,
            "objects": args.objects,
            "varied_lengths": args.varied,
            "fill_seconds": round(fill_s, 3),
            "tieredbuf": {
                "seconds": round(t_tb, 3),
                "rows_per_s": round(rows / t_tb),
                "mb_per_s": round(payload_mb / t_tb, 1),
            },
            "parquet": {
                "seconds": round(t_pq, 3),
                "rows_per_s": round(rows / t_pq),
                "mb_per_s": round(payload_mb / t_pq, 1),
            },
            "ratio_tieredbuf_over_parquet": round(t_pq / t_tb, 3),
            "ratio_per_round": [round(r, 3) for r in round_ratios],
            "ratio_median_of_rounds": round(statistics.median(round_ratios), 3),
            "python_source_ceiling": {
                "note": "a Python data source yielding cached batches of the same rows in "
                "as many partitions (no I/O, no decode): Spark's cost of any "
                "Python source here",
                "partitions": tb.rdd.getNumPartitions(),
                "seconds": round(t_floor, 3),
                "ratio_over_parquet": round(t_pq / t_floor, 3),
                "tieredbuf_over_ceiling": round(t_floor / t_tb, 3),
            },
            "streaming_latency": latency,
            "bundles_split_by_stream": split,
            "streaming_planning": _planning(
                work, sizes, args.planning_batch, args.planning_triggers
            ),
        }
        spark.stop()
    print(json.dumps(result, indent=2))
    path = write_json(f"spark_read-{time.strftime('%Y%m%dT%H%M%S')}", result)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
