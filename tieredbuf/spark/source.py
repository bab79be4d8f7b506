"""The ``tieredbuf`` Python data source (pyspark 4.x Data Source API)."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any, TypeVar

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

from tieredbuf.errors import ConfigError, TieredBufError
from tieredbuf.spark import arrow as ta
from tieredbuf.spark import options as opt

T = TypeVar("T")


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


class DataSourceError(TieredBufError):
    """A tieredbuf error on its way out of the data source, its message printed first.

    Spark shows a data source's error as ``Failed to create Python data source instance:``
    followed by the Python traceback, whose *last* line is the message: a user reading
    the top of the error sees only frames.  A traceback is printed after its exception's
    cause, so this one's cause is a copy of the error that was never raised (printed as
    one line, without frames).  Spark's simplified tracebacks clear ``__cause__``; here
    that assignment is ignored."""

    def __init__(self, error: TieredBufError) -> None:
        super().__init__(str(error))
        try:
            head: BaseException = copy.copy(error)
        except Exception:
            head = TieredBufError(f"{type(error).__name__}: {error}")
        self._head = head

    @property  # type: ignore[override]
    def __cause__(self) -> BaseException | None:
        return self._head

    @__cause__.setter
    def __cause__(self, value: BaseException | None) -> None:
        pass


def _headline(method: Callable[..., T]) -> Callable[..., T]:
    """Raise a tieredbuf error of ``method`` with its message first and without
    tieredbuf's frames (:class:`DataSourceError`)."""

    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> T:
        try:
            return method(*args, **kwargs)
        except DataSourceError:
            raise
        except TieredBufError as e:
            # the message says what went wrong and what to do; tieredbuf's own frames
            # (the planner's, the reader's) would only bury it in Spark's error text
            raise DataSourceError(e).with_traceback(None) from None

    return wrapped


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

    @_headline
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

    @_headline
    def reader(self, schema: StructType) -> DataSourceReader:
        from tieredbuf.spark.reader import BatchReader

        ro = opt.parse_read_options(self.options)
        if (
            ro.consumer is not None
            or ro.max_offsets is not None
            or ro.max_bytes is not None
            or ro.idle_poll_max_ms is not None
        ):
            raise ConfigError(
                "consumer / maxOffsetsPerTrigger / maxBytesPerTrigger / idlePollMaxMs apply to "
                "readStream only"
            )
        return BatchReader(ro, schema)

    @_headline
    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        from tieredbuf.spark.stream import StreamReader

        ro = opt.parse_read_options(self.options)
        if ro.ending is not None or ro.ending_ts is not None:
            raise ConfigError("endingOffsets / endingTimestamp apply to batch reads only")
        return StreamReader(ro, schema)

    @_headline
    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        from tieredbuf.spark.writer import BatchWriter

        if overwrite:
            raise ConfigError("a tieredbuf buffer is a queue: only mode('append') is supported")
        return BatchWriter(opt.parse_write_options(self.options), schema)

    @_headline
    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        from tieredbuf.spark.writer import StreamWriter

        if overwrite:
            raise ConfigError("a tieredbuf buffer is a queue: use outputMode('append')")
        wo = opt.parse_write_options(self.options)
        return StreamWriter(wo, schema, wo.producer_id or f"spark-query-{self.instance_id}")
