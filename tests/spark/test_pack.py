"""Packing small data objects into Spark partitions, without a SparkSession: the pure
rule, the plan over a real buffer (sizes from the manifest's stats, HEAD only where a
size is missing), and that an executor reads a packed partition's objects in order."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from ulid import ULID

import tieredbuf
from tieredbuf import keys
from tieredbuf.errors import ConfigError
from tieredbuf.format.batch import encode_batch
from tieredbuf.format.manifest import MetadataItem, NewEntry
from tieredbuf.spark import arrow as ta
from tieredbuf.spark import executor as ex
from tieredbuf.spark import options as opt
from tieredbuf.spark import plan as pl

MiB = 1 << 20


def test_pack_spreads_small_reads_over_min_partitions() -> None:
    # 8 objects of 10 bytes cost 8 * (10 + 4) = 112: two partitions of 56.
    assert opt.pack([10] * 8, 100, 2, open_cost=4) == [range(0, 4), range(4, 8)]
    assert opt.pack([10] * 8, 200, 1, open_cost=4) == [range(0, 8)]
    assert opt.pack([10] * 8, 100, 1, open_cost=4) == [range(0, 7), range(7, 8)]


def test_pack_caps_partitions_at_max_bytes_and_keeps_big_objects_alone() -> None:
    assert opt.pack([1000, 1, 1, 1000], 100, 1, open_cost=4) == [
        range(0, 1),
        range(1, 3),
        range(3, 4),
    ]


def test_pack_zero_max_bytes_is_one_partition_per_object() -> None:
    assert opt.pack([5, 5, 5], 0, 1) == [range(0, 1), range(1, 2), range(2, 3)]
    assert opt.pack([], 100, 2) == []


def test_pack_covers_every_object_once_in_order() -> None:
    rng = random.Random(7)
    for _ in range(200):
        sizes = [rng.randrange(1, 50 * MiB) for _ in range(rng.randrange(1, 60))]
        parts = opt.pack(sizes, rng.choice([16 * MiB, 128 * MiB]), rng.randrange(1, 9))
        assert [i for r in parts for i in r] == list(range(len(sizes)))
        assert all(len(r) > 0 for r in parts)


def test_partition_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="maxPartitionBytes"):
        opt.parse_read_options({"path": "file:///x", "maxPartitionBytes": "-1"})
    with pytest.raises(ConfigError, match="minPartitions"):
        opt.parse_read_options({"path": "file:///x", "minpartitions": "0"})
    ro = opt.parse_read_options({"path": "file:///x"})
    assert ro.max_partition_bytes == 128 * MiB and ro.min_partitions >= 1


def _fill(buf: tieredbuf.Buffer, n: int, known_size: bool) -> list[list[bytes]]:
    """``n`` objects of 20 records, appended one per call (sizes recorded or not)."""
    out = []
    for o in range(n):
        recs = [b"%d-%d" % (o, i) for i in range(20)]
        body = encode_batch(recs)
        key = keys.data_key(ULID(), keys.BATCH_SUFFIX)
        buf.store.put(key, body, mode="create")
        entry = NewEntry(key, (MetadataItem(0, 1_000, b"m"),), len(body) if known_size else 0)
        buf.queue.append([entry], "pack-test", o + 1)
        out.append(recs)
    return out


def _plan(url: str, **options: str) -> list[ex.ObjectPartition]:
    ro = opt.parse_read_options({"path": url, **options})
    buf = ex.shared_buffer(url, ())
    snap = buf.snapshot()
    return pl.plan_range(buf, snap, 0, 1 << 62, ro)


def test_plan_packs_objects_with_sizes_from_the_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"file://{tmp_path}/buf"
    buf = tieredbuf.open(url)
    produced = _fill(buf, 10, known_size=True)
    assert all(n > 0 for _, n in buf.snapshot().sized_entries())
    store = ex.shared_buffer(url, ()).store
    monkeypatch.setattr(store, "head", lambda *a: pytest.fail(f"HEAD {a}"))
    parts = _plan(url, minPartitions="3")
    assert len(parts) == 3
    assert [r.sequence for p in parts for r in p.refs] == list(range(10))
    assert [len(p.refs) for p in _plan(url, maxPartitionBytes="0")] == [1] * 10
    monkeypatch.undo()

    ro = opt.parse_read_options({"path": url})
    got = [
        tuple(r.values())
        for p in parts
        for b in ex.read_partition(ro, ta.records_schema(), p)
        for r in pa.Table.from_batches([b]).select(["sequence", "index", "value"]).to_pylist()
    ]
    want = [(s, i, v) for s, recs in enumerate(produced) for i, v in enumerate(recs)]
    assert got == want


def test_plan_heads_objects_whose_size_is_not_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"file://{tmp_path}/buf"
    _fill(tieredbuf.open(url), 6, known_size=False)
    store = ex.shared_buffer(url, ()).store
    heads: list[Any] = []
    real = store.head

    def head(key: str) -> Any:
        heads.append(key)
        return real(key)

    monkeypatch.setattr(store, "head", head)
    parts = _plan(url, minPartitions="2")
    assert len(heads) == 6 and len(parts) == 2
    assert [r.sequence for p in parts for r in p.refs] == list(range(6))
