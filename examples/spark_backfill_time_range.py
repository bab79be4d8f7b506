r"""Batch backfill: read a tieredbuf buffer day by day and write each day to Parquet.

With the local S3 of docs/getting-started.md (section 9: ``moto_server -p 9000``, a
bucket named ``bucket``, its keys in ``AWS_*``), some records, then the backfill of
yesterday and today (``--from`` takes a date, ``today`` or ``yesterday``, in UTC):

    seq 100 | tieredbuf produce s3://bucket/prefix --endpoint http://127.0.0.1:9000
    python examples/spark_backfill_time_range.py s3://bucket/prefix ./backfill \
        --from yesterday --days 2 --endpoint http://127.0.0.1:9000
    ls backfill                                 # day=<today>: yesterday had no records

On AWS leave out ``--endpoint``; a local buffer works too (``file://./events``, as
docs/getting-started.md makes one).

A day with no records says so and writes nothing; a range with none at all says so
too, and the script still exits 0 (an empty backfill is not an error).

Each day is one batch read of ``[day, next day)`` by ingestion time.  Adjacent windows
return every record exactly once, in the window of its own ingestion time, even
records appended late with an older time (a producer's stage drained hours later, a
skewed clock): a window ends after the last object still holding a record before its
end, and records are filtered one by one (docs/spark.md, "Time windows").  The
windows are found through the manifest tree; only the data objects that hold records
of the day are read.  A plain batch read never dequeues anything.  Re-running a day
replaces its Parquet partition.
"""

from __future__ import annotations

import argparse
from datetime import UTC, date, datetime, timedelta

from pyspark.sql import SparkSession

import tieredbuf.spark


def _ms(d: date) -> str:
    return str(int(datetime(d.year, d.month, d.day, tzinfo=UTC).timestamp() * 1000))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("buffer")
    ap.add_argument("out")
    ap.add_argument(
        "--from",
        dest="start",
        required=True,
        help="first day: YYYY-MM-DD, today or yesterday (UTC)",
    )
    ap.add_argument("--days", type=int, default=1)
    ap.add_argument("--endpoint")
    ap.add_argument("--region", default="us-east-1")
    args = ap.parse_args()

    spark = SparkSession.builder.appName("tieredbuf-backfill").getOrCreate()
    spark.conf.set("spark.sql.sources.partitionOverwriteMode", "dynamic")
    tieredbuf.spark.register(spark)
    today = datetime.now(UTC).date()
    relative = {"today": today, "yesterday": today - timedelta(days=1)}
    first = relative.get(args.start) or date.fromisoformat(args.start)
    total = 0
    for i in range(args.days):
        day = first + timedelta(days=i)
        reader = (
            spark.read.format("tieredbuf")
            .option("startingTimestamp", _ms(day))
            .option("endingTimestamp", _ms(day + timedelta(days=1)))
            .option("failOnDataLoss", "false")  # the oldest days may be gone already
        )
        if args.buffer.startswith("s3://"):
            reader = reader.option("region", args.region)
        if args.endpoint:  # an http:// endpoint implies plain HTTP
            reader = reader.option("endpoint", args.endpoint)
        df = (
            reader.load(args.buffer)
            .selectExpr(
                "CAST(value AS STRING) AS value",
                "sequence",
                "index",
                "ingestion_time",
                "to_date(ingestion_time) AS day",
            )
            .cache()
        )
        n = df.count()
        if n == 0:
            print(f"{day}: no records ingested that day; nothing written")
            continue
        df.write.mode("overwrite").partitionBy("day").parquet(args.out)
        df.unpersist()
        total += n
        print(f"{day}: {n} record{'' if n == 1 else 's'} -> {args.out}/day={day}")
    if total == 0:
        print(
            f"{first} .. {first + timedelta(days=args.days - 1)}: the buffer holds no "
            "records ingested in this range; nothing written"
        )


if __name__ == "__main__":
    main()
