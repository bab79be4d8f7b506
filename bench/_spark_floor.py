"""A Python data source that yields cached Arrow batches: the ceiling of the Python
Data Source API on this machine, for bench/spark_read.py.

Same schema, row count, value size, partition count and batch size (one batch per
data object, as tieredbuf yields them) as the tieredbuf read it is compared with, but
no I/O and no decoding: each Python worker builds one partition's batches once and
yields them for every partition.  What is left is Spark's own cost of a Python source: task launch,
the worker round trip, the Arrow stream to the JVM and the JVM's row conversion.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from tieredbuf.spark.arrow import RECORDS_DDL, records_schema, repeat_value

_cache: dict[tuple[int, int, int], list[pa.RecordBatch]] = {}


def _build(rows: int, value_bytes: int) -> pa.RecordBatch:
    base = os.urandom(value_bytes)
    values = pa.array([base[:-8] + i.to_bytes(8, "little") for i in range(rows)], pa.binary())
    return pa.RecordBatch.from_arrays(
        [
            values,
            repeat_value(b"bench", rows, pa.binary()),
            pa.array(np.full(rows, 7, dtype=np.int64)),
            pa.array(np.arange(rows, dtype=np.int32)),
            pa.array(
                np.full(rows, 1_700_000_000_000_000, dtype=np.int64), pa.timestamp("us", tz="UTC")
            ),
            repeat_value(b"data/01KXXXXXXXXXXXXXXXXXXXXXXX.batch", rows, pa.string()),
        ],
        schema=records_schema(),
    )


def _batches(rows: int, per_batch: int, value_bytes: int) -> list[pa.RecordBatch]:
    """One partition's rows as separately built batches of ``per_batch`` rows (not
    slices of one big batch, which the Arrow IPC writer would have to re-base)."""
    key = (rows, per_batch, value_bytes)
    if key not in _cache:
        _cache[key] = [
            _build(min(per_batch, rows - off), value_bytes) for off in range(0, rows, per_batch)
        ]
    return _cache[key]


class _Reader(DataSourceReader):
    def __init__(self, partitions: int, rows: int, per_batch: int, value_bytes: int) -> None:
        self.n, self.rows, self.per_batch, self.value_bytes = (
            partitions,
            rows,
            per_batch,
            value_bytes,
        )

    def partitions(self) -> list[InputPartition]:
        return [InputPartition(i) for i in range(self.n)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        yield from _batches(self.rows // self.n, self.per_batch, self.value_bytes)


class FloorSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return "tb_bench_floor"

    def schema(self) -> str:
        return RECORDS_DDL

    def reader(self, schema: Any) -> DataSourceReader:
        o = self.options
        return _Reader(
            int(o["partitions"]), int(o["rows"]), int(o["rows_per_batch"]), int(o["value_bytes"])
        )
