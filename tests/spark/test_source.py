"""The tieredbuf Spark source and sink on a real local[2] session.

Every test runs on a local directory and on moto's S3 server over HTTP.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

import tieredbuf
from tests.spark.conftest import spark_options, unique
from tests.spark.util import append_bundles, append_records, consume_all, rows

pytestmark = pytest.mark.spark

BACKENDS = ["local", pytest.param("s3", marks=pytest.mark.s3)]
# the source and the sink on Azure Blob too (Azurite): a batch read, a stream, a write
WITH_AZURE = [*BACKENDS, pytest.param("azure", marks=pytest.mark.azure)]
# and on GCS (fake-gcs-server): a batch read and a stream
WITH_CLOUDS = [*WITH_AZURE, pytest.param("gcs", marks=pytest.mark.gcs)]


def _reader(spark: Any, store: dict[str, Any], **opts: Any) -> Any:
    r = spark.read.format("tieredbuf").options(**spark_options(store))
    return r.options(**{k: str(v) for k, v in opts.items()})


@pytest.mark.slow
@pytest.mark.parametrize("buffer_url", WITH_CLOUDS, indirect=True)
def test_batch_read_equals_produced(spark: Any, buffer_url: tuple[str, dict[str, Any]]) -> None:
    url, store = buffer_url
    buf = tieredbuf.open(url, **store)
    produced: list[tuple[bytes, bytes, int, int]] = []
    with buf.producer() as p:
        for i in range(4):
            recs = [f"r{i}-{j}".encode() * (j + 1) for j in range(50)]
            p.produce(recs[:20], metadata=b"a%d" % i)
            p.produce(recs[20:], metadata=b"b%d" % i)
            p.flush()
    for e in buf.entries():
        for idx, rec in enumerate(_records(buf, e)):
            produced.append((rec, b"a" if idx < 20 else b"b", e.sequence, idx))
    assert len(buf.entries()) == 4
    # Small objects are packed (Spark's small-file rule); 0 turns packing off.
    one_each = _reader(spark, store).option("maxPartitionBytes", "0").load(url)
    assert one_each.rdd.getNumPartitions() == 4
    assert sorted(bytes(r.value) for r in one_each.select("value").collect()) == sorted(
        p[0] for p in produced
    )
    df = _reader(spark, store).option("minPartitions", "2").load(url)
    assert df.rdd.getNumPartitions() == 2
    got = sorted(
        (bytes(r.value), bytes(r.metadata)[:1], r.sequence, r["index"])
        for r in df.select("value", "metadata", "sequence", "index").collect()
    )
    assert got == sorted(produced)
    one = df.where("sequence = 0 and index = 0").collect()[0]
    assert one.location == buf.entries()[0].location
    assert one.ingestion_time is not None


def _records(buf: tieredbuf.Buffer, e: Any) -> list[bytes]:
    from tieredbuf.format.batch import decode_batch

    return decode_batch(buf.read_object(e))


@pytest.mark.parametrize("buffer_url", BACKENDS, indirect=True)
@pytest.mark.slow
def test_offsets_and_timestamps_select_ranges(
    spark: Any, buffer_url: tuple[str, dict[str, Any]]
) -> None:
    url, store = buffer_url
    buf = tieredbuf.open(url, **store)
    for s in range(6):  # sequence s holds records ingested at 1000 * (s + 1) ms
        append_records(buf, [[b"%d" % s]], ts_ms=1000 * (s + 1))

    def seqs(**opts: Any) -> list[int]:
        return sorted(
            r[0] for r in rows(_reader(spark, store, **opts).load(url).select("sequence"))
        )

    assert seqs() == [0, 1, 2, 3, 4, 5]
    assert seqs(startingOffsets=2, endingOffsets=4) == [2, 3]
    assert seqs(startingOffsets="latest") == []
    assert seqs(startingOffsets="earliest", endingOffsets='{"sequence": 1}') == [0]
    assert seqs(startingTimestamp=3000) == [2, 3, 4, 5]
    assert seqs(startingTimestamp=2500, endingTimestamp=5000) == [2, 3]
    assert seqs(startingTimestamp="1970-01-01T00:00:04") == [3, 4, 5]
    # A second DataFrame on the same relation must not see the first one's range.
    assert seqs(endingOffsets=1) == [0]
    assert seqs() == [0, 1, 2, 3, 4, 5]


@pytest.mark.slow
def test_fail_on_data_loss(spark: Any, tmp_path: Path) -> None:
    url = f"file://{tmp_path}/buf"
    buf = tieredbuf.open(url)
    for s in range(4):
        append_records(buf, [[b"%d" % s]], ts_ms=1000)
    c = buf.consumer()
    c.initialize()
    c.next_batch(), c.next_batch()
    c.ack(0)
    c.ack(1)
    c.flush()
    c.close()
    with pytest.raises(Exception, match="already dequeued"):
        _reader(spark, {}, startingOffsets=0).load(url).collect()
    got = rows(
        _reader(spark, {}, startingOffsets=0, failOnDataLoss="false").load(url).select("sequence")
    )
    assert sorted(r[0] for r in got) == [2, 3]


def _stream(spark: Any, url: str, store: dict[str, Any], out: Path, ckpt: Path, **opts: Any) -> Any:
    df = (
        spark.readStream.format("tieredbuf")
        .options(**spark_options(store))
        .options(**{k: str(v) for k, v in opts.items()})
        .load(url)
    )
    return (
        df.select("value", "sequence", "index")
        .writeStream.format("parquet")
        .option("checkpointLocation", str(ckpt))
        .trigger(availableNow=True)
        .start(str(out))
    )


@pytest.mark.parametrize("buffer_url", WITH_CLOUDS, indirect=True)
@pytest.mark.slow
def test_stream_available_now_exactly_once_across_runs(
    spark: Any, buffer_url: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    url, store = buffer_url
    buf = tieredbuf.open(url, **store)
    for s in range(3):
        append_records(buf, [[b"a%d-%d" % (s, j) for j in range(5)]], ts_ms=1000)
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    name = unique("c")
    q = _stream(spark, url, store, out, ckpt, consumer=name)
    assert q.awaitTermination(120)
    assert q.exception() is None
    first = sorted(rows(spark.read.parquet(str(out)).select("sequence", "index")))
    assert first == [(s, j) for s in range(3) for j in range(5)]

    for s in range(3, 5):
        append_records(buf, [[b"a%d-%d" % (s, j) for j in range(5)]], ts_ms=1000)
    q = _stream(spark, url, store, out, ckpt, consumer=name)
    assert q.awaitTermination(120)
    assert q.exception() is None
    got = sorted(rows(spark.read.parquet(str(out)).select("sequence", "index")))
    assert got == [(s, j) for s in range(5) for j in range(5)]  # each exactly once
    # Spark commits a micro-batch one batch late: run 2 acked run 1's batch; the last
    # batch stays queued until the next run (never dequeued before Spark is done).
    footer = buf.snapshot().footer
    assert footer.first_sequence == 3 and footer.next_sequence == 5


@pytest.mark.parametrize("buffer_url", BACKENDS, indirect=True)
@pytest.mark.slow
def test_admission_control_splits_backlog(
    spark: Any, buffer_url: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    url, store = buffer_url
    buf = tieredbuf.open(url, **store)
    for _ in range(7):
        append_records(buf, [[b"x" * 100] * 10], ts_ms=1000)
    q = _stream(spark, url, store, tmp_path / "o1", tmp_path / "c1", maxOffsetsPerTrigger=2)
    assert q.awaitTermination(120)
    sizes = [p["numInputRows"] for p in q.recentProgress if p["numInputRows"]]
    assert sizes == [20, 20, 20, 10]
    size = buf.store.head(buf.entries()[0].location).size
    q = _stream(spark, url, store, tmp_path / "o2", tmp_path / "c2", maxBytesPerTrigger=3 * size)
    assert q.awaitTermination(120)
    sizes = [p["numInputRows"] for p in q.recentProgress if p["numInputRows"]]
    assert sizes == [30, 30, 10]
    assert spark.read.parquet(str(tmp_path / "o2")).count() == 70


@pytest.mark.slow
def test_second_query_with_same_consumer_fences_first(spark: Any, tmp_path: Path) -> None:
    url = f"file://{tmp_path}/buf"
    buf = tieredbuf.open(url)
    append_records(buf, [[b"a", b"b"]], ts_ms=1000)
    name = unique("c")

    def start(i: int) -> Any:
        df = spark.readStream.format("tieredbuf").option("consumer", name).load(url)
        return (
            df.writeStream.format("memory")
            .queryName(unique("fence").replace("-", "_"))
            .option("checkpointLocation", str(tmp_path / f"ck{i}"))
            .trigger(processingTime="50 milliseconds")
            .start()
        )

    a = start(1)
    a.processAllAvailable()
    b = start(2)
    b.processAllAvailable()
    # the first query is idle and fenced; it learns at its next busy trigger, before it
    # plans anything (a named subscriber's epoch is in its progress object)
    append_records(buf, [[b"c"]], ts_ms=1000)
    with pytest.raises(Exception, match=r"(?i)fenced"):
        a.awaitTermination(120)
    assert b.isActive
    b.processAllAvailable()
    b.stop()
    assert [s.name for s in buf.subscribers()] == [name]


@pytest.mark.parametrize("buffer_url", WITH_AZURE, indirect=True)
@pytest.mark.slow
def test_sink_output_is_consumable(
    spark: Any, buffer_url: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    url, store = buffer_url
    buf = tieredbuf.open(url, **store)
    df = spark.createDataFrame([(f"v{i}",) for i in range(100)], "value string").repartition(3)
    with pytest.raises(Exception, match="createBuffer"):  # never creates one by accident
        df.write.format("tieredbuf").options(**spark_options(store)).mode("append").save(url)
    df.write.format("tieredbuf").options(**spark_options(store)).option(
        "createBuffer", "true"
    ).mode("append").save(url)
    entries = buf.entries()
    assert len(entries) == 3
    got = consume_all(buf)
    assert sorted(r for _, recs in got for r in recs) == sorted(
        f"v{i}".encode() for i in range(100)
    )
    # writeStream: another buffer -> this one, AvailableNow.
    src_url = f"{url}-src" if url.startswith("file") else url.replace("/buf", "/src")
    src = tieredbuf.open(src_url, **store)
    for s in range(3):
        append_records(src, [[b"s%d-%d" % (s, j) for j in range(4)]], ts_ms=1000)
    q = (
        spark.readStream.format("tieredbuf")
        .options(**spark_options(store))
        .load(src_url)
        .select("value", "metadata")
        .writeStream.format("tieredbuf")
        .options(**spark_options(store))
        .option("checkpointLocation", str(tmp_path / "ck"))
        .trigger(availableNow=True)
        .start(url)
    )
    assert q.awaitTermination(120)
    assert q.exception() is None
    got = consume_all(buf)
    streamed = sorted(r for s, recs in got if s >= 3 for r in recs)
    assert streamed == sorted(b"s%d-%d" % (s, j) for s in range(3) for j in range(4))


@pytest.mark.slow
@pytest.mark.parametrize("buffer_url", BACKENDS, indirect=True)
def test_bundles_read_back_with_representative_schema(
    spark: Any, buffer_url: tuple[str, dict[str, Any]]
) -> None:
    url, store = buffer_url
    buf = tieredbuf.open(url, **store)
    a1 = pa.record_batch({"a": pa.array([1, 2], pa.int32()), "s": ["x", "y"]})
    other = pa.record_batch({"z": [1.5]})
    append_bundles(buf, [{0: a1, 1: other}, {0: a1}])
    a2 = pa.record_batch(
        {
            "a": pa.array([3], pa.int64()),
            "t": pa.array([7], pa.uint32()),
            "s": pa.array(["z"]).dictionary_encode(),
        }
    )
    append_bundles(buf, [{0: a2}])
    df = _reader(spark, store, slot=0).load(url)
    assert [(f.name, f.dataType.simpleString()) for f in df.schema.fields] == [
        ("a", "bigint"),
        ("s", "string"),
        ("t", "bigint"),
        ("_sequence", "bigint"),
        ("_bundle", "int"),
    ]
    assert sorted(rows(df)) == [
        (1, "x", None, 0, 0),
        (1, "x", None, 0, 1),
        (2, "y", None, 0, 0),
        (2, "y", None, 0, 1),
        (3, "z", 7, 1, 0),
    ]
    # The sink writes a non-`value` schema as bundles; they read back the same way.
    out = url + "-out" if url.startswith("file") else url.replace("/buf", "/out")
    df.select("a", "s").write.format("tieredbuf").options(**spark_options(store)).option(
        "createBuffer", "true"
    ).mode("append").save(out)
    back = _reader(spark, store, slot=0).load(out)
    assert [f.name for f in back.schema.fields] == ["a", "s", "_sequence", "_bundle"]
    assert sorted(rows(back.select("a", "s"))) == sorted(rows(df.select("a", "s")))


def _many_stream_buffer(url: str, store: dict[str, Any]) -> tieredbuf.Buffer:
    """Two .qseg objects whose slot 0 spans several streams (schema drift and changing
    dictionaries open new ones), slot 1 beside it, and a bundle without slot 0."""
    buf = tieredbuf.open(url, **store)
    bundles: list[dict[int, pa.RecordBatch]] = []
    for i in range(12):
        n = 50 + i
        if i % 3 == 0:
            b = pa.record_batch({"a": pa.array(range(n), pa.int32())})
        elif i % 3 == 1:
            b = pa.record_batch(
                {
                    "a": pa.array(range(n), pa.int64()),
                    "s": pa.array([f"v{i}"] * n).dictionary_encode(),
                }
            )
        else:
            b = pa.record_batch({"s": pa.array([f"w{i}"] * n)})
        bundles.append({0: b, 1: pa.record_batch({"z": [float(i)]})})
    bundles.insert(5, {1: pa.record_batch({"z": [-1.0]})})
    append_bundles(buf, bundles)
    append_bundles(buf, bundles[:4])
    return buf


@pytest.mark.parametrize("buffer_url", BACKENDS, indirect=True)
@pytest.mark.slow
def test_large_segments_split_by_stream_read_rows_exactly_once(
    spark: Any, buffer_url: tuple[str, dict[str, Any]]
) -> None:
    url, store = buffer_url
    _many_stream_buffer(url, store)
    whole = _reader(spark, store, slot=0, splitStreamsBytes=0).load(url)
    split = _reader(spark, store, slot=0, splitStreamsBytes=1).load(url)
    assert whole.schema == split.schema
    assert whole.rdd.getNumPartitions() == 2
    # one stream per (schema, dictionary): 1 + 4 + 1 in the first object, 3 in the second
    assert split.rdd.getNumPartitions() == 9
    expected = rows(whole)
    assert len(expected) == sum(50 + i for i in range(12)) + sum(50 + i for i in range(4))
    assert sorted(rows(split), key=repr) == sorted(expected, key=repr)
    # a large threshold reads whole objects again (the default is 64 MiB)
    assert _reader(spark, store, slot=0).load(url).rdd.getNumPartitions() == 2
    # streaming plans the same way
    ck = url.replace("file://", "") + "-ck" if url.startswith("file") else None
    if ck is not None:
        name = unique("split").replace("-", "_")
        q = (
            spark.readStream.format("tieredbuf")
            .options(**spark_options(store))
            .option("slot", "0")
            .option("splitStreamsBytes", "1")
            .load(url)
            .writeStream.format("memory")
            .queryName(name)
            .option("checkpointLocation", ck)
            .trigger(availableNow=True)
            .start()
        )
        assert q.awaitTermination(120)
        assert q.exception() is None
        assert sorted(rows(spark.table(name)), key=repr) == sorted(expected, key=repr)
