"""Batch backfill: read one time range of a tieredbuf buffer and write it to Parquet.

    python examples/spark_backfill_time_range.py s3://bucket/prefix /data/backfill \
        --from 2026-11-22T00:00:00 --to 2026-11-23T00:00:00 [--endpoint http://...]

The range is resolved through the queue manifest (each entry's metadata ingestion
times), so only the data objects that overlap it are read, one Spark task per object;
records inside straddling objects are filtered by their own ingestion time.  A plain
batch read never dequeues anything.
"""

from __future__ import annotations

import argparse

from pyspark.sql import SparkSession

import tieredbuf.spark


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("buffer")
    ap.add_argument("out")
    ap.add_argument("--from", dest="start", required=True, help="ISO-8601 or epoch ms")
    ap.add_argument("--to", dest="end", required=True, help="ISO-8601 or epoch ms (exclusive)")
    ap.add_argument("--endpoint")
    ap.add_argument("--region", default="us-east-1")
    args = ap.parse_args()

    spark = SparkSession.builder.appName("tieredbuf-backfill").getOrCreate()
    tieredbuf.spark.register(spark)
    reader = (
        spark.read.format("tieredbuf")
        .option("region", args.region)
        .option("startingTimestamp", args.start)
        .option("endingTimestamp", args.end)
        .option("failOnDataLoss", "false")  # part of the range may be dequeued already
    )
    if args.endpoint:  # an http:// endpoint implies plain HTTP
        reader = reader.option("endpoint", args.endpoint)
    df = reader.load(args.buffer)
    df.selectExpr(
        "CAST(value AS STRING) AS value", "sequence", "index", "ingestion_time",
        "to_date(ingestion_time) AS day",
    ).write.mode("overwrite").partitionBy("day").parquet(args.out)
    print(f"backfilled {spark.read.parquet(args.out).count()} records into {args.out}")


if __name__ == "__main__":
    main()
