"""The sink's exactly-once tag ``(producerId, version)`` against writers that reuse it.

A streaming commit is tagged with its micro-batch id, so two queries using the same
``producerId`` (a new checkpoint, a second query) tag their first micro-batches
alike.  An equal tag from *another* query must fail with ProducerIdReusedError,
never be skipped as if it had landed (silent loss, and with ``consumer`` on the
source an ack of data that went nowhere); Spark's query id, stable across restarts
of one checkpoint, tells the two apart.  A re-run of the same query's micro-batch
(the same checkpoint) stays a no-op (I2).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pyspark.errors import StreamingQueryException
from ulid import ULID

import tieredbuf
from tests.spark.conftest import unique
from tests.spark.util import append_records, consume_all
from tieredbuf import keys
from tieredbuf.errors import ConfigError, ProducerIdReusedError, TieredBufError
from tieredbuf.format.batch import encode_batch
from tieredbuf.format.manifest import MetadataItem, NewEntry
from tieredbuf.spark import options as opt
from tieredbuf.spark import writer as wr

pytestmark = pytest.mark.spark


def _records(buf: tieredbuf.Buffer) -> list[bytes]:
    return sorted(r for _, recs in consume_all(buf) for r in recs)


def _source(url: str, tag: bytes, n: int) -> tieredbuf.Buffer:
    src = tieredbuf.open(url)
    for s in range(n):
        append_records(src, [[tag + b"%d" % s]], ts_ms=1000)
    return src


def _one_batch(
    spark: Any, src: str, dst: str, ckpt: Path, consumer: str | None, **sink: str
) -> Any:
    """One AvailableNow run reading all of ``src`` in one micro-batch (batch id 0)."""
    reader = spark.readStream.format("tieredbuf")
    if consumer is not None:
        reader = reader.option("consumer", consumer)
    return (
        reader.load(src)
        .select("value")
        .writeStream.format("tieredbuf")
        .options(**sink)
        .option("checkpointLocation", str(ckpt))
        .trigger(availableNow=True)
        .start(dst)
    )


def _position(buf: tieredbuf.Buffer, name: str) -> int:
    (info,) = [s for s in buf.subscribers() if s.name == name]
    return info.next_sequence


@pytest.mark.slow
def test_a_reused_producerId_with_an_equal_batch_id_fails_and_acks_nothing_at_the_source(
    spark: Any, tmp_path: Path
) -> None:
    a_url, b_url, dst = (f"file://{tmp_path}/{n}" for n in ("a", "b", "dst"))
    _source(a_url, b"A", 3)
    b = _source(b_url, b"B", 3)
    sink = tieredbuf.open(dst)
    pid, name = unique("etl"), unique("x")
    q = _one_batch(spark, a_url, dst, tmp_path / "ck1", None, producerId=pid, createBuffer="true")
    assert q.awaitTermination(120) and q.exception() is None
    assert _records(sink) == [b"A0", b"A1", b"A2"]
    # another query (checkpoint ck2) with the same producerId: its micro-batch 0 carries
    # the very tag query 1's batch 0 recorded, yet it never landed
    q = _one_batch(spark, b_url, dst, tmp_path / "ck2", name, producerId=pid)
    with pytest.raises(StreamingQueryException, match=f"producerId='{pid}'"):
        q.awaitTermination(120)
    assert _records(sink) == [b"A0", b"A1", b"A2"]  # nothing appended...
    assert _position(b, name) == 0  # ...and nothing of B acked at the source
    assert len(b.entries()) == 3


@pytest.mark.slow
def test_a_rerun_of_the_same_querys_batch_after_a_restart_stays_a_no_op(
    spark: Any, tmp_path: Path
) -> None:
    """The crash between Spark's offset log and its commit log, for the one-batch run:
    the restarted query (same checkpoint, so the same query id) re-runs micro-batch 0,
    whose append already landed: nothing is appended twice, and nothing fails."""
    a_url, dst = f"file://{tmp_path}/a", f"file://{tmp_path}/dst"
    _source(a_url, b"A", 3)
    sink = tieredbuf.open(dst)
    pid, ckpt = unique("etl"), tmp_path / "ck"
    q = _one_batch(spark, a_url, dst, ckpt, None, producerId=pid, createBuffer="true")
    assert q.awaitTermination(120) and q.exception() is None
    (ckpt / "commits" / "0").unlink()  # offsets of batch 0 written, its commit not
    for crc in (ckpt / "commits").glob(".0.crc"):
        crc.unlink()
    q = _one_batch(spark, a_url, dst, ckpt, None, producerId=pid)
    assert q.awaitTermination(120) and q.exception() is None
    assert (ckpt / "commits" / "0").exists()  # the batch did re-run
    assert _records(sink) == [b"A0", b"A1", b"A2"]


# --- the commit, without a SparkSession -------------------------------------------------


def _msg(buf: tieredbuf.Buffer, query_id: str | None, n: int = 1) -> wr.UploadedObjects:
    """``n`` uploaded (never enqueued) objects, as a task of ``query_id`` reports them."""
    msg = wr.UploadedObjects(query_id=query_id)
    for _ in range(n):
        key = keys.data_key(ULID())
        body = encode_batch([key.encode()])
        buf.store.put(key, body, mode="create")
        msg.objects.append((key, (MetadataItem(0, wr._now_ms(), b""),), len(body)))
    return msg


def _wo(url: str) -> opt.WriteOptions:
    return opt.parse_write_options({"path": url, "createBuffer": "true"})


def test_a_streaming_commit_is_told_from_another_querys_equal_tag(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/buf"
    buf, wo = tieredbuf.open(url), _wo(url)
    first = _msg(buf, "q1")
    assert wr.publish(buf, wo, [first], "p", 0, streaming=True) == [0]
    # the same query re-running its batch 0 (new tasks, new objects): already landed
    wr.publish(buf, wo, [_msg(buf, "q1")], "p", 0, streaming=True)
    assert len(buf.entries()) == 1
    for version in (0, 1, 5):  # another query: equal, next or later batch ids all fail
        with pytest.raises(ProducerIdReusedError, match=r"producerId='p'.*streaming query q1"):
            wr.publish(buf, wo, [_msg(buf, "q2")], "p", version, streaming=True)
    # a batch write with the same producerId is another writer too, and the other way round
    with pytest.raises(ProducerIdReusedError, match="streaming query q1"):
        wr.publish(buf, wo, [_msg(buf, None)], "p", 9)
    assert wr.publish(buf, wo, [_msg(buf, None)], "b", 3) == [1]
    with pytest.raises(ProducerIdReusedError, match=r"producerId='b'.*batch write"):
        wr.publish(buf, wo, [_msg(buf, "q3")], "b", 3, streaming=True)
    assert buf.entries()[0].location == first.objects[0][0]
    assert len(buf.entries()) == 2
    assert wr.publish(buf, wo, [_msg(buf, "q1")], "p", 1, streaming=True) == [2]
    assert set(buf.snapshot().view.watermarks) == {"p#spark-query=q1", "b"}


def test_a_streaming_commit_over_a_watermark_without_query_id_goes_on_only_above_it(
    tmp_path: Path,
) -> None:
    """A watermark recorded under the bare producerId (a query run by a tieredbuf that
    recorded no query id) cannot be told from a retry of ours when it is not below this
    commit: fail loudly; above it, the query goes on under its own watermark id."""
    url = f"file://{tmp_path}/buf"
    buf, wo = tieredbuf.open(url), _wo(url)
    (e,) = [NewEntry(k, m, s) for k, m, s in _msg(buf, None).objects]
    buf.queue.append([e], "p", 5 * opt.STRIDE)  # batch id 4, recorded the old way
    for version in (3, 4):
        with pytest.raises(ProducerIdReusedError, match=r"up to version 4 by a batch write"):
            wr.publish(buf, wo, [_msg(buf, "q1")], "p", version, streaming=True)
    assert wr.publish(buf, wo, [_msg(buf, "q1")], "p", 5, streaming=True) == [1]
    assert wr.publish(buf, wo, [_msg(buf, "q1")], "p", 6, streaming=True) == [2]


def test_a_micro_batch_whose_tasks_name_no_query_is_refused(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/buf"
    buf, wo = tieredbuf.open(url), _wo(url)
    with pytest.raises(TieredBufError, match="cannot tell which streaming query"):
        wr.publish(buf, wo, [_msg(buf, None)], "p", 0, streaming=True)
    with pytest.raises(TieredBufError, match="cannot tell which streaming query"):
        wr.publish(buf, wo, [_msg(buf, "q1"), _msg(buf, "q2")], "p", 0, streaming=True)
    assert not buf.snapshot().exists


def test_a_producerId_cannot_carry_the_query_tag() -> None:
    with pytest.raises(ConfigError, match="cannot contain"):
        opt.parse_write_options({"path": "file:///x", "producerId": "a#spark-query=b"})
