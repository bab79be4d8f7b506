"""Splitting large .qseg objects by stream, without a SparkSession: the plan, and that
an executor GETs only its streams' byte ranges."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

import tieredbuf
from tests.spark.util import append_bundles
from tieredbuf.errors import ConfigError
from tieredbuf.spark import arrow as ta
from tieredbuf.spark import executor as ex
from tieredbuf.spark import options as opt
from tieredbuf.spark import plan as pl


def _buffer(tmp_path: Path) -> tuple[str, tieredbuf.Buffer]:
    url = f"file://{tmp_path}/buf"
    buf = tieredbuf.open(url)
    bundles = []
    for i in range(6):
        d = pa.array([f"k{i}"] * (10 + i)).dictionary_encode()
        bundles.append(
            {
                0: pa.record_batch({"a": pa.array(range(10 + i)), "s": d}),
                2: pa.record_batch({"z": [i]}),
            }
        )
    append_bundles(buf, bundles)
    append_bundles(buf, bundles[:1])  # one stream of slot 0: never split
    return url, buf


def _schema() -> pa.Schema:
    return pa.schema(
        [
            ("a", pa.int64()),
            ("s", pa.string()),
            (ta.SEQUENCE_COL, pa.int64()),
            (ta.BUNDLE_COL, pa.int32()),
        ]
    )


def test_plan_and_ranged_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url, buf = _buffer(tmp_path)
    entries = [(e, 0) for e in buf.snapshot().entries()]
    ro = opt.parse_read_options({"path": url, "slot": "0", "splitStreamsBytes": "300"})
    parts = pl.object_partitions(buf.store, entries, ro)
    split = [p for p in parts if p.streams is not None]
    assert {p.ref.sequence for p in split} == {0} and len(split) >= 2
    assert [p.streams is None for p in parts if p.ref.sequence == 1] == [True]
    sids = [sl.stream.stream_id for p in split for sl in p.streams or ()]
    assert len(sids) == len(set(sids)) == 6  # every stream of slot 0 exactly once
    whole = opt.parse_read_options({"path": url, "slot": "0", "splitStreamsBytes": "0"})
    assert [p.streams for p in pl.object_partitions(buf.store, entries, whole)] == [None, None]

    store = ex.shared_buffer(ro.url, ro.store).store
    calls: list[tuple[Any, ...]] = []
    real_range = store.get_range

    def get_range(key: str, start: int, end: int) -> bytes:
        calls.append(("range", start, end))
        return real_range(key, start, end)

    monkeypatch.setattr(store, "get", lambda *a: pytest.fail(f"whole-object GET {a}"))
    monkeypatch.setattr(store, "get_range", get_range)
    got = []
    for p in split:
        calls.clear()
        got += pa.Table.from_batches(list(ex.read_partition(ro, _schema(), p))).to_pylist()
        assert calls == [
            ("range", sl.stream.byte_offset, sl.stream.byte_offset + sl.stream.byte_length)
            for sl in p.streams or ()
        ]
    monkeypatch.undo()
    expected = pa.Table.from_batches(
        list(
            ex.read_partition(
                whole, _schema(), pl.object_partitions(buf.store, entries[:1], whole)[0]
            )
        )
    ).to_pylist()
    key = lambda r: (r["_bundle"], r["a"])  # noqa: E731
    assert sorted(got, key=key) == sorted(expected, key=key)
    assert {r["_bundle"] for r in got} == set(range(6))


def test_split_option_is_checked() -> None:
    with pytest.raises(ConfigError, match="splitStreamsBytes"):
        opt.parse_read_options({"path": "file:///x", "splitStreamsBytes": "-1"})
    assert opt.parse_read_options({"path": "file:///x"}).split_streams_bytes == 64 << 20
