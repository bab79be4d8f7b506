"""``tieredbuf verify`` (tieredbuf/ops/verify.py): every live object is read and checked,
and exactly the missing, damaged and unreferenced ones are reported (invariants I7 and
I10: bad bytes are named; nothing is taken on trust from an object's mere presence).
Request counts are exact (docs/operations.md gives them per GiB)."""

from __future__ import annotations

import io
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from ulid import ULID

import tieredbuf
from tests.damage import DamagingStore, damage_object
from tieredbuf import keys
from tieredbuf.cli import EXIT_FAILED, EXIT_OK, main
from tieredbuf.config import Compression
from tieredbuf.format.batch import encode_batch
from tieredbuf.format.manifest import MetadataItem, NewEntry
from tieredbuf.ops.verify import verify
from tieredbuf.queue.nodes import node_key
from tieredbuf.store import open_store

GRACE = timedelta(minutes=10)  # the buffer's default


def _cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return main(list(argv), out=out), out.getvalue()


def fill(buf: tieredbuf.Buffer, n: int, *, compression: Compression = Compression.NONE) -> None:
    """``n`` entries of one small object each (3 records), appended 500 at a time, the
    objects PUT on 16 threads."""
    fill_sized(buf, n, 0, compression=compression)


def fill_sized(
    buf: tieredbuf.Buffer, n: int, size: int, *, compression: Compression = Compression.NONE
) -> None:
    """``n`` entries of one object each: 3 small records, or one record making an object
    of ``size`` bytes (uncompressed) when ``size`` is given (bench/verify.py)."""
    now = time.time_ns() // 1_000_000
    big = os.urandom(max(0, size - 11))

    def put(i: int) -> NewEntry:
        recs = [big] if size else [b"entry %d record %d" % (i, j) for j in range(3)]
        body = encode_batch(recs, compression)
        key = keys.data_key(ULID())
        buf.store.put(key, body, mode="create")
        return NewEntry(key, (MetadataItem(0, now, b"m%d" % i),), len(body))

    with ThreadPoolExecutor(16) as pool:
        new = list(pool.map(put, range(n)))
    for k in range(0, n, 500):
        chunk = new[k : k + 500]
        buf.queue.append(chunk, "fill", k + len(chunk))  # one append number per entry


def _old_orphan(buf: tieredbuf.Buffer, age: timedelta) -> str:
    """A data object nothing links, uploaded ``age`` ago (by its ULID time)."""
    key = keys.data_key(ULID.from_timestamp(time.time() - age.total_seconds()))
    buf.store.put(key, encode_batch([b"never enqueued"]), mode="create")
    return key


def test_a_sound_buffer_verifies_clean_with_exact_requests(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/b"
    buf = tieredbuf.open(url, tree=tieredbuf.TreeConfig(m=8))
    fill(buf, 100, compression=Compression.ZSTD)
    with buf.consumer(subscriber="etl") as c:  # a progress object to read too
        c.initialize()
    _old_orphan(buf, GRACE / 2)  # younger than the grace period: not a finding
    report = verify(tieredbuf.open(url))
    assert report.findings == []
    assert (report.entries, report.first, report.next, report.subscribers) == (100, 0, 100, 1)
    assert report.groups > 0 and report.unsized == 0
    assert report.requests == {
        "get/root": 1,
        "get/group": report.groups,  # each linked node once
        "get/data": 100,  # each data object once, whole
        "get/subscriber": 1,
        "list/data": 1,
        "list/group": 1,
    }
    code, text = _cli("verify", url)
    assert code == EXIT_OK and "verified 100 data objects" in text and "no findings" in text


def test_I10_verify_reports_exactly_the_missing_damaged_and_unreferenced_objects(
    tmp_path: Path,
) -> None:
    url = f"file://{tmp_path}/b"
    buf = tieredbuf.open(url, tree=tieredbuf.TreeConfig(m=8))
    fill(buf, 60)
    fill_zstd = tieredbuf.open(url)
    with fill_zstd.producer(batch_compression="zstd") as p:
        p.produce([b"zstd %d" % i for i in range(50)]).wait(timeout=30)
    entries = buf.entries()
    locs = {e.sequence: e.location for e in entries}
    damage_object(buf.store, url, locs[5], "truncated")
    damage_object(buf.store, url, locs[17], "replaced")
    damage_object(buf.store, url, locs[60], "flipped")  # the zstd one: its checksum
    damage_object(buf.store, url, locs[33], "extended")
    assert buf.store.delete_many([locs[8], locs[41]]) == []
    orphan = _old_orphan(buf, 2 * GRACE)
    _old_orphan(buf, GRACE / 2)
    code, text = _cli("verify", url, "--json")
    assert code == EXIT_FAILED
    r = json.loads(text)
    got = {(f["problem"], f["key"]) for f in r["findings"]}
    assert got == {
        ("damaged", locs[5]),
        ("damaged", locs[17]),
        ("damaged", locs[60]),
        ("damaged", locs[33]),
        ("missing", locs[8]),
        ("missing", locs[41]),
        ("unreferenced", orphan),
    }
    seqs = {f["key"]: f["sequence"] for f in r["findings"]}
    assert seqs[locs[5]] == 5 and seqs[orphan] is None
    assert (r["missing"], r["damaged"], r["unreferenced"]) == (2, 4, 1)
    assert r["entries"] == 61
    code, text = _cli("verify", url)  # the text form names each one on a line
    assert code == EXIT_FAILED
    assert f"missing       data        {locs[8]} (sequence 8)" in text
    assert "2 missing, 4 damaged, 1 unreferenced" in text


def test_verify_from_checks_data_objects_from_that_sequence_and_the_tree_whole(
    tmp_path: Path,
) -> None:
    url = f"file://{tmp_path}/b"
    buf = tieredbuf.open(url, tree=tieredbuf.TreeConfig(m=4))
    fill(buf, 40)
    locs = {e.sequence: e.location for e in buf.entries()}
    assert buf.store.delete_many([locs[3], locs[30]]) == []
    report = verify(buf, start=20)
    assert (report.first, report.entries) == (20, 20)
    assert [(f.problem, f.sequence) for f in report.findings] == [("missing", 30)]
    assert report.requests["get/data"] == 20


def test_verify_reports_a_missing_or_damaged_tree_node_and_progress_object(
    tmp_path: Path,
) -> None:
    url = f"file://{tmp_path}/b"
    buf = tieredbuf.open(url, tree=tieredbuf.TreeConfig(m=4))
    fill(buf, 40)
    with buf.consumer(subscriber="etl") as c:
        c.initialize()
    root = buf.snapshot().root
    gone, bad = node_key(root.refs[0]), node_key(root.refs[1])
    assert buf.store.delete_many([gone]) == []
    damage_object(buf.store, url, bad, "truncated")
    (progress,) = [m.key for m in buf.store.list(keys.SUBSCRIBERS_PREFIX)]
    assert buf.store.delete_many([progress]) == []
    report = verify(buf)
    got = {(f.problem, f.kind, f.key) for f in report.findings}
    assert got == {
        ("missing", "group", gone),
        ("damaged", "group", bad),
        ("missing", "subscriber", progress),
    }
    under = next(f for f in report.findings if f.key == gone)
    assert f"sequences {root.refs[0].first}..{root.refs[0].last}" in under.detail


@pytest.mark.parametrize("how", ["flipped", "replaced"])
def test_verify_reads_damage_under_the_bucket_too(how: Any) -> None:
    """The bytes change under the store, its metadata unchanged (tests/damage.py)."""
    store = DamagingStore(open_store("memory://"))
    buf = tieredbuf.Buffer(store)
    with buf.producer(batch_compression="zstd") as p:
        for i in range(3):
            p.produce([b"x%d" % i] * 10).wait(timeout=30)
    loc = buf.entries()[1].location
    store.damage(loc, how)
    report = verify(buf)
    assert [(f.problem, f.key) for f in report.findings] == [("damaged", loc)]


@pytest.mark.slow
def test_I10_verify_finds_exactly_3_damaged_and_2_missing_among_10000_entries(
    tmp_path: Path,
) -> None:
    """The issue's must-show: a 10,000-entry buffer with 3 damaged and 2 missing objects;
    prints the time and the requests."""
    url = f"file://{tmp_path}/b"
    buf = tieredbuf.open(url)
    fill(buf, 10_000)
    locs = [e.location for e in buf.entries()]
    damaged = {locs[12]: "truncated", locs[4_321]: "replaced", locs[9_998]: "extended"}
    for key, how in damaged.items():
        damage_object(buf.store, url, key, how)  # type: ignore[arg-type]
    missing = [locs[77], locs[6_000]]
    assert buf.store.delete_many(missing) == []
    t0 = time.monotonic()
    code, text = _cli("verify", url, "--json")
    took = time.monotonic() - t0
    assert code == EXIT_FAILED
    r = json.loads(text)
    assert {(f["problem"], f["key"]) for f in r["findings"]} == {
        *(("damaged", k) for k in damaged),
        *(("missing", k) for k in missing),
    }
    assert r["entries"] == 10_000 and r["requests"]["get/data"] == 10_000
    print(
        f"\nverify, 10,000 entries: {took:.2f} s, {sum(r['requests'].values())} requests "
        f"{r['requests']}"
    )
    assert os.path.isdir(tmp_path / "b")
