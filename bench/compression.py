"""zstd (with its frame content checksum) against no compression, for the data batch's
``batch_compression`` / ``records_compression`` default: what it costs to ingest, what it
saves in bytes stored (PUT bytes, egress), and what Spark pays to read it back -- at
100 B and 1 KiB records, in one run.

For each record size and kind of data (``text``: log-like JSON lines, what a buffer of
events holds; ``random``: incompressible bytes, zstd's worst case), and each compression:

* ``direct``: a stateless producer (``batch_compression``) writing ``--mib`` MiB of
  records in produce() calls of ``--call-kib`` KiB from one thread; records/s until
  ``close()`` returned, every record REMOTE;
* ``staged LOCAL`` / ``staged``: a staged producer (``records_compression``, WAL
  durability): records/s until the last produce() call's handle was LOCAL, and until
  ``close()`` exported everything (compression runs when a segment seals);
* ``stored``: bytes of the buffer's data objects (what was PUT, and what readers GET);
* ``spark``: rows/s of ``spark.read.format("tieredbuf")`` into a ``noop`` sink over the
  direct producer's buffer (one ``local[2]`` session for every row; best of
  ``--repeat``).

A codec table isolates the checksum: ``encode_batch`` and ``decode_batch`` MB/s (of
records) over one 32 MiB batch, without compression, with zstd level 3 without the
checksum, and with it (what tieredbuf writes).

Local directory store (``--store moto`` for a moto server in a child process).  Prints
the tables, writes ``bench/results/compression.json``.  Run under
``flock /tmp/tieredbuf-bench.lock``; the figures are this machine's, same run.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import zstandard
from _common import moto_server, print_table, write_json

import tieredbuf
from tieredbuf.config import Compression
from tieredbuf.format.batch import ZSTD_LEVEL, decode_batch, encode_batch, encode_records

ROOT = Path(__file__).resolve().parents[1]
WORDS = [
    "request",
    "served",
    "checkout",
    "cart",
    "payment",
    "user",
    "session",
    "token",
    "timeout",
    "retry",
    "upstream",
    "latency",
    "ok",
    "error",
    "warn",
    "cache",
    "miss",
    "hit",
    "region",
    "shard",
    "replica",
    "leader",
    "follower",
    "commit",
    "queue",
    "batch",
    "flush",
    "export",
    "segment",
    "manifest",
    "consumer",
    "producer",
    "ack",
    "lag",
]
LEVELS = ("DEBUG", "INFO", "INFO", "INFO", "WARN", "ERROR")
SERVICES = ("checkout", "payments", "search", "auth", "inventory", "gateway")


def text_record(rng: random.Random, size: int, t_ms: int) -> bytes:
    """One JSON log line of exactly ``size`` bytes: fixed keys, a few random ids, words."""
    head = (
        f'{{"ts":{t_ms},"level":"{rng.choice(LEVELS)}","svc":"{rng.choice(SERVICES)}",'
        f'"trace":"{rng.getrandbits(64):016x}","user":{rng.randrange(100_000)},"msg":"'
    )
    words: list[str] = []
    n = len(head) + 2
    while n < size:
        w = rng.choice(WORDS)
        words.append(w)
        n += len(w) + 1
    line = (head + " ".join(words))[: size - 2] + '"}'
    return line.encode().ljust(size, b" ")


def records(kind: str, size: int, total: int, seed: int = 7) -> list[bytes]:
    rng = random.Random(seed)
    n = max(1, total // size)
    if kind == "random":
        blob = os.urandom(size * n)
        return [blob[i * size : (i + 1) * size] for i in range(n)]
    t0 = 1_764_000_000_000
    return [text_record(rng, size, t0 + i) for i in range(n)]


def calls_of(recs: list[bytes], call_bytes: int) -> Iterator[list[bytes]]:
    per = max(1, call_bytes // len(recs[0]))
    for i in range(0, len(recs), per):
        yield recs[i : i + per]


def stored_bytes(buf: tieredbuf.Buffer) -> int:
    return sum(m.size for m in buf.store.list("data/"))


def direct(
    url: str, opts: dict[str, Any], recs: list[bytes], comp: Compression, call: int
) -> dict[str, Any]:
    buf = tieredbuf.open(url, **opts)
    t0 = time.perf_counter()
    p = buf.producer(batch_compression=comp)
    for c in calls_of(recs, call):
        p.produce(c)
    p.close()
    secs = time.perf_counter() - t0
    out = {"seconds": secs, "records_per_s": len(recs) / secs, "stored": stored_bytes(buf)}
    buf.close()
    return out


def staged(
    url: str, opts: dict[str, Any], stage: Path, recs: list[bytes], comp: Compression, call: int
) -> dict[str, Any]:
    buf = tieredbuf.open(url, **opts)
    t0 = time.perf_counter()
    p = buf.producer(stage, records_compression=comp)
    last = None
    for c in calls_of(recs, call):
        last = p.produce(c)
    assert last is not None
    last.wait(tieredbuf.Durability.LOCAL, timeout=600)
    local = time.perf_counter() - t0
    p.close()
    secs = time.perf_counter() - t0
    out = {
        "local_seconds": local,
        "local_records_per_s": len(recs) / local,
        "seconds": secs,
        "records_per_s": len(recs) / secs,
        "stored": stored_bytes(buf),
    }
    buf.close()
    return out


def codec(recs: list[bytes], repeat: int) -> dict[str, dict[str, float]]:
    """MB/s (of record bytes) of encoding and decoding one batch of ``recs``."""
    raw = sum(len(r) for r in recs)
    block = encode_records(recs)
    plain = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    out: dict[str, dict[str, float]] = {}

    def best(fn: Any) -> float:
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    for name in ("none", "zstd", "zstd+checksum"):
        if name == "none":
            body = encode_batch(recs)
            enc = best(lambda: encode_batch(recs))
        elif name == "zstd":
            body = plain.compress(block) + body_footer(len(recs))
            enc = best(lambda: plain.compress(encode_records(recs)))
        else:
            body = encode_batch(recs, Compression.ZSTD)
            enc = best(lambda: encode_batch(recs, Compression.ZSTD))
        assert decode_batch(body) == recs
        dec = best(lambda b=body: decode_batch(b))
        out[name] = {
            "encode_mb_s": raw / enc / 1e6,
            "decode_mb_s": raw / dec / 1e6,
            "bytes": len(body),
        }
    return out


def body_footer(count: int) -> bytes:
    from tieredbuf.format.batch import encode_footer

    return encode_footer(count, Compression.ZSTD)


def spark_session() -> Any:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
    )
    from pyspark.sql import SparkSession

    import tieredbuf.spark

    spark = (
        SparkSession.builder.master("local[2]")
        .appName("tieredbuf-bench-compression")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.driver.memory", "2g")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    tieredbuf.spark.register(spark)
    return spark


def spark_read(
    spark: Any, url: str, opts: dict[str, Any], rows: int, repeat: int
) -> dict[str, Any]:
    df = spark.read.format("tieredbuf").options(**{k: str(v) for k, v in opts.items()}).load(url)
    df.write.format("noop").mode("overwrite").save()  # warm: plan caches, Python workers
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        df.write.format("noop").mode("overwrite").save()
        best = min(best, time.perf_counter() - t)
    return {"seconds": best, "rows_per_s": rows / best}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=64, help="MiB of records per run (default 64)")
    ap.add_argument("--sizes", default="100,1024", help="record sizes in bytes")
    ap.add_argument("--data", default="text,random", help="kinds of records: text, random")
    ap.add_argument("--call-kib", type=int, default=64, help="KiB of records per produce() call")
    ap.add_argument("--store", choices=("local", "moto"), default="local")
    ap.add_argument("--repeat", type=int, default=3, help="Spark scans and codec runs (best of)")
    ap.add_argument("--no-spark", action="store_true")
    ap.add_argument("--json", default="compression", help="results file name")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    kinds = args.data.split(",")
    total = int(args.mib * (1 << 20))
    comps = (Compression.NONE, Compression.ZSTD)
    rows: list[dict[str, Any]] = []
    codecs: dict[str, Any] = {}
    work = Path(tempfile.mkdtemp(prefix="tb-compression-"))
    with ExitStack() as stack:
        if args.store == "moto":
            ep = stack.enter_context(moto_server())
            bucket = ep.new_bucket()
            opts: dict[str, Any] = ep.options()

            def url_of(name: str) -> str:
                return f"s3://{bucket}/{name}"
        else:
            opts = {}

            def url_of(name: str) -> str:
                return f"file://{work}/{name}"

        try:
            for kind in kinds:
                for size in sizes:
                    recs = records(kind, size, total)
                    codecs[f"{kind}-{size}"] = codec(recs[: (32 << 20) // size], args.repeat)
                    for comp in comps:
                        name = f"{kind}-{size}-{comp.name.lower()}"
                        d = direct(url_of(f"d-{name}"), opts, recs, comp, args.call_kib << 10)
                        s = staged(
                            url_of(f"s-{name}"),
                            opts,
                            work / f"stage-{name}",
                            recs,
                            comp,
                            args.call_kib << 10,
                        )
                        rows.append(
                            {
                                "data": kind,
                                "record_bytes": size,
                                "compression": comp.name.lower(),
                                "records": len(recs),
                                "raw_bytes": len(recs) * size,
                                "direct": d,
                                "staged": s,
                                "url": url_of(f"d-{name}"),
                            }
                        )
                        print(f"  {name}: direct {d['records_per_s']:,.0f} rec/s", flush=True)
            if not args.no_spark:
                spark = spark_session()
                try:
                    for r in rows:
                        r["spark"] = spark_read(spark, r["url"], opts, r["records"], args.repeat)
                finally:
                    spark.stop()
        finally:
            shutil.rmtree(work, ignore_errors=True)
    report(rows, codecs, args)
    write_json(
        args.json,
        {
            "args": vars(args),
            "rows": [{k: v for k, v in r.items() if k != "url"} for r in rows],
            "codec": codecs,
        },
    )
    return 0


def _pct(a: float, b: float) -> str:
    return f"{100 * a / b:.0f}%"


def report(rows: list[dict[str, Any]], codecs: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"\n{args.mib:g} MiB of records per row, {args.store} store, produce() calls of "
        f"{args.call_kib} KiB"
    )
    table = []
    for r in rows:
        d, s = r["direct"], r["staged"]
        sp = r.get("spark")
        table.append(
            [
                r["data"],
                r["record_bytes"],
                r["compression"],
                f"{d['records_per_s']:,.0f}",
                f"{s['local_records_per_s']:,.0f}",
                f"{s['records_per_s']:,.0f}",
                f"{d['stored'] / (1 << 20):,.1f}",
                _pct(d["stored"], r["raw_bytes"]),
                "-" if sp is None else f"{sp['rows_per_s']:,.0f}",
            ]
        )
    print_table(
        [
            "data",
            "record B",
            "compression",
            "direct rec/s",
            "staged LOCAL rec/s",
            "staged rec/s",
            "stored MiB",
            "of raw",
            "Spark rows/s",
        ],
        table,
    )
    print("\ncodec, one 32 MiB batch: MB/s of records (best of --repeat)")
    ctable = []
    for name, c in codecs.items():
        for comp, f in c.items():
            ctable.append(
                [name, comp, f"{f['encode_mb_s']:,.0f}", f"{f['decode_mb_s']:,.0f}", f["bytes"]]
            )
    print_table(["records", "codec", "encode MB/s", "decode MB/s", "bytes"], ctable)
    med = statistics.median(
        c["zstd+checksum"]["encode_mb_s"] / c["zstd"]["encode_mb_s"] for c in codecs.values()
    )
    print(f"\nzstd+checksum encode speed / zstd without: {med:.2f} (median over rows)")


if __name__ == "__main__":
    sys.exit(main())
