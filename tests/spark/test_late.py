"""Late records: an older ingestion time appended after newer ones.

Made the way they happen: a staged producer acks records LOCAL and is killed with
SIGKILL before its segment reaches the store; others append newer records; then its
stage is drained (``tieredbuf drain``) and its records land *after* the newer ones,
with their original, older ingestion times.  Time ranges must not lose them:

* streaming: ``startingTimestamp`` only chooses the first micro-batch's start;
  every record after it is delivered, whatever its time (defect 1);
* batch: adjacent windows ``[t0, t1)``, ``[t1, t2)`` together return every record
  exactly once (defect 2), each record in the window of its own time.
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from ulid import ULID

import tieredbuf
from tests.spark.conftest import unique
from tests.spark.util import (
    after,
    append_records,
    drain_stage,
    kill_after_local_acks,
    now_ms,
    record_times,
)
from tieredbuf import keys
from tieredbuf.format.batch import encode_batch
from tieredbuf.format.manifest import MetadataItem, NewEntry
from tieredbuf.spark import arrow as ta
from tieredbuf.spark import executor as ex
from tieredbuf.spark import options as opt
from tieredbuf.spark import plan as pl


def _values(df: Any) -> list[bytes]:
    return [bytes(r.value) for r in df.select("value").collect()]


@pytest.mark.spark
@pytest.mark.slow
def test_streaming_startingTimestamp_only_chooses_the_start(spark: Any, tmp_path: Path) -> None:
    url = f"file://{tmp_path}/buf"
    buf = tieredbuf.open(url)
    append_records(buf, [[b"before-0", b"before-1"]], ts_ms=now_ms())
    late = kill_after_local_acks(url, tmp_path / "stage", "late", 3)
    start = after(now_ms())  # newer than every late record
    append_records(buf, [[b"new-0", b"new-1"]], ts_ms=start)
    name, out, ckpt = unique("late"), tmp_path / "out", tmp_path / "ckpt"

    def run() -> list[bytes]:
        q = (
            spark.readStream.format("tieredbuf")
            .option("startingTimestamp", str(start))
            .option("consumer", name)
            .load(url)
            .select("value")
            .writeStream.format("parquet")
            .option("checkpointLocation", str(ckpt))
            .trigger(availableNow=True)
            .start(str(out))
        )
        assert q.awaitTermination(120), "the query did not finish"
        assert q.exception() is None
        return _values(spark.read.parquet(str(out)))

    assert sorted(run()) == [b"new-0", b"new-1"]
    drain_stage(buf, tmp_path / "stage")  # the killed producer's records land now
    times = record_times(buf)
    assert all(times[r] < start for r in late)
    got = run()
    assert sorted(got) == sorted([b"new-0", b"new-1", *late])  # each exactly once
    assert run() == got  # nothing more, nothing twice


@pytest.mark.spark
@pytest.mark.slow
def test_adjacent_batch_time_windows_return_late_records_once(spark: Any, tmp_path: Path) -> None:
    url = f"file://{tmp_path}/buf"
    buf = tieredbuf.open(url)
    append_records(buf, [[b"a-0", b"a-1"]], ts_ms=after(now_ms()))
    late = kill_after_local_acks(url, tmp_path / "stage", "late", 3)
    t1 = after(now_ms())
    append_records(buf, [[b"b-0"]], ts_ms=t1)
    append_records(buf, [[b"b-1"]], ts_ms=after(t1))
    drain_stage(buf, tmp_path / "stage")
    times = record_times(buf)
    t_mid = min(times[r] for r in late)  # splits the early records from the late ones
    assert max(times[b"a-0"], times[b"a-1"]) < t_mid < t1

    def window(lo: int, hi: int | None) -> list[bytes]:
        r = spark.read.format("tieredbuf").option("startingTimestamp", str(lo))
        if hi is not None:
            r = r.option("endingTimestamp", str(hi))
        return _values(r.load(url))

    for bounds in ([0, t1, None], [0, t_mid, t1, None]):
        got = [window(lo, hi) for lo, hi in itertools.pairwise(bounds)]
        for (lo, hi), rows in zip(itertools.pairwise(bounds), got, strict=True):
            assert all(lo <= times[v] and (hi is None or times[v] < hi) for v in rows)
        every = [v for rows in got for v in rows]
        assert sorted(every) == sorted(times), "a record was lost or returned twice"


# --- the planning rule without Spark ----------------------------------------------------


def _append(buf: tieredbuf.Buffer, times: list[int], tag: str) -> None:
    """One .batch object: record i ingested at times[i] (one metadata item each)."""
    recs = [f"{tag}/{i}".encode() for i in range(len(times))]
    key = keys.data_key(ULID(), keys.BATCH_SUFFIX)
    body = encode_batch(recs)
    buf.store.put(key, body, mode="create")
    items = tuple(MetadataItem(i, t, b"") for i, t in enumerate(times))
    buf.queue.append([NewEntry(key, items, len(body))], "w", buf.snapshot().root.next_seq + 1)


def _window(buf: tieredbuf.Buffer, lo: int | None, hi: int | None) -> list[bytes]:
    """What a batch read of ``[lo, hi)`` returns, planned and read as Spark would."""
    ro = opt.parse_read_options(
        {
            "path": buf.url,
            **({} if lo is None else {"startingTimestamp": str(lo)}),
            **({} if hi is None else {"endingTimestamp": str(hi)}),
        }
    )
    snap = pl.read_snapshot(buf)
    start, end = pl.batch_range(buf, snap, ro)
    out = []
    for part in pl.plan_range(buf, snap, start, end, ro, lo, hi):
        for b in ex.read_partition(ro, ta.records_schema(), part):
            out += b.column("value").to_pylist()
    return out


def test_a_window_ends_after_the_last_object_holding_a_record_before_its_end(
    tmp_path: Path,
) -> None:
    buf = tieredbuf.open(f"file://{tmp_path}/buf")
    _append(buf, [1000], "a")
    _append(buf, [3000], "b")
    _append(buf, [1500, 2500], "straddler")  # appended after b; one record each side
    _append(buf, [4000], "c")
    assert sorted(_window(buf, None, 2000)) == [b"a/0", b"straddler/0"]
    assert sorted(_window(buf, 2000, None)) == [b"b/0", b"c/0", b"straddler/1"]


@pytest.mark.parametrize("seed", range(6))
def test_random_interleavings_every_record_in_exactly_one_window(tmp_path: Path, seed: int) -> None:
    """Objects with random ingestion times (some spanning many windows), appended in
    random order into a tree of several levels (M=2): any split of time into windows
    returns each record once, in the window of its own time."""
    rng = random.Random(seed)
    url = f"file://{tmp_path}/buf"
    buf = tieredbuf.open(url, tree=tieredbuf.TreeConfig(m=2))
    want: dict[bytes, int] = {}
    for o in range(rng.randrange(10, 30)):
        base = rng.randrange(0, 10_000)
        times = [
            max(0, base + rng.choice([0, 5, 50, 3000]) * rng.randrange(-2, 3))
            for _ in range(rng.randrange(1, 4))
        ]
        _append(buf, times, str(o))
        want.update({f"{o}/{i}".encode(): t for i, t in enumerate(times)})
    cuts = sorted(rng.sample(range(1, 15_000), rng.randrange(1, 5)))
    bounds: list[int | None] = [None, *cuts, None]
    seen: list[bytes] = []
    for lo, hi in itertools.pairwise(bounds):
        got = _window(buf, lo, hi)
        assert all((lo is None or want[v] >= lo) and (hi is None or want[v] < hi) for v in got)
        seen += got
    assert sorted(seen) == sorted(want)


def test_bundle_windows_are_per_bundle(tmp_path: Path) -> None:
    """A .qseg object's bundles each carry an ingestion time: a window keeps the
    bundles inside it, split across objects and streams alike."""
    from tieredbuf.format.segment import SegmentBundle, encode_segment

    url = f"file://{tmp_path}/buf"
    buf = tieredbuf.open(url)
    for times in ([1000, 2000], [1500, 3000]):  # the second object straddles 2000 again
        body = encode_segment(
            SegmentBundle({0: pa.record_batch({"t": [t]})}, t * 1_000_000, i)
            for i, t in enumerate(times)
        )
        key = keys.data_key(ULID(), keys.SEGMENT_SUFFIX)
        buf.store.put(key, body, mode="create")
        buf.queue.append(
            [NewEntry(key, (MetadataItem(0, max(times), b""),))],
            "w",
            buf.snapshot().root.next_seq + 1,
        )
    schema = pa.schema(
        [("t", pa.int64()), (ta.SEQUENCE_COL, pa.int64()), (ta.BUNDLE_COL, pa.int32())]
    )
    for lo, hi, want in ((None, 2000, [1000, 1500]), (2000, None, [2000, 3000])):
        ro = opt.parse_read_options(
            {
                "path": url,
                "slot": "0",
                **({} if lo is None else {"startingTimestamp": str(lo)}),
                **({} if hi is None else {"endingTimestamp": str(hi)}),
            }
        )
        snap = pl.read_snapshot(buf)
        start, end = pl.batch_range(buf, snap, ro)
        got = [
            t
            for p in pl.plan_range(buf, snap, start, end, ro, lo, hi)
            for b in ex.read_partition(ro, schema, p)
            for t in b.column("t").to_pylist()
        ]
        assert sorted(got) == want


@pytest.mark.spark
@pytest.mark.slow
def test_the_day_by_day_backfill_example_writes_every_record_once(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """examples/spark_backfill_time_range.py over three days whose records were appended
    out of order (a day's late records after the next day's), straddling midnight."""
    import importlib.util
    import sys

    url = f"file://{tmp_path}/buf"
    buf = tieredbuf.open(url)
    day = 86_400_000
    d0 = 1_795_000_000_000 // day * day  # a midnight (UTC)
    want: dict[bytes, int] = {}
    for o, times in enumerate(
        [
            [d0 + 5, d0 + day - 1],
            [d0 + day + 7, d0 + 2 * day - 3],
            [d0 + day - 2, d0 + day + 1],  # late, straddles midnight
            [d0 + 2 * day + 9],
            [d0 + 10, d0 + 2 * day + 1],
        ]
    ):
        _append(buf, times, str(o))
        want.update({f"{o}/{i}".encode(): t for i, t in enumerate(times)})
    path = Path(__file__).resolve().parents[2] / "examples" / "spark_backfill_time_range.py"
    spec = importlib.util.spec_from_file_location("backfill_example", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    out = tmp_path / "out"
    from datetime import UTC, datetime

    first = datetime.fromtimestamp(d0 / 1000, UTC).date().isoformat()
    monkeypatch.setattr(sys, "argv", ["backfill", url, str(out), "--from", first, "--days", "3"])
    try:
        example.main()
    finally:
        spark.conf.unset("spark.sql.sources.partitionOverwriteMode")
    got = spark.read.parquet(str(out)).select("value", "ingestion_time").collect()
    values = [r.value.encode() for r in got]
    assert sorted(values) == sorted(want)


@pytest.mark.spark
@pytest.mark.slow
def test_the_backfill_example_on_an_empty_range_says_so_and_writes_nothing(
    spark: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A documented range with no records: one line per day and for the range, exit 0
    (it used to fail reading back a Parquet folder that was never written)."""
    import importlib.util
    import sys

    url = f"file://{tmp_path}/buf"
    day = 86_400_000
    d0 = 1_795_000_000_000 // day * day
    _append(tieredbuf.open(url), [d0 + 5], "0")  # a record, on another day
    path = Path(__file__).resolve().parents[2] / "examples" / "spark_backfill_time_range.py"
    spec = importlib.util.spec_from_file_location("backfill_example_empty", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    out = tmp_path / "out"
    monkeypatch.setattr(
        sys, "argv", ["backfill", url, str(out), "--from", "2020-01-01", "--days", "2"]
    )
    try:
        example.main()  # returns: exit 0
    finally:
        spark.conf.unset("spark.sql.sources.partitionOverwriteMode")
    text = capsys.readouterr().out
    assert "2020-01-01: no records ingested that day; nothing written" in text
    assert "2020-01-01 .. 2020-01-02: the buffer holds no records" in text
    assert not out.exists()
