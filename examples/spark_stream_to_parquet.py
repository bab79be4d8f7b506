"""Stream a tieredbuf buffer on S3 into Parquet, as a named subscriber of the buffer.

    python examples/spark_stream_to_parquet.py s3://bucket/prefix /data/out /data/ckpt \
        [--endpoint http://127.0.0.1:9000] [--available-now]

Credentials come from the standard AWS environment variables.  The checkpoint makes
restarts resume where the last run stopped; ``consumer`` makes the job the buffer's
subscriber of that name: each committed micro-batch is acked (one micro-batch late,
see docs/spark.md), other subscribers read the same buffer independently, and a
second copy of this job with the same consumer name fences the first.
"""

from __future__ import annotations

import argparse

from pyspark.sql import SparkSession

import tieredbuf.spark


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

    reader = (
        spark.readStream.format("tieredbuf")
        .option("consumer", args.consumer)
        .option("maxOffsetsPerTrigger", args.max_objects_per_trigger)
    )
    if args.buffer.startswith("s3://"):
        reader = reader.option("region", args.region)
    if args.endpoint:  # an http:// endpoint implies plain HTTP
        reader = reader.option("endpoint", args.endpoint)
    records = reader.load(args.buffer).selectExpr(
        "CAST(value AS STRING) AS value", "metadata", "sequence", "index", "ingestion_time",
        "to_date(ingestion_time) AS day",
    )
    writer = (
        records.writeStream.format("parquet")
        .option("checkpointLocation", args.checkpoint)
        .partitionBy("day")
    )
    writer = writer.trigger(availableNow=True) if args.available_now else writer.trigger(
        processingTime="10 seconds"
    )
    writer.start(args.out).awaitTermination()


if __name__ == "__main__":
    main()
