"""GC (RFC 0001 rules) and I5: nothing referenced, young, or not yet enqueued is deleted."""

from __future__ import annotations

from datetime import timedelta

from ulid import ULID

import tieredbuf
from tieredbuf import gc, keys
from tieredbuf.format.batch import encode_batch
from tieredbuf.format.manifest import NewEntry

MIN = 60_000


def _obj(buf: tieredbuf.Buffer, ms: int) -> str:
    key = keys.data_key(ULID.from_timestamp(ms / 1000))
    buf.store.put(key, encode_batch([b"x"]), mode="create")
    return key


def test_select_garbage_applies_every_rfc_rule() -> None:
    now = 100 * MIN
    old, older = keys.data_key(ULID.from_timestamp(10 * MIN / 1000)), keys.data_key(
        ULID.from_timestamp(5 * MIN / 1000)
    )
    young = keys.data_key(ULID.from_timestamp((now - MIN) / 1000))
    after_oldest = keys.data_key(ULID.from_timestamp(30 * MIN / 1000))
    report = gc.GcReport()
    out = gc.select_garbage(
        [old, older, young, after_oldest, "data/README.txt", "data/x.batch"],
        referenced={old},
        oldest_referenced_ms=20 * MIN,
        now_ms=now,
        grace=timedelta(minutes=10),
        report=report,
    )
    assert out == [older]
    assert report.referenced == 1 and report.kept_newer_than_oldest == 2
    assert report.skipped_foreign == 2


def test_I5_gc_deletes_only_dequeued_old_objects(tmp_path) -> None:  # type: ignore[no-untyped-def]
    buf = tieredbuf.open(f"file://{tmp_path}/b")
    now = 1_800_000_000_000
    dequeued = _obj(buf, now - 60 * MIN)
    queued = _obj(buf, now - 50 * MIN)
    unenqueued = _obj(buf, now - 40 * MIN)  # uploaded, enqueue still retrying
    young_orphan = _obj(buf, now - 1 * MIN)
    buf.queue.append([NewEntry(dequeued, ()), NewEntry(queued, ())], "p", 2)
    e = buf.queue.initialize("c")
    buf.queue.dequeue(0, e)
    report = gc.run_once(buf, grace=timedelta(minutes=10), now_ms=now)
    assert report.deleted_keys == [dequeued]
    left = {m.key for m in buf.store.list("data/")}
    assert left == {queued, unenqueued, young_orphan}


def test_gc_on_an_empty_queue_deletes_old_unreferenced_objects_only(tmp_path) -> None:  # type: ignore[no-untyped-def]
    buf = tieredbuf.open(f"file://{tmp_path}/b")
    now = 1_800_000_000_000
    old = _obj(buf, now - 60 * MIN)
    young = _obj(buf, now - MIN)
    dry = gc.run_once(buf, grace=timedelta(minutes=10), now_ms=now, dry_run=True)
    assert dry.deleted_keys == [old] and dry.deleted == 0
    assert {m.key for m in buf.store.list("data/")} == {old, young}
    report = gc.run_once(buf, grace=timedelta(minutes=10), now_ms=now)
    assert report.deleted == 1
    assert {m.key for m in buf.store.list("data/")} == {young}


def test_gc_counts_failed_deletes_and_keeps_going() -> None:
    from tieredbuf.errors import StoreError
    from tieredbuf.store.faults import FaultInjectingStore

    store = FaultInjectingStore(tieredbuf.open("memory://").store)
    buf = tieredbuf.Buffer(store)
    now = 1_800_000_000_000
    a = _obj(buf, now - 60 * MIN)
    store.arm("delete_many", when="before", error=StoreError("injected"), times=1)
    first = gc.run_once(buf, grace=timedelta(minutes=10), now_ms=now)
    assert first.failed == 1 and first.deleted == 0
    report = gc.run_once(buf, grace=timedelta(minutes=10), now_ms=now)
    assert report.deleted_keys == [a]
