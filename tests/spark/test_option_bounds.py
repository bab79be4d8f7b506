"""Options that cannot mean what they say are errors, not empty or unbounded reads.

``consumer=""`` would run with no subscriber at all; an end before the start returns
nothing; an offsets JSON naming another buffer's id would read this buffer's
sequences as if they were that buffer's.  Each is refused with ConfigError.
Driver side, without a SparkSession.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import tieredbuf
from tests.spark.util import append_records
from tieredbuf.errors import ConfigError
from tieredbuf.spark import options as opt
from tieredbuf.spark.reader import BatchReader
from tieredbuf.spark.source import records_struct
from tieredbuf.spark.stream import StreamReader


def _fill(url: str, n: int) -> tieredbuf.Buffer:
    buf = tieredbuf.open(url)
    for s in range(n):
        append_records(buf, [[b"%d" % s]], ts_ms=1000 + s)
    return buf


def _batch(url: str, **options: str) -> BatchReader:
    return BatchReader(opt.parse_read_options({"path": url, **options}), records_struct())


def _stream(url: str, **options: str) -> StreamReader:
    return StreamReader(opt.parse_read_options({"path": url, **options}), records_struct())


@pytest.mark.parametrize(
    ("parse", "name"),
    [
        (opt.parse_read_options, "consumer"),
        (opt.parse_read_options, "startingOffsets"),
        (opt.parse_read_options, "slot"),
        (opt.parse_write_options, "producerId"),
        (opt.parse_write_options, "batchVersion"),
        (opt.parse_write_options, "slot"),
    ],
)
def test_an_empty_option_value_is_refused_not_taken_as_unset(parse: object, name: str) -> None:
    assert callable(parse)
    for empty in ("", "  "):
        with pytest.raises(ConfigError, match=rf"option {name} is empty"):
            parse({"path": "file:///x", name: empty})


def test_an_empty_store_option_is_still_unset() -> None:
    """``.option("sessionToken", os.environ.get("AWS_SESSION_TOKEN", ""))`` is common."""
    ro = opt.parse_read_options({"path": "file:///x", "sessionToken": ""})
    assert dict(ro.store).get("session_token") == ""


def test_endingTimestamp_before_startingTimestamp_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"endingTimestamp .* is before startingTimestamp"):
        opt.parse_read_options(
            {"path": "file:///x", "startingTimestamp": "2000", "endingTimestamp": "1999"}
        )
    same = {"path": "file:///x", "startingTimestamp": "2000", "endingTimestamp": "2000"}
    assert opt.parse_read_options(same).ending_ts == 2000  # [t, t): empty, but meant


def test_endingOffsets_below_startingOffsets_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="endingOffsets 3 is below startingOffsets 5"):
        opt.parse_read_options({"path": "file:///x", "startingOffsets": "5", "endingOffsets": "3"})
    url = f"file://{tmp_path}/buf"
    _fill(url, 6)
    with pytest.raises(ConfigError, match=r"endingOffsets 3 is below startingOffsets latest \(6\)"):
        _batch(url, startingOffsets="latest", endingOffsets="3")
    assert _batch(url, startingOffsets="2", endingOffsets="4").end == 4


def test_an_offsets_json_of_another_buffer_is_refused(tmp_path: Path) -> None:
    url, other = f"file://{tmp_path}/buf", f"file://{tmp_path}/other"
    mine = _fill(url, 4).snapshot().buffer_id
    theirs = _fill(other, 4).snapshot().buffer_id
    assert mine is not None and theirs is not None and mine != theirs
    wrong = json.dumps({"sequence": 1, "buffer": theirs})
    for option in ("startingOffsets", "endingOffsets"):
        with pytest.raises(ConfigError, match=rf"{option} names buffer {theirs}.*is {mine}"):
            _batch(url, **{option: wrong})
    with pytest.raises(ConfigError, match=rf"startingOffsets names buffer {theirs}.*is {mine}"):
        _stream(url, startingOffsets=wrong).initialOffset()
    right = json.dumps({"sequence": 1, "buffer": mine, "from": 0})  # an offset of ours
    assert _batch(url, startingOffsets=right).start == 1
    assert _stream(url, startingOffsets=right).initialOffset()["sequence"] == 1
    with pytest.raises(ConfigError, match="unknown key 'sequnce'"):
        opt.parse_read_options({"path": url, "startingOffsets": '{"sequence": 1, "sequnce": 2}'})


@pytest.mark.parametrize("value", ["0", "-5", "1.5", "soon"])
def test_idlePollMaxMs_must_be_a_positive_number_of_milliseconds(value: str) -> None:
    with pytest.raises(ConfigError, match="idlePollMaxMs"):
        opt.parse_read_options({"path": "file:///x", "idlePollMaxMs": value})
    ro = opt.parse_read_options({"path": "file:///x", "idlePollMaxMs": "250"})
    assert ro.idle_poll_max_ms == 250


def test_idlePollMaxMs_is_refused_by_a_batch_read(tmp_path: Path) -> None:
    from tieredbuf.spark.source import DataSourceError, TieredBufDataSource

    url = f"file://{tmp_path}/buf"
    _fill(url, 1)
    src = TieredBufDataSource({"path": url, "idlePollMaxMs": "250"})
    with pytest.raises(DataSourceError, match="idlePollMaxMs apply to readStream only"):
        src.reader(records_struct())
