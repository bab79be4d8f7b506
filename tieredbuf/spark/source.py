"""The ``tieredbuf`` Python data source (pyspark 4.x Data Source API)."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
)
from pyspark.sql.types import IntegerType, LongType, StructField, StructType
from ulid import ULID

from tieredbuf.errors import ConfigError
from tieredbuf.spark import arrow as ta
from tieredbuf.spark import options as opt


def records_struct() -> StructType:
    from pyspark.sql.pandas.types import from_arrow_schema

    result: StructType = from_arrow_schema(ta.records_schema())
    return result


def bundles_struct(payload: pa.Schema) -> StructType:
    """Spark schema of a slot: its representative columns, then ``_sequence``, ``_bundle``."""
    from pyspark.sql.pandas.types import from_arrow_type

    fields = []
    for f in payload:
        if f.name in (ta.SEQUENCE_COL, ta.BUNDLE_COL):
            raise ConfigError(f"slot column {f.name!r} clashes with a column tieredbuf adds")
        try:
            dt = from_arrow_type(ta.spark_compatible(f.type))
        except Exception as e:  # pyspark raises its own type errors
            raise ConfigError(
                f"slot column {f.name!r} of type {f.type} has no Spark type; pass a schema "
                "with .schema(...) to read it cast"
            ) from e
        fields.append(StructField(f.name, dt, True))
    fields.append(StructField(ta.SEQUENCE_COL, LongType(), True))
    fields.append(StructField(ta.BUNDLE_COL, IntegerType(), True))
    return StructType(fields)


class TieredBufDataSource(DataSource):
    """``format("tieredbuf")``; the ``load()``/``save()`` path is the buffer URL.

    Options: see docs/spark.md.  Keys are case-insensitive.
    """

    def __init__(self, options: Any) -> None:
        super().__init__(options)
        # Unique to this DataSource instance, which Spark creates once per query and
        # pickles to every commit: the streaming sink's default producer id.
        self.instance_id = str(ULID())

    @classmethod
    def name(cls) -> str:
        return "tieredbuf"

    def schema(self) -> StructType:
        ro = opt.parse_read_options(self.options)
        if ro.slot is None:
            return records_struct()
        from tieredbuf.spark import plan
        from tieredbuf.spark.bundles import slot_schemas
        from tieredbuf.spark.executor import shared_buffer

        buf = shared_buffer(ro.url, ro.store)
        snap = plan.read_snapshot(buf)
        if (
            ro.ending is None
            and ro.ending_ts is None
            and ro.starting is None
            and ro.starting_ts is None
        ):
            start, end = snap.low, snap.root.next_seq
        else:
            start, end = plan.batch_range(buf, snap, ro)
        schemas = slot_schemas(buf.store, [e for e, _ in plan.collect(snap, start, end)], ro.slot)
        if not schemas:
            raise ConfigError(
                f"no bundles of slot {ro.slot} in {ro.url} to infer a schema from; pass "
                "one with .schema(...)"
            )
        return bundles_struct(ta.unify(schemas))

    def reader(self, schema: StructType) -> DataSourceReader:
        from tieredbuf.spark.reader import BatchReader

        ro = opt.parse_read_options(self.options)
        if ro.consumer is not None or ro.max_offsets is not None or ro.max_bytes is not None:
            raise ConfigError(
                "consumer / maxOffsetsPerTrigger / maxBytesPerTrigger apply to readStream only"
            )
        return BatchReader(ro, schema)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        from tieredbuf.spark.stream import StreamReader

        ro = opt.parse_read_options(self.options)
        if ro.ending is not None or ro.ending_ts is not None:
            raise ConfigError("endingOffsets / endingTimestamp apply to batch reads only")
        return StreamReader(ro, schema)

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        from tieredbuf.spark.writer import BatchWriter

        if overwrite:
            raise ConfigError("a tieredbuf buffer is a queue: only mode('append') is supported")
        return BatchWriter(opt.parse_write_options(self.options), schema)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        from tieredbuf.spark.writer import StreamWriter

        if overwrite:
            raise ConfigError("a tieredbuf buffer is a queue: use outputMode('append')")
        wo = opt.parse_write_options(self.options)
        return StreamWriter(wo, schema, wo.producer_id or f"spark-query-{self.instance_id}")
