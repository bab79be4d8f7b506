"""What the sink writes for a DataFrame's columns: nothing is dropped silently.

Rows with a ``value`` column (binary or string) and at most a ``metadata`` column are
records; any other column would be dropped by the records encoding, so the write is
refused naming those columns -- unless ``slot`` is given: then every column is written
as Arrow bundles into that slot, ``value`` included, as ``slot`` asks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pyspark.sql.types import (
    BinaryType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
)

import tieredbuf
from tieredbuf.errors import ConfigError
from tieredbuf.spark import options as opt
from tieredbuf.spark import writer as wr


def _schema(*fields: tuple[str, Any]) -> StructType:
    return StructType([StructField(n, t, True) for n, t in fields])


def _wo(url: str, **options: str) -> opt.WriteOptions:
    return opt.parse_write_options({"path": url, "createBuffer": "true", **options})


@pytest.mark.parametrize("writer", ["batch", "stream"])
def test_a_value_column_with_other_columns_is_refused_naming_what_would_be_dropped(
    tmp_path: Path, writer: str
) -> None:
    url = f"file://{tmp_path}/buf"
    schema = _schema(("key", StringType()), ("value", BinaryType()), ("n", IntegerType()))

    def make(wo: opt.WriteOptions) -> Any:
        if writer == "batch":
            return wr.BatchWriter(wo, schema)
        return wr.StreamWriter(wo, schema, "p")

    with pytest.raises(ConfigError, match=r"columns \['key', 'n'\] would be dropped.*slot"):
        make(_wo(url))
    assert make(_wo(url, slot="3")).records is False  # slot asks for bundles: all columns
    both = _schema(("value", StringType()), ("metadata", BinaryType()))
    assert wr.BatchWriter(_wo(url), both).records is True
    assert wr.BatchWriter(_wo(url, slot="0"), both).records is False


def test_a_metadata_column_must_be_binary_or_string(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/buf"
    with pytest.raises(ConfigError, match=r"column 'metadata'.*binary or string.*bigint"):
        wr.BatchWriter(_wo(url), _schema(("value", BinaryType()), ("metadata", LongType())))


def test_a_write_slot_is_checked() -> None:
    with pytest.raises(ConfigError, match=r"slot must be in 0\.\.65535"):
        opt.parse_write_options({"path": "file:///x", "slot": "65536"})


@pytest.mark.slow
@pytest.mark.spark
def test_slot_with_a_value_column_writes_every_column_as_bundles(
    spark: Any, tmp_path: Path
) -> None:
    url = f"file://{tmp_path}/buf"
    df = spark.createDataFrame(
        [(f"k{i}", f"v{i}".encode(), i) for i in range(4)], "key string, value binary, n int"
    )
    df.coalesce(1).write.format("tieredbuf").option("createBuffer", "true").option(
        "slot", "2"
    ).mode("append").save(url)
    got = spark.read.format("tieredbuf").option("slot", "2").load(url)
    assert sorted((r.key, bytes(r.value), r.n) for r in got.collect()) == [
        (f"k{i}", f"v{i}".encode(), i) for i in range(4)
    ]
    (entry,) = tieredbuf.open(url).entries()  # one task, one object
    assert entry.location.endswith(".qseg")
