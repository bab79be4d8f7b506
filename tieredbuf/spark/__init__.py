"""The ``tieredbuf`` PySpark data source (batch, Structured Streaming, and sink).

    import tieredbuf.spark
    tieredbuf.spark.register(spark)
    df = spark.read.format("tieredbuf").load("s3://bucket/prefix")

See docs/spark.md for the options and the commit / dequeue semantics.
"""

from __future__ import annotations

from typing import Any

FORMAT = "tieredbuf"


def register(spark: Any) -> None:
    """Register ``format("tieredbuf")`` with ``spark`` (a SparkSession)."""
    from tieredbuf.spark.source import TieredBufDataSource

    spark.dataSource.register(TieredBufDataSource)


__all__ = ["FORMAT", "register"]
