"""The sink: exactly-once appends tagged (producerId, version), aborts that clean up,
and commits that stay safe (and cheap) when a job outlives half the GC grace period.

Defect 3: a reused producerId (a new checkpoint, a second query) used to have its
appends treated as retries and skipped; a tag below the recorded one is now a loud
failure naming the option.  Batch writes get the same idempotence with
``producerId`` + ``batchVersion`` (Delta's txnAppId / txnVersion) and otherwise record
nothing in the manifest (no watermark per job).  Defect 7: stale objects are copied
server-side, in parallel, by the buffer's own grace period.  Defect 8: abort deletes.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pyspark.errors import StreamingQueryException
from ulid import ULID

import tieredbuf
from tests.faults import CountingStore
from tests.spark.conftest import spark_options, unique
from tests.spark.util import append_records, consume_all
from tieredbuf import gc, keys
from tieredbuf.errors import ConfigError, DataLossError
from tieredbuf.format.manifest import MetadataItem
from tieredbuf.spark import options as opt
from tieredbuf.spark import writer as wr

pytestmark = pytest.mark.spark


def _records(buf: tieredbuf.Buffer) -> list[bytes]:
    return sorted(r for _, recs in consume_all(buf) for r in recs)


def _source(url: str, n: int) -> tieredbuf.Buffer:
    src = tieredbuf.open(url)
    for s in range(n):
        append_records(src, [[b"m%d-%d" % (s, j) for j in range(3)]], ts_ms=1000)
    return src


def _pipe(spark: Any, src: str, dst: str, ckpt: Path, **sink: str) -> Any:
    """One AvailableNow run: source buffer -> sink buffer, one object per micro-batch."""
    return (
        spark.readStream.format("tieredbuf")
        .option("maxOffsetsPerTrigger", "1")
        .load(src)
        .select("value")
        .writeStream.format("tieredbuf")
        .options(**sink)
        .option("checkpointLocation", str(ckpt))
        .trigger(availableNow=True)
        .start(dst)
    )


@pytest.mark.slow
def test_a_reused_producerId_fails_the_query_instead_of_dropping_its_data(
    spark: Any, tmp_path: Path
) -> None:
    src, dst = f"file://{tmp_path}/src", f"file://{tmp_path}/dst"
    _source(src, 3)
    sink = tieredbuf.open(dst)
    pid = unique("etl")
    q = _pipe(spark, src, dst, tmp_path / "ck1", producerId=pid, createBuffer="true")
    assert q.awaitTermination(120) and q.exception() is None
    first = _records(sink)
    assert len(first) == 9
    # a new checkpoint (a new query) with the same producerId: its batch ids restart at 0
    with pytest.raises(StreamingQueryException, match=f"producerId='{pid}'"):
        q = _pipe(spark, src, dst, tmp_path / "ck2", producerId=pid)
        q.awaitTermination(120)
    assert _records(sink) == first  # nothing appended, and the failure is loud, not a skip


@pytest.mark.slow
def test_crash_between_offset_log_and_commit_log_loses_and_doubles_nothing(
    spark: Any, tmp_path: Path
) -> None:
    """Spark writes a micro-batch's offsets, runs it (the sink appends), then writes its
    commit log; a crash in between re-runs the batch on restart.  The re-run's append
    carries the same (producerId, batch id) and is recognised; the source, the queue's
    consumer, still holds the batch (commit is one micro-batch late)."""
    src_url, dst = f"file://{tmp_path}/src", f"file://{tmp_path}/dst"
    src = _source(src_url, 3)
    sink = tieredbuf.open(dst)
    name, pid, ckpt = unique("c"), unique("p"), tmp_path / "ck"
    sink_opts = {"producerId": pid, "createBuffer": "true"}

    def run() -> None:
        q = (
            spark.readStream.format("tieredbuf")
            .option("consumer", name)
            .option("maxOffsetsPerTrigger", "1")
            .load(src_url)
            .select("value")
            .writeStream.format("tieredbuf")
            .options(**sink_opts)
            .option("checkpointLocation", str(ckpt))
            .trigger(availableNow=True)
            .start(dst)
        )
        assert q.awaitTermination(120), "the query did not finish"
        assert q.exception() is None

    run()
    last = max(int(p.name) for p in (ckpt / "commits").iterdir() if p.name.isdigit())
    assert last == 2 and (ckpt / "offsets" / str(last)).exists()
    (ckpt / "commits" / str(last)).unlink()  # the crash: offsets written, commit not
    for crc in (ckpt / "commits").glob(f".{last}.crc"):
        crc.unlink()
    assert src.snapshot().head <= 2  # batch 2's object is still queued at the source
    run()
    got = [r for _, recs in consume_all(sink) for r in recs]
    assert sorted(got) == sorted(b"m%d-%d" % (s, j) for s in range(3) for j in range(3))
    assert len(set(got)) == len(got)


@pytest.mark.slow
def test_batch_writes_are_idempotent_per_producerId_and_batchVersion(
    spark: Any, tmp_path: Path
) -> None:
    url = f"file://{tmp_path}/buf"
    buf = tieredbuf.open(url)
    df = spark.createDataFrame([(f"v{i}",) for i in range(6)], "value string").repartition(2)

    def write(**options: str) -> None:
        df.write.format("tieredbuf").options(createBuffer="true", **options).mode("append").save(
            url
        )

    write()  # no producerId: nothing recorded in the manifest
    assert buf.snapshot().view.watermarks == {}
    write(producerId="daily", batchVersion="7")
    write(producerId="daily", batchVersion="7")  # a retry of version 7: appends nothing
    assert len(buf.entries()) == 4
    with pytest.raises(Exception, match=r"producerId='daily'.*version 7.*version 3"):
        write(producerId="daily", batchVersion="3")
    write(producerId="daily", batchVersion="8")
    assert len(buf.entries()) == 6
    assert list(buf.snapshot().view.watermarks) == ["daily"]
    for bad in (
        {"producerId": "x"},
        {"batchVersion": "1"},
        {"batchVersion": "-1", "producerId": "x"},
    ):
        with pytest.raises(Exception, match="batchVersion"):
            write(**bad)


def _fail_on_v7(v: Any) -> Any:
    if v == "v7":
        raise ValueError("boom")
    return v


@pytest.mark.slow
def test_an_aborted_job_appends_nothing_and_leaves_only_what_gc_reclaims(
    spark: Any, tmp_path: Path
) -> None:
    """Four tasks, one fails.  The driver's abort deletes what the tasks that reported
    uploaded, a failing task its own (test below); a task still running when Spark
    aborts may finish its upload afterwards: that object is referenced by nothing, and
    GC past the grace period takes it.  Nothing of the job is ever visible.  (The queue
    stays empty: GC keeps unreferenced objects newer than the oldest referenced one.)"""
    from pyspark.sql.functions import udf

    url = f"file://{tmp_path}/buf"
    buf = tieredbuf.open(url)
    buf.create()

    boom = udf(lambda v: _fail_on_v7(v), "string")  # no type hints: a plain Python UDF
    df = spark.createDataFrame([(f"v{i}",) for i in range(8)], "value string").repartition(4)
    with pytest.raises(Exception, match="boom"):
        df.select(boom("value").alias("value")).write.format("tieredbuf").mode("append").save(url)
    assert buf.entries() == []
    # a task Spark cancelled may still be uploading in its Python worker after the job
    # failed (Spark's task bookkeeping does not wait for it): GC past the grace period
    # takes whatever lands, so poll GC + listing against a deadline
    later = int(time.time() * 1000) + 2 * 86_400_000  # past any grace period
    deadline = time.monotonic() + 120
    while True:
        gc.run_once(buf, now_ms=later)
        left = {m.key for m in buf.store.list("data/")}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)  # polling a condition with a deadline
    assert left == set()
    assert buf.entries() == []


def test_a_failing_task_deletes_what_it_uploaded(tmp_path: Path) -> None:
    """The executor side alone: objects uploaded before the task's input fails are gone."""
    url = f"file://{tmp_path}/buf"
    buf = tieredbuf.open(url)
    append_records(buf, [[b"existing"]], ts_ms=1000)
    kept = {m.key for m in buf.store.list("data/")}
    wo = opt.parse_write_options({"path": url, "maxObjectBytes": "1"})
    uploaded: list[set[str]] = []

    def batches() -> Any:
        for i in range(3):
            yield pa.record_batch([pa.array([b"r%d" % i], pa.binary())], names=["value"])
            uploaded.append({m.key for m in buf.store.list("data/")} - kept)
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        wr.write_task(wo, True, batches())
    assert [len(u) for u in uploaded] == [1, 2, 3]  # it did upload, one object per batch
    assert {m.key for m in buf.store.list("data/")} == kept


# --- the commit, without a SparkSession -------------------------------------------------


class KeyLog(CountingStore):
    """Counts calls and remembers which keys were read whole."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.got: list[str] = []

    def get(self, key: str) -> Any:
        self.got.append(key)
        return super().get(key)


def _uploaded(buf: tieredbuf.Buffer, ages_min: list[int]) -> wr.UploadedObjects:
    """Objects uploaded ``ages_min`` minutes ago (ULID-named then), never enqueued."""
    now = wr._now_ms()
    msg = wr.UploadedObjects()
    for i, age in enumerate(ages_min):
        key = keys.data_key(ULID.from_timestamp((now - age * 60_000) / 1000))
        from tieredbuf.format.batch import encode_batch

        body = encode_batch([b"r%d" % i])
        buf.store.put(key, body, mode="create")
        msg.objects.append((key, (MetadataItem(0, now, b""),), len(body)))
    return msg


@pytest.mark.parametrize(
    "buffer_url", ["local", pytest.param("s3", marks=pytest.mark.s3)], indirect=True
)
def test_I5_stale_objects_are_copied_server_side_by_the_buffers_grace(
    buffer_url: tuple[str, dict[str, Any]],
) -> None:
    url, store_opts = buffer_url
    counting = KeyLog(tieredbuf.open(url, **store_opts).store)
    buf = tieredbuf.Buffer(counting)
    append_records(buf, [[b"seed"]], ts_ms=1000)
    buf.set_gc_grace_period(timedelta(hours=2))
    wo = opt.parse_write_options({"path": url, **spark_options(store_opts)})
    msg = _uploaded(buf, [90, 50, 0])  # minutes: only the first is past half of 2 hours
    old = [k for k, _, _ in msg.objects]
    counting.reset()
    counting.got.clear()
    seqs = wr.publish(buf, wo, [msg], None, None)
    assert seqs == [1, 2, 3]
    locs = [e.location for e in buf.entries()[1:]]
    assert locs[1:] == old[1:] and locs[0] != old[0]
    assert counting.counts["copy"] == 1
    assert set(counting.got) == {keys.MANIFEST_KEY}  # no object passed through the driver
    assert counting.counts["put"] == 1  # the root's CAS, never an object's bytes
    # with the buffer's grace shortened, every old object is copied (in parallel)
    buf.set_gc_grace_period(timedelta(minutes=20))
    msg = _uploaded(buf, [11, 12, 13, 1])
    counting.reset()
    wr.publish(buf, wo, [msg], None, None)
    assert counting.counts["copy"] == 3


def test_a_stale_object_that_is_gone_fails_the_commit(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/buf"
    buf = tieredbuf.open(url)
    append_records(buf, [[b"seed"]], ts_ms=1000)
    msg = _uploaded(buf, [30])  # past half the default 10 minutes
    buf.store.delete_many([msg.objects[0][0]])  # GC got there first
    wo = opt.parse_write_options({"path": url})
    with pytest.raises(DataLossError, match="set_gc_grace_period"):
        wr.publish(buf, wo, [msg], None, None)
    assert len(buf.entries()) == 1


def test_abort_keeps_what_its_commit_appended(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/buf"
    buf = tieredbuf.open(url)
    append_records(buf, [[b"seed"]], ts_ms=1000)
    since = buf.snapshot().root.next_seq
    wo = opt.parse_write_options({"path": url})
    landed, lost = _uploaded(buf, [0]), _uploaded(buf, [0, 0])
    wr.publish(buf, wo, [landed], None, None)
    wr.abort(buf, [landed], since)  # a commit that appended, then failed: kept
    assert buf.store.head(landed.objects[0][0]).size > 0
    wr.abort(buf, [lost, None], since)
    assert all(k not in {m.key for m in buf.store.list("data/")} for k, _, _ in lost.objects)


def test_write_options_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"no longer supported.*grace"):
        opt.parse_write_options({"path": "file:///x", "gcGracePeriodSeconds": "60"})
    with pytest.raises(ConfigError, match="batchVersion needs producerId"):
        opt.parse_write_options({"path": "file:///x", "batchVersion": "1"})
    assert (
        opt.parse_write_options(
            {"path": "file:///x", "producerId": "p", "batchVersion": "0"}
        ).batch_version
        == 0
    )
