"""Invariant I10 for the Spark source: an executor never turns a damaged data object
(replaced, cut short, extended, a byte flipped; compressed or not) into rows.  By
default the task fails with the CorruptError; with ``failOnDataLoss=false`` the object
is skipped whole and logged, like a missing one.

The quick tests drive the source's reader objects directly (the driver's planning and
the executor's ``read`` in this process); the slow ones run real batch and streaming
queries on the session's ``local[2]``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pyspark.errors import StreamingQueryException

import tieredbuf
from tests.damage import Damage
from tests.test_integrity import CASES, make_damaged
from tieredbuf.config import Compression
from tieredbuf.errors import CorruptError
from tieredbuf.spark import options as opt
from tieredbuf.spark.reader import BatchReader
from tieredbuf.spark.source import records_struct
from tieredbuf.spark.stream import StreamReader


def _read_all(reader: Any, parts: Any) -> list[int]:
    seqs: list[int] = []
    for p in parts:
        for b in reader.read(p):
            seqs += pa.Table.from_batches([b]).column("sequence").to_pylist()
    return sorted(set(seqs))


def _batch(url: str, **options: str) -> tuple[BatchReader, Any]:
    ro = opt.parse_read_options({"path": url, "maxPartitionBytes": "0", **options})
    r = BatchReader(ro, records_struct())
    return r, r.partitions()


def _stream(url: str, **options: str) -> tuple[StreamReader, Any]:
    r = StreamReader(opt.parse_read_options({"path": url, **options}), records_struct())
    start = r.initialOffset()
    return r, r.partitions(start, r.latestOffset(start, r.getDefaultReadLimit()))


@pytest.mark.slow
@pytest.mark.parametrize(("how", "comp"), CASES)
@pytest.mark.parametrize("plan", [_batch, _stream], ids=["batch", "stream"])
def test_I10_spark_executors_never_turn_a_damaged_object_into_rows(
    plan: Any, how: Damage, comp: Compression, tmp_path: Path
) -> None:
    url = f"file://{tmp_path}/buf"
    d = make_damaged(url, {}, how, comp, big=False)
    reader, parts = plan(url)
    with pytest.raises(CorruptError) as ei:
        _read_all(reader, parts)
    assert ei.value.obj == d.location
    reader, parts = plan(url, failOnDataLoss="false")
    assert _read_all(reader, parts) == [0, 2]  # skipped whole: none of its rows


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.parametrize(
    ("how", "comp"),
    [("truncated", Compression.NONE), ("flipped", Compression.ZSTD)],
    ids=["truncated-none", "flipped-zstd"],
)
def test_I10_spark_queries_fail_on_a_damaged_object_or_skip_it_when_told(
    spark: Any, how: Damage, comp: Compression, tmp_path: Path
) -> None:
    url = f"file://{tmp_path}/buf"
    d = make_damaged(url, {}, how, comp, big=False)
    df = spark.read.format("tieredbuf").option("maxPartitionBytes", "0")
    with pytest.raises(Exception, match=d.location.split("/")[1]):
        df.load(url).select("sequence").collect()
    got = df.option("failOnDataLoss", "false").load(url).select("sequence").collect()
    assert sorted({r.sequence for r in got}) == [0, 2]

    def run(ckpt: Path, **options: str) -> Any:
        out = ckpt.with_name(ckpt.name + "-out")
        q = (
            spark.readStream.format("tieredbuf")
            .options(**options)
            .load(url)
            .select("sequence")
            .writeStream.format("parquet")
            .option("checkpointLocation", str(ckpt))
            .trigger(availableNow=True)
            .start(str(out))
        )
        q.awaitTermination(120)
        return spark.read.schema("sequence long").parquet(str(out))

    with pytest.raises(StreamingQueryException, match=d.location.split("/")[1]):
        run(tmp_path / "ck1")
    rows = run(tmp_path / "ck2", failOnDataLoss="false").collect()
    assert sorted({r.sequence for r in rows}) == [0, 2]


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_I10_the_spark_sink_keeps_a_crc32_beside_every_batch(
    spark: Any, compression: str, tmp_path: Path
) -> None:
    from tests.test_integrity import rfc0001_records
    from tieredbuf.format.crc import crc32

    url = f"file://{tmp_path}/buf"
    rows = [(b"value %d" % i, b"m") for i in range(50)]
    df = spark.createDataFrame(rows, "value binary, metadata binary").repartition(2)
    df.write.format("tieredbuf").options(createBuffer="true", compression=compression).mode(
        "append"
    ).save(url)
    buf = tieredbuf.open(url)
    got: list[bytes] = []
    for e in buf.entries():
        obj = buf.store.get(e.location)
        assert obj.crc32 == crc32(obj.data, 0)
        got += rfc0001_records(obj.data)
    assert sorted(got) == sorted(v for v, _ in rows)
