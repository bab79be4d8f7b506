"""Where reads start and what happens when data is gone (defects 4, 5, 6).

* failOnDataLoss=false is honoured on executors too: a missing data object is
  skipped there (and logged), not raised; sequences gone from the queue are skipped
  by the driver and counted in the query's progress (``lostSequences``).
* With retention the buffer keeps acked history: ``earliest`` is the first kept
  sequence and a start between it and the queue head reads history, as
  ``buf.reader()`` does.
* A URL with no buffer is an error naming it, and the consumer option never creates
  a manifest there; a checkpoint whose offsets belong to another buffer (deleted and
  created again, or rolled back) fails the query.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from pyspark.errors import StreamingQueryException

import tieredbuf
from tests.spark.conftest import unique
from tests.spark.util import append_records, now_ms
from tieredbuf import keys
from tieredbuf.errors import BufferNotFoundError, DataLossError
from tieredbuf.spark import options as opt
from tieredbuf.spark.source import records_struct
from tieredbuf.spark.stream import StreamReader

T0 = now_ms() - 60_000  # a minute ago: inside any retention age of the tests


def _fill(buf: tieredbuf.Buffer, n: int, start: int = 0) -> None:
    """Sequences start.. of one record each, ingested at T0 + their number."""
    for s in range(start, start + n):
        append_records(buf, [[b"r%d" % s]], ts_ms=T0 + s)


def _dequeue_through(buf: tieredbuf.Buffer, seq: int) -> None:
    buf.queue.dequeue(seq, buf.queue.initialize(unique("other")))


def _stream_reader(url: str, **options: str) -> StreamReader:
    return StreamReader(opt.parse_read_options({"path": url, **options}), records_struct())


def _seqs(df: Any) -> list[int]:
    return sorted(r.sequence for r in df.select("sequence").collect())


def _run_stream(spark: Any, url: str, ckpt: Path, **options: str) -> tuple[Any, Any]:
    """An AvailableNow run into Parquet beside its checkpoint: (query, every row so far).

    awaitTermination raises the query's error when it failed."""
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
    assert q.awaitTermination(120), "the query did not finish"
    assert q.exception() is None
    return q, spark.read.schema("sequence long").parquet(str(out))


def _latest_offsets(q: Any) -> list[dict[str, Any]]:
    out = []
    for p in q.recentProgress:
        for s in p["sources"]:
            lo = s.get("latestOffset")
            if lo:
                out.append(json.loads(lo) if isinstance(lo, str) else lo)
    return out


# --- defect 4: failOnDataLoss ------------------------------------------------------------


@pytest.mark.spark
@pytest.mark.slow
def test_failOnDataLoss_false_skips_a_missing_object_on_executors(
    spark: Any, tmp_path: Path
) -> None:
    url = f"file://{tmp_path}/buf"
    buf = tieredbuf.open(url)
    _fill(buf, 4)
    gone = buf.entries()[1].location
    assert buf.store.delete_many([gone]) == []
    reader = spark.read.format("tieredbuf").option("maxPartitionBytes", "0")
    with pytest.raises(Exception, match="missing from the store"):
        reader.load(url).collect()
    assert _seqs(reader.option("failOnDataLoss", "false").load(url)) == [0, 2, 3]
    _, rows = _run_stream(spark, url, tmp_path / "ck", failOnDataLoss="false")
    assert _seqs(rows) == [0, 2, 3]


@pytest.mark.spark
@pytest.mark.slow
def test_sequences_gone_from_the_queue_fail_or_are_skipped_and_counted(
    spark: Any, tmp_path: Path
) -> None:
    url = f"file://{tmp_path}/buf"
    buf = tieredbuf.open(url)
    _fill(buf, 4)
    _, rows = _run_stream(spark, url, tmp_path / "ck")
    assert _seqs(rows) == [0, 1, 2, 3]
    _fill(buf, 4, start=4)
    _dequeue_through(buf, 5)  # someone else consumed 4 and 5 before this query ran again
    with pytest.raises(StreamingQueryException, match="already dequeued"):
        _run_stream(spark, url, tmp_path / "ck")
    q, rows = _run_stream(spark, url, tmp_path / "ck", failOnDataLoss="false")
    assert _seqs(rows) == [0, 1, 2, 3, 6, 7]
    assert max(o.get("lostSequences", 0) for o in _latest_offsets(q)) == 2


def test_skipped_sequences_are_counted_once(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/buf"
    buf = tieredbuf.open(url)
    _fill(buf, 6)
    _dequeue_through(buf, 2)
    strict = _stream_reader(url)
    with pytest.raises(DataLossError, match="already dequeued"):
        strict.latestOffset({"sequence": 0}, strict.getDefaultReadLimit())
    r = _stream_reader(url, failOnDataLoss="false")
    start = {"sequence": 0}
    end = r.latestOffset(start, r.getDefaultReadLimit())
    assert (end["sequence"], end["from"]) == (6, 0)
    parts = r.partitions(start, end)
    assert [ref.sequence for p in parts for ref in p.refs] == [3, 4, 5]
    r.partitions(start, end)  # planned again (a re-run): not counted twice
    assert r.lost_sequences == 3
    assert r.reportLatestOffset()["lostSequences"] == 3


# --- defect 5: kept history ----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.spark
def test_retained_history_is_readable_from_earliest(spark: Any, tmp_path: Path) -> None:
    url = f"file://{tmp_path}/buf"
    buf = tieredbuf.open(url)
    buf.set_retention(max_age=timedelta(days=1))
    _fill(buf, 5)
    _dequeue_through(buf, 2)  # acked, but kept: retention
    snap = buf.snapshot()
    assert (snap.low, snap.head) == (0, 3)
    assert _seqs(spark.read.format("tieredbuf").load(url)) == [0, 1, 2, 3, 4]
    assert _seqs(spark.read.format("tieredbuf").option("startingOffsets", "1").load(url)) == [
        1,
        2,
        3,
        4,
    ]
    assert _stream_reader(url).initialOffset()["sequence"] == 0
    assert _stream_reader(url, startingOffsets="1").initialOffset()["sequence"] == 1
    assert _stream_reader(url, startingTimestamp=str(T0 + 1)).initialOffset()["sequence"] == 1


# --- defect 6: no buffer, another buffer ---------------------------------------------------


@pytest.mark.slow
@pytest.mark.spark
def test_a_path_with_no_buffer_is_an_error_and_is_never_created(spark: Any, tmp_path: Path) -> None:
    url = f"file://{tmp_path}/mistyped"
    with pytest.raises(Exception, match=r"no tieredbuf buffer at .*mistyped"):
        spark.read.format("tieredbuf").load(url).collect()
    for options in ({}, {"consumer": "etl"}):
        with pytest.raises(BufferNotFoundError, match="mistyped"):
            _stream_reader(url, **options).initialOffset()
    with pytest.raises(StreamingQueryException, match="no tieredbuf buffer"):
        _run_stream(spark, url, tmp_path / "ck", consumer="etl")
    assert not tieredbuf.open(url).exists()
    assert not (tmp_path / "mistyped").exists()  # no manifest, not even the folder


def test_offsets_of_another_buffer_fail(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/buf"
    buf = tieredbuf.open(url)
    _fill(buf, 4)
    r = _stream_reader(url)
    start = r.initialOffset()
    end = r.latestOffset(start, r.getDefaultReadLimit())
    assert end["sequence"] == 4 and end["buffer"] == buf.snapshot().buffer_id
    assert end["from"] == 0
    assert len(r.partitions(start, end)) >= 1
    # an offset from an older format (no buffer id) is still accepted
    old = {"sequence": 2}
    assert r.latestOffset(old, r.getDefaultReadLimit())["sequence"] == 4
    # the buffer is deleted and created again, with more entries than the checkpoint saw
    buf.store.delete_many([keys.MANIFEST_KEY])
    _fill(buf, 6)
    r = _stream_reader(url)
    with pytest.raises(DataLossError, match="offsets are of buffer"):
        r.latestOffset(end, r.getDefaultReadLimit())
    with pytest.raises(DataLossError, match="offsets are of buffer"):
        r.partitions(start, end)
    # ... or with fewer (a regression even without an id to compare)
    buf.store.delete_many([keys.MANIFEST_KEY])
    _fill(buf, 2)
    with pytest.raises(DataLossError, match="past the end"):
        _stream_reader(url).latestOffset({"sequence": 4}, r.getDefaultReadLimit())


@pytest.mark.spark
@pytest.mark.slow  # test_offsets_of_another_buffer_fail holds the rule in the quick run
def test_a_recreated_buffer_fails_the_query(spark: Any, tmp_path: Path) -> None:
    url = f"file://{tmp_path}/buf"
    buf = tieredbuf.open(url)
    _fill(buf, 3)
    _, rows = _run_stream(spark, url, tmp_path / "ck")
    assert _seqs(rows) == [0, 1, 2]
    buf.store.delete_many([keys.MANIFEST_KEY])
    _fill(buf, 5)
    with pytest.raises(StreamingQueryException, match="offsets are of buffer"):
        _run_stream(spark, url, tmp_path / "ck")
