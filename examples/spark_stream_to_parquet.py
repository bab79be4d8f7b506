r"""Stream a tieredbuf buffer on S3 into Parquet, as a named subscriber of the buffer.

With the local S3 of docs/getting-started.md (section 9: ``moto_server -p 9000``, a
bucket named ``bucket``, its keys in ``AWS_*``), some records, then the job:

    seq 1000 | tieredbuf produce s3://bucket/prefix --endpoint http://127.0.0.1:9000 --batch 100
    python examples/spark_stream_to_parquet.py s3://bucket/prefix ./out ./ckpt \
        --endpoint http://127.0.0.1:9000 --available-now
    python -c 'import pyarrow.parquet as pq; print(pq.read_table("out").num_rows, "rows")'

On AWS leave out ``--endpoint``; credentials come from the standard AWS environment
variables or ``~/.aws``.  Without ``--available-now`` the job runs until stopped, a
micro-batch every 10 seconds.  Every micro-batch prints a progress line: the rows it
read, the buffer offset (sequence) it reached, the subscriber's lag behind the
buffer's tail (entries and age), and where the rows went.

The checkpoint makes restarts resume where the last run stopped; ``consumer`` makes
the job the buffer's subscriber of that name: each committed micro-batch is acked (one
micro-batch late, see docs/spark.md), other subscribers read the same buffer
independently, and a second copy of this job with the same consumer name fences the
first.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from pyspark.sql import SparkSession

import tieredbuf
import tieredbuf.spark


def _offset(progress: dict[str, Any]) -> str:
    """The sequence the micro-batch read up to (the source's end offset)."""
    sources = progress.get("sources") or [{}]
    end = sources[0].get("endOffset")
    try:
        parsed = json.loads(end) if isinstance(end, str) else end
    except ValueError:
        return str(end)
    if isinstance(parsed, dict) and "sequence" in parsed:
        return str(parsed["sequence"])
    return str(parsed)


def _lag(buf: tieredbuf.Buffer, consumer: str) -> str:
    """The subscriber's lag behind the tail, as ``tieredbuf subscribers`` shows it."""
    for s in buf.subscribers():
        if s.name == consumer:
            age = "" if s.lag_seconds is None else f", {s.lag_seconds:.0f} s behind"
            return f"lag {s.lag_entries} entries{age}"
    return "lag unknown (not registered yet)"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("buffer")
    ap.add_argument("out")
    ap.add_argument("checkpoint")
    ap.add_argument("--endpoint")
    ap.add_argument("--region", default="us-east-1")
    ap.add_argument("--consumer", default="parquet-archiver")
    ap.add_argument("--max-objects-per-trigger", type=int, default=64)
    ap.add_argument("--available-now", action="store_true", help="drain the backlog and stop")
    args = ap.parse_args()

    spark = SparkSession.builder.appName("tieredbuf-to-parquet").getOrCreate()
    tieredbuf.spark.register(spark)

    store: dict[str, str] = {}
    if args.buffer.startswith("s3://"):
        store["region"] = args.region
    if args.endpoint:  # an http:// endpoint implies plain HTTP
        store["endpoint"] = args.endpoint
    reader = (
        spark.readStream.format("tieredbuf")
        .options(**store)
        .option("consumer", args.consumer)
        .option("maxOffsetsPerTrigger", args.max_objects_per_trigger)
    )
    records = reader.load(args.buffer).selectExpr(
        "CAST(value AS STRING) AS value",
        "metadata",
        "sequence",
        "index",
        "ingestion_time",
        "to_date(ingestion_time) AS day",
    )
    writer = (
        records.writeStream.format("parquet")
        .option("checkpointLocation", args.checkpoint)
        .partitionBy("day")
    )
    writer = (
        writer.trigger(availableNow=True)
        if args.available_now
        else writer.trigger(processingTime="10 seconds")
    )
    query = writer.start(args.out)
    buf = tieredbuf.open(args.buffer, **store)
    print(
        f"streaming {args.buffer} as subscriber {args.consumer!r} into {args.out} "
        f"(Parquet, by day; checkpoint {args.checkpoint})",
        flush=True,
    )
    seen, rows = -1, 0
    t0 = time.monotonic()
    while True:
        done = query.awaitTermination(5)
        for p in query.recentProgress:  # each micro-batch once, in order
            if p["batchId"] <= seen:
                continue
            seen = p["batchId"]
            rows += p["numInputRows"]
            print(
                f"batch {seen}: {p['numInputRows']} rows (total {rows}), up to sequence "
                f"{_offset(p)}, {_lag(buf, args.consumer)} -> {args.out}",
                flush=True,
            )
        if done:
            break
    print(
        f"done: {rows} rows in {seen + 1} micro-batches, {time.monotonic() - t0:.1f} s; "
        f"Parquet in {args.out}",
        flush=True,
    )


if __name__ == "__main__":
    main()
