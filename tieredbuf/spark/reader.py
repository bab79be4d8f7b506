"""Batch reads of the ``tieredbuf`` source: ``spark.read.format("tieredbuf")``.

Planned once on the driver from one manifest snapshot (:mod:`tieredbuf.spark.plan`);
executors read their own partitions (:mod:`tieredbuf.spark.executor`); streaming
reads are in :mod:`tieredbuf.spark.stream`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSourceReader, InputPartition
from pyspark.sql.types import StructType

from tieredbuf.spark import options as opt
from tieredbuf.spark import plan
from tieredbuf.spark.executor import ObjectPartition, arrow_schema, read_partition, shared_buffer


class BatchReader(DataSourceReader):
    """Time windows are per record: ``[startingTimestamp, endingTimestamp)``."""

    def __init__(self, ro: opt.ReadOptions, schema: StructType) -> None:
        self.ro = ro
        self.schema = schema
        buf = shared_buffer(ro.url, ro.store)
        snap = plan.read_snapshot(buf)
        self.start, self.end = plan.batch_range(buf, snap, ro)
        self._parts: list[ObjectPartition] = plan.plan_range(
            buf, snap, self.start, self.end, ro, ro.starting_ts, ro.ending_ts
        )

    def __getstate__(self) -> dict[str, Any]:
        # Spark pickles the reader into every task: each task gets its own partition
        # separately, never the whole plan.
        return {"ro": self.ro, "schema": self.schema, "start": self.start, "end": self.end}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.ro, self.schema = state["ro"], state["schema"]
        self.start, self.end = state["start"], state["end"]
        self._parts = []

    def partitions(self) -> Sequence[InputPartition]:
        return list(self._parts)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if not isinstance(partition, ObjectPartition):
            return iter(())  # Spark's stand-in InputPartition(None) for an empty plan
        return read_partition(self.ro, arrow_schema(self.schema), partition)
