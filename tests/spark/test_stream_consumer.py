"""A checkpoint and the ``consumer`` it ran as (named subscribers, I9).

A query's checkpoint belongs to the subscriber it acked as.  Restarted under another
``consumer`` name (or none), the old subscriber would stay registered and hold the
buffer's head back forever, the buffer growing without bound and nothing said: the
restart fails, naming the old subscriber and the command that removes it.  Once it is
removed, the checkpoint goes on under the new name.
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
from tieredbuf.errors import ConfigError
from tieredbuf.spark import options as opt
from tieredbuf.spark.source import records_struct
from tieredbuf.spark.stream import StreamReader


def _reader(url: str, **options: str) -> StreamReader:
    return StreamReader(opt.parse_read_options({"path": url, **options}), records_struct())


def _fill(url: str, n: int) -> tieredbuf.Buffer:
    buf = tieredbuf.open(url)
    for s in range(n):
        append_records(buf, [[b"%d" % s]], ts_ms=1000)
    return buf


def _run(r: StreamReader, start: dict[str, Any]) -> dict[str, Any]:
    """One micro-batch, as Spark runs it: plan, read (not here), then commit."""
    end = r.latestOffset(start, r.getDefaultReadLimit())
    r.partitions(start, end)
    r.commit(end)
    return end


def test_a_checkpoint_restarted_under_another_consumer_fails_naming_the_old_subscriber(
    tmp_path: Path,
) -> None:
    url = f"file://{tmp_path}/buf"
    buf = _fill(url, 3)
    first = _reader(url, consumer="etl")
    end = _run(first, first.initialOffset())  # the checkpoint's last offset
    first.stop()
    _fill(url, 2)
    remove = f"tieredbuf subscribers remove {url} etl"
    for options in ({"consumer": "etl2"}, {}):  # renamed, or the option dropped
        r = _reader(url, **options)
        with pytest.raises(ConfigError, match=rf"subscriber 'etl'.*{remove}"):
            r.latestOffset(end, r.getDefaultReadLimit())
        with pytest.raises(ConfigError, match=rf"subscriber 'etl'.*{remove}"):
            r.commit(end)  # Spark commits the checkpoint's last batch on a restart too
    assert {s.name for s in buf.subscribers()} == {"etl"}  # "etl2" not registered
    assert buf.snapshot().head == 3
    assert buf.remove_subscriber("etl")
    r = _reader(url, consumer="etl2")  # the old one is gone: the checkpoint goes on
    nxt = _run(r, end)
    assert (nxt["from"], nxt["sequence"]) == (3, 5)
    r.stop()
    assert {s.name for s in buf.subscribers()} == {"etl2"}
    assert buf.snapshot().head == 5


def test_a_checkpoint_without_consumer_may_take_one_up(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/buf"
    _fill(url, 3)
    plain = _reader(url)
    end = _run(plain, plain.initialOffset())
    _fill(url, 1)
    r = _reader(url, consumer="etl")
    assert _run(r, end)["sequence"] == 4


@pytest.mark.spark
@pytest.mark.slow
def test_a_query_restarted_under_another_consumer_name_fails_loudly(
    spark: Any, tmp_path: Path
) -> None:
    url = f"file://{tmp_path}/buf"
    buf = _fill(url, 3)
    old, new, ckpt = unique("a"), unique("b"), tmp_path / "ck"

    def run(name: str) -> Any:
        return (
            spark.readStream.format("tieredbuf")
            .option("consumer", name)
            .load(url)
            .writeStream.format("noop")
            .option("checkpointLocation", str(ckpt))
            .trigger(availableNow=True)
            .start()
        )

    q = run(old)
    assert q.awaitTermination(120) and q.exception() is None
    _fill(url, 2)
    q = run(new)
    with pytest.raises(StreamingQueryException, match=f"subscriber '{old}'.*subscribers remove"):
        q.awaitTermination(120)
    assert {s.name for s in buf.subscribers()} == {old}


def test_sequences_skipped_with_failOnDataLoss_false_are_counted_in_the_subscribers_lost(
    tmp_path: Path,
) -> None:
    """Retention unlinked what subscriber "etl" had not read (I9 allows it with a
    retention policy); with failOnDataLoss=false the query skips it, and the subscriber's
    own ``lost`` count (``tieredbuf subscribers``) says how much, once -- a re-run of the
    micro-batch after a restart does not count it again."""
    url = f"file://{tmp_path}/buf"
    buf = tieredbuf.open(url)
    for s in range(3):
        append_records(buf, [[b"old%d" % s]], ts_ms=1000)  # ingested long ago
    r = _reader(url, consumer="etl", failOnDataLoss="false")
    start = r.initialOffset()
    assert start["sequence"] == 0
    for s in range(2):
        append_records(buf, [[b"new%d" % s]], ts_ms=now_ms())
    buf.set_retention(max_age=timedelta(hours=1))  # unlinks 0..2 under "etl"
    assert buf.snapshot().low == 3

    def lost() -> int:
        (info,) = [s for s in buf.subscribers() if s.name == "etl"]
        return info.lost

    end = r.latestOffset(start, r.getDefaultReadLimit())
    assert [ref.sequence for p in r.partitions(start, end) for ref in p.refs] == [3, 4]
    r.stop()  # stopped before Spark committed the batch: it re-runs on restart
    again = _reader(url, consumer="etl", failOnDataLoss="false")
    again.partitions(start, end)  # the re-run
    again.commit(end)
    again.stop()
    assert lost() == 3
    assert r.lost_sequences == 3  # the run's own count (the query progress)


def test_a_start_refused_by_its_options_registers_no_subscriber(tmp_path: Path) -> None:
    """A query that fails on its options must not leave a subscriber behind that holds
    the head back (what item 9 is about, at the first start)."""
    url, other = f"file://{tmp_path}/buf", f"file://{tmp_path}/other"
    buf = _fill(url, 3)
    theirs = _fill(other, 1).snapshot().buffer_id
    for start in ("20", json.dumps({"sequence": 1, "buffer": theirs})):
        r = _reader(url, consumer="etl", startingOffsets=start)
        with pytest.raises(ConfigError, match="startingOffsets"):
            r.initialOffset()
        assert [s.name for s in buf.subscribers()] == []
