"""Object -> Arrow conversion and schema unification, without a Spark session."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest

import tieredbuf
from tests.spark.util import append_bundles, append_records
from tieredbuf.spark import arrow as ta
from tieredbuf.spark.bundles import slot_schemas
from tieredbuf.spark.source import bundles_struct


def test_records_batch_has_spark_schema_and_metadata_per_record() -> None:
    buf = tieredbuf.open("memory://")
    append_records(buf, [[b"a", b"b"], [b"c"]], ts_ms=1234, payload=b"p")
    (e,) = buf.entries()
    ref = ta.ObjectRef(e.sequence, e.location, e.metadata)
    (b,) = ta.records_batches(buf.read_object(e), ref, ta.records_schema())
    assert b.schema.equals(ta.records_schema())
    assert b.column("value").to_pylist() == [b"a", b"b", b"c"]
    assert b.column("metadata").to_pylist() == [b"p0", b"p0", b"p1"]
    assert b.column("index").to_pylist() == [0, 1, 2]
    assert b.column("ingestion_time").cast(pa.int64()).to_pylist() == [1234000] * 3
    assert b.column("location").to_pylist() == [e.location] * 3


def test_time_filter_is_per_record() -> None:
    buf = tieredbuf.open("memory://")
    append_records(buf, [[b"a"]], ts_ms=1000)
    (e,) = buf.entries()
    ref = ta.ObjectRef(e.sequence, e.location, e.metadata)
    data = buf.read_object(e)
    assert (
        sum(x.num_rows for x in ta.records_batches(data, ref, ta.records_schema(), ts_from_ms=1001))
        == 0
    )
    assert (
        sum(x.num_rows for x in ta.records_batches(data, ref, ta.records_schema(), ts_to_ms=1001))
        == 1
    )


def test_sequence_beyond_long_is_refused() -> None:
    ref = ta.ObjectRef(1 << 63, "data/x.batch", ())
    from tieredbuf.format.batch import encode_batch

    with pytest.raises(tieredbuf.errors.ConfigError, match="long"):
        list(ta.records_batches(encode_batch([b"x"]), ref, ta.records_schema()))


def test_representative_schema_unions_and_widens() -> None:
    buf = tieredbuf.open("memory://")
    append_bundles(
        buf,
        [{0: pa.record_batch({"a": pa.array([1], pa.int32())}), 1: pa.record_batch({"z": [1.0]})}],
    )
    append_bundles(
        buf,
        [
            {
                0: pa.record_batch(
                    {
                        "a": pa.array([2], pa.int64()),
                        "u": pa.array([9], pa.uint64()),
                        "s": pa.array(["x"]).dictionary_encode(),
                        "t": pa.array([5], pa.timestamp("ns", tz="Europe/Paris")),
                    }
                )
            }
        ],
    )
    schemas = slot_schemas(buf.store, buf.entries(), 0)
    assert len(schemas) == 2
    unified = ta.unify(schemas)
    assert unified.names == ["a", "u", "s", "t"]
    assert unified.field("a").type == pa.int64()
    struct = bundles_struct(unified)
    assert [f.dataType.simpleString() for f in struct.fields] == [
        "bigint",
        "decimal(20,0)",
        "string",
        "timestamp",
        "bigint",
        "int",
    ]
    from pyspark.sql.pandas.types import to_arrow_schema

    target = to_arrow_schema(struct, timezone="UTC")
    e0, e1 = buf.entries()
    got = []
    for e in (e0, e1):
        ref = ta.ObjectRef(e.sequence, e.location, e.metadata)
        for b in ta.bundle_batches(buf.read_object(e), ref, 0, target):
            assert b.schema.equals(target)
            got += b.to_pylist()
    assert [(r["a"], r["u"], r["s"], r["_sequence"]) for r in got] == [
        (1, None, None, 0),
        (2, 9, "x", 1),
    ]


def _expected_metadata(items: list[tuple[int, int, bytes]], n: int) -> list[Any]:
    """Per record: the payload and time of the last item starting at or before it."""
    out: list[Any] = []
    for i in range(n):
        mine = [(t, p) for s, t, p in sorted(items, key=lambda x: x[0]) if s <= i]
        out.append((mine[-1][1], mine[-1][0] * 1000) if mine else (None, None))
    return out


@pytest.mark.parametrize(
    "items",
    [
        [(0, 5, b"one")],
        [(0, 5, b"a"), (2, 6, b"b"), (2, 7, b"c"), (4, 8, b"d")],
        [(3, 5, b"late")],  # records before the first item: nulls
        [(0, 5, b"a"), (99, 6, b"past-end")],  # an item starting past the records
        [],
    ],
)
def test_metadata_columns_follow_each_items_start_index(
    items: list[tuple[int, int, bytes]],
) -> None:
    from tieredbuf.format.batch import encode_batch
    from tieredbuf.format.manifest import MetadataItem

    n = 6
    ref = ta.ObjectRef(3, "data/x.batch", tuple(MetadataItem(s, t, p) for s, t, p in items))
    (b,) = ta.records_batches(
        encode_batch([b"r%d" % i for i in range(n)]), ref, ta.records_schema()
    )
    got = list(
        zip(
            b.column("metadata").to_pylist(),
            b.column("ingestion_time").cast(pa.int64()).to_pylist(),
            strict=True,
        )
    )
    assert got == _expected_metadata(items, n)


def test_large_objects_are_sliced_small_ones_are_not(monkeypatch: pytest.MonkeyPatch) -> None:
    from tieredbuf.format.batch import encode_batch

    records = [b"%05d" % i for i in range(1000)]
    ref = ta.ObjectRef(0, "data/x.batch", ())
    assert len(list(ta.records_batches(encode_batch(records), ref, ta.records_schema()))) == 1
    monkeypatch.setattr(ta, "MAX_BATCH_BYTES", 4096)
    parts = list(ta.records_batches(encode_batch(records), ref, ta.records_schema()))
    assert len(parts) > 1 and all(p.nbytes <= 2 * 4096 for p in parts)
    assert [v for p in parts for v in p.column("value").to_pylist()] == records


def test_pandas_is_a_version_pyspark_supports() -> None:
    """pyspark 4.3 supports pandas 2.x (it warns 'does not yet fully support' on 3.x, and
    warnings are errors here): the spark extra pins pandas<3."""
    import pandas
    from pyspark.sql.pandas.utils import require_minimum_pandas_version

    require_minimum_pandas_version()
    assert int(pandas.__version__.split(".")[0]) < 3


def test_repeated_columns_past_int32_offsets_are_cut_not_wrapped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``location`` (and ``metadata``) repeat one value per record in ``binary``/``string``
    arrays, whose offsets are int32: past 2 GiB they wrapped.  The rows are now cut into
    batches whose repeated columns fit (the limit lowered here to see it without 2 GiB)."""
    from tieredbuf.format.batch import encode_batch
    from tieredbuf.format.manifest import MetadataItem

    with pytest.raises(ValueError, match="int32"):
        ta.repeat_value(b"x" * 1024, (1 << 31) // 1024 + 1, pa.string())
    monkeypatch.setattr(ta, "MAX_BINARY_BYTES", 100)
    loc = "data/01ARZ3NDEKTSV4RRFFQ69G5FAV.batch"  # 36 bytes: two records per batch
    items = (MetadataItem(1, 5, b"p" * 20), MetadataItem(4, 6, b"q"))
    ref = ta.ObjectRef(9, loc, items)
    records = [b"r%d" % i for i in range(7)]
    batches = list(ta.records_batches(encode_batch(records), ref, ta.records_schema()))
    assert len(batches) == 4
    assert all(len(b.column("location").buffers()[2]) <= 100 for b in batches)
    got = pa.Table.from_batches(batches).to_pylist()
    assert [r["value"] for r in got] == records
    assert [r["index"] for r in got] == list(range(7))
    assert [r["metadata"] for r in got] == [None] + [b"p" * 20] * 3 + [b"q"] * 3
    assert {r["location"] for r in got} == {loc}
