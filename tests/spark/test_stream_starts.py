"""Where a streaming query starts: nothing before the requested start is delivered.

``startingOffsets`` past the tail must not be clamped to the tail (that delivers the
sequences between the tail and the requested one), and a ``startingTimestamp`` later
than every record must not start at the tail (that delivers records ingested before
it).  Driver side, without a SparkSession: the offsets and partitions Spark would get.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import tieredbuf
from tests.spark.util import append_records, now_ms
from tieredbuf.errors import ConfigError
from tieredbuf.spark import options as opt
from tieredbuf.spark.source import records_struct
from tieredbuf.spark.stream import StreamReader


def _reader(url: str, **options: str) -> StreamReader:
    return StreamReader(opt.parse_read_options({"path": url, **options}), records_struct())


def _fill(url: str, n: int, ts_ms: int = 1000) -> tieredbuf.Buffer:
    buf = tieredbuf.open(url)
    for s in range(n):
        append_records(buf, [[b"%d" % s]], ts_ms=ts_ms)
    return buf


def _delivered(r: StreamReader, start: dict[str, object], end: dict[str, object]) -> list[int]:
    return [ref.sequence for p in r.partitions(start, end) for ref in p.refs]


def test_startingOffsets_past_the_tail_fails_instead_of_delivering_from_the_tail(
    tmp_path: Path,
) -> None:
    url = f"file://{tmp_path}/buf"
    buf = _fill(url, 12)
    r = _reader(url, startingOffsets="20")
    with pytest.raises(
        ConfigError, match=r"startingOffsets 20 is past the end.*next sequence is 12"
    ):
        r.initialOffset()
    _fill(url, 12)  # sequences 12..23 arrive: none of 12..19 may ever be delivered
    assert buf.snapshot().root.next_seq == 24
    r = _reader(url, startingOffsets="20")
    start = r.initialOffset()
    assert start["sequence"] == 20
    end = r.latestOffset(start, r.getDefaultReadLimit())
    assert _delivered(r, start, end) == [20, 21, 22, 23]
    assert _reader(url, startingOffsets="24").initialOffset()["sequence"] == 24  # the tail


def test_startingTimestamp_after_every_record_delivers_nothing_ingested_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tieredbuf.spark import stream

    clock = [100.0]  # the idle backoff's clock, simulated: Spark polls every 10 ms
    monkeypatch.setattr(stream.time, "monotonic", lambda: clock[0])
    url = f"file://{tmp_path}/buf"
    _fill(url, 3)
    t = now_ms() + 60_000
    r = _reader(url, startingTimestamp=str(t))
    limit = r.getDefaultReadLimit()
    start = r.initialOffset()
    append_records(tieredbuf.open(url), [[b"early"]], ts_ms=t - 1)  # sequence 3: before T
    for _ in range(300):  # 3 s of polls: the footer read sees sequence 3 (within 2 s)
        clock[0] += 0.01
        end = r.latestOffset(start, limit)
        assert end == start or _delivered(r, start, end) == []
    append_records(tieredbuf.open(url), [[b"late"]], ts_ms=t)  # sequence 4: at T
    append_records(tieredbuf.open(url), [[b"older"]], ts_ms=t - 5)  # 5: a late record
    for _ in range(300):
        clock[0] += 0.01
        end = r.latestOffset(start, limit)
        if end != start:
            break
    # the first micro-batch starts at the first object holding a record at or after T;
    # after that every record is delivered, late ones included (as documented)
    assert _delivered(r, start, end) == [4, 5]
    assert end["from"] == 4
