"""Retention lives in the root (section 5): every writer applies the stored policy, whatever
its own TreeConfig says; set_retention changes it by CAS; a root without it keeps nothing."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

import tieredbuf
from tests.faults import FaultInjectingStore
from tieredbuf import keys
from tieredbuf.errors import CorruptError, OutcomeUnknownError
from tieredbuf.format import manifest as fm
from tieredbuf.format.batch import encode_batch
from tieredbuf.format.manifest import MetadataItem, NewEntry, RetentionPolicy
from tieredbuf.queue.manifest_queue import ManifestQueue
from tieredbuf.store import open_store


def _e(i: int, size: int = 10) -> NewEntry:
    now_ms = time.time_ns() // 1_000_000  # ingested now: well inside a 1 h age limit
    return NewEntry(f"data/{i}.batch", (MetadataItem(0, now_ms, b""),), size)


def _fill(q: ManifestQueue, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        body = encode_batch([b"r%d" % i])
        q.store.put(f"data/{i}.batch", body)
        q.append([_e(i, len(body))], "p", i + 1)  # its true size: readers check it (I10)


def test_I5_a_default_consumer_keeps_history_the_root_says_to_retain(tmp_path) -> None:  # type: ignore[no-untyped-def]
    url = f"file://{tmp_path}/b"
    admin = tieredbuf.open(url, tree=tieredbuf.TreeConfig(m=2))
    _fill(admin.queue, 9)
    admin.set_retention(max_age=timedelta(hours=1))
    assert admin.retention == RetentionPolicy(max_age_ms=3_600_000)

    buf = tieredbuf.open(url)  # default TreeConfig: no retention of its own
    consumer = buf.consumer()
    consumer.initialize()
    while (batch := consumer.next_batch()) is not None:
        consumer.ack(batch.sequence)
    consumer.flush()  # dequeues everything: the root still says "retain 1 h"

    snap = buf.snapshot()
    assert snap.head == 9 and snap.low == 0
    got = buf.reader(start_sequence=0).poll(max_entries=100)
    assert [e.sequence for e in got] == list(range(9))
    _fill(buf.queue, 3, start=9)  # a producer with no retention of its own keeps it too
    assert buf.snapshot().low == 0


def test_changing_the_policy_by_cas_applies_it_and_is_idempotent() -> None:
    store = FaultInjectingStore(open_store("memory://"))
    q = ManifestQueue(store, sleep=lambda s: None, tree_config=tieredbuf.TreeConfig(m=2))
    _fill(q, 10)
    e = q.initialize("c")
    q.set_retention(max_bytes=1_000)
    q.dequeue(9, e)
    assert q.read().low == 0  # 130 bytes linked: all kept
    # a lost response: the CAS landed, the retry finds the policy in place
    fault = store.arm("put", key=keys.MANIFEST_KEY, when="after", error=OutcomeUnknownError)
    assert q.set_retention(max_bytes=35) == RetentionPolicy(None, 35)
    assert fault.fired == 1
    snap = q.read()
    assert snap.retention == RetentionPolicy(None, 35)
    assert snap.total_bytes <= 35 and snap.low > 0  # applied in the same CAS
    before = store.inner.get(keys.MANIFEST_KEY).etag
    q.set_retention(max_bytes=35)  # idempotent: no write
    assert store.inner.get(keys.MANIFEST_KEY).etag == before
    q.set_retention()  # explicit "no retention": acked history goes now
    snap = q.read()
    assert snap.retention == RetentionPolicy(None, None) and snap.low == snap.head == 10


def test_a_root_without_the_section_means_no_retention() -> None:
    store = open_store("memory://")
    q = ManifestQueue(store, sleep=lambda s: None, tree_config=tieredbuf.TreeConfig(m=2))
    _fill(q, 6)
    snap = q.read()
    assert snap.retention is None and snap.view.retention is None
    e = q.initialize("c")
    q.dequeue(3, e)
    assert q.read().low == 4  # acked history unlinked at once, as before section 5


def test_a_writer_config_seeds_only_a_root_without_policy_and_never_overrides() -> None:
    store = open_store("memory://")
    keep = tieredbuf.TreeConfig(m=2, retention_max_bytes=10_000)
    seeder = ManifestQueue(store, sleep=lambda s: None, tree_config=keep)
    _fill(seeder, 4)  # its first write stores its policy
    assert seeder.read().retention == RetentionPolicy(None, 10_000)
    other = ManifestQueue(
        store, sleep=lambda s: None, tree_config=tieredbuf.TreeConfig(m=2, retention_max_bytes=0)
    )
    e = other.initialize("c")
    other.dequeue(3, e)
    snap = other.read()
    assert snap.retention == RetentionPolicy(None, 10_000) and snap.low == 0  # root wins
    assert other.stats.get("retention_config_ignored") == 1
    seeder.set_retention()  # explicit none: a config no longer seeds anything
    _fill(seeder, 1, start=4)
    assert seeder.read().retention == RetentionPolicy(None, None)


def test_I7_retention_section_bytes_are_exact_and_checked() -> None:
    p = RetentionPolicy(3_600_000, 1 << 30)
    body = fm.encode_retention(p)
    assert body == bytes([3]) + (3_600_000).to_bytes(8, "little") + (1 << 30).to_bytes(8, "little")
    only_bytes = fm.encode_retention(RetentionPolicy(None, 7))
    assert only_bytes == bytes([2]) + bytes(8) + bytes([7]) + bytes(7)
    view = fm.empty_manifest()
    raw = fm.encode_manifest(b"", view.footer, {}, None, retention=p)
    assert fm.open_manifest(raw).retention == p
    sec = fm._SECTION.pack(fm.TAG_RETENTION, len(body)) + body
    assert sec in raw
    for bad in (
        bytes([4]) + bytes(16),
        bytes([1]) + bytes(8) + bytes([1]) + bytes(7),
        body[:-1],
        body + b"\0",
    ):
        blob = fm._SECTION.pack(fm.TAG_RETENTION, len(bad)) + bad
        mutated = raw.replace(sec, blob)
        n = len(blob).to_bytes(4, "little")
        mutated = mutated[:-30] + n + mutated[-26:]  # fix sections_len
        with pytest.raises(CorruptError):
            fm.open_manifest(mutated, obj="m")
