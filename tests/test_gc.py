"""GC (RFC 0001 rules) and I5: nothing referenced, young, or not yet enqueued is deleted."""

from __future__ import annotations

from datetime import timedelta

import pytest
from ulid import ULID

import tieredbuf
from tieredbuf import gc, keys
from tieredbuf.format.batch import encode_batch
from tieredbuf.format.manifest import NewEntry

# a pass over an unchanged buffer: the root read by the subscribers' publication and by
# the snapshot, and the three listings; no group is read again
UNCHANGED_PASS = {"get/root": 2, "list/data": 1, "list/group": 1, "list/subscriber": 1}

MIN = 60_000


def _obj(buf: tieredbuf.Buffer, ms: int) -> str:
    key = keys.data_key(ULID.from_timestamp(ms / 1000))
    buf.store.put(key, encode_batch([b"x"]), mode="create")
    return key


def test_select_garbage_applies_every_rfc_rule() -> None:
    now = 100 * MIN
    old, older = (
        keys.data_key(ULID.from_timestamp(10 * MIN / 1000)),
        keys.data_key(ULID.from_timestamp(5 * MIN / 1000)),
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


@pytest.mark.parametrize("backend", ["file", pytest.param("gcs", marks=pytest.mark.gcs)])
def test_I5_gc_deletes_only_dequeued_old_objects(  # type: ignore[no-untyped-def]
    tmp_path, backend: str, request: pytest.FixtureRequest
) -> None:
    if backend == "gcs":  # the root's CAS, the listing and the deletes on fake-gcs-server
        gcs = request.getfixturevalue("gcs_endpoint")
        buf = tieredbuf.open(f"gs://{gcs.new_bucket()}/b", **gcs.options())
    else:
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


@pytest.mark.parametrize(
    "backend",
    [
        "file",
        pytest.param("azure", marks=pytest.mark.azure),
        pytest.param("gcs", marks=pytest.mark.gcs),
    ],
)
def test_gc_on_an_empty_queue_deletes_old_unreferenced_objects_only(  # type: ignore[no-untyped-def]
    tmp_path, backend: str, request: pytest.FixtureRequest
) -> None:
    if backend == "azure":  # GC's list and batch delete on Azure Blob (Azurite)
        az = request.getfixturevalue("azurite_endpoint")
        buf = tieredbuf.open(f"az://{az.new_container()}/b", **az.options())
    elif backend == "gcs":  # GC's list and per-key deletes on GCS (fake-gcs-server)
        gcs = request.getfixturevalue("gcs_endpoint")
        buf = tieredbuf.open(f"gs://{gcs.new_bucket()}/b", **gcs.options())
    else:
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
    from tests.faults import FaultInjectingStore
    from tieredbuf.errors import StoreError

    store = FaultInjectingStore(tieredbuf.open("memory://").store)
    buf = tieredbuf.Buffer(store)
    now = 1_800_000_000_000
    a = _obj(buf, now - 60 * MIN)
    store.arm("delete_many", when="before", error=StoreError("injected"), times=1)
    first = gc.run_once(buf, grace=timedelta(minutes=10), now_ms=now)
    assert first.failed == 1 and first.deleted == 0
    report = gc.run_once(buf, grace=timedelta(minutes=10), now_ms=now)
    assert report.deleted_keys == [a]


def test_I5_gc_reaps_orphan_and_unlinked_groups_and_keeps_every_reachable_object(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import time

    from tests.faults import FaultInjectingStore
    from tieredbuf.config import TreeConfig
    from tieredbuf.errors import PreconditionFailedError

    buf = tieredbuf.open(f"file://{tmp_path}/b", tree=TreeConfig(m=2))
    now = time.time_ns() // 1_000_000  # group ULIDs carry the wall clock
    objs = [_obj(buf, now - 60 * MIN + i) for i in range(9)]
    for i, k in enumerate(objs[:8]):
        buf.queue.append([NewEntry(k, ())], "p", i + 1)
    # a writer whose root CAS loses after its group PUT: the group is an orphan
    faulty = FaultInjectingStore(buf.store)
    from tieredbuf.queue.manifest_queue import ManifestQueue

    q2 = ManifestQueue(
        faulty, sleep=lambda s: None, tree_config=TreeConfig(m=2), max_transient_retries=0
    )
    faulty.arm("put", key=keys.MANIFEST_KEY, when="before", error=PreconditionFailedError)
    with pytest.raises(tieredbuf.errors.TieredBufError, match="gave up after 0 retries"):
        q2.append([NewEntry(objs[8], ())], "p", 9)
    linked_before = gc.reachable(buf)[1]
    all_groups = {m.key for m in buf.store.list(keys.GROUPS_PREFIX)}
    assert linked_before < all_groups  # the orphan exists
    e = buf.queue.initialize("c")
    buf.queue.dequeue(4, e)  # unlinks groups [0,1], [2,3] (head 5 sits inside [4,5])
    young = gc.run_once(buf, grace=timedelta(minutes=10), now_ms=now)
    assert young.groups_deleted == 0  # the groups are seconds old: inside the grace period
    report = gc.run_once(buf, grace=timedelta(minutes=10), now_ms=now + 10**9)
    linked = gc.reachable(buf)[1]
    left = {m.key for m in buf.store.list(keys.GROUPS_PREFIX)}
    assert left == linked and report.groups_deleted == len(all_groups) - len(linked)
    # every entry from the head on is still readable, objects of the partial group kept
    assert [x.location for x in buf.entries()] == objs[5:8]
    assert {m.key for m in buf.store.list("data/")} >= set(objs[4:8])


def _grown(tmp_path, n: int):  # type: ignore[no-untyped-def]
    import time

    from tieredbuf.config import TreeConfig

    buf = tieredbuf.open(f"file://{tmp_path}/b", tree=TreeConfig(m=2))
    now = time.time_ns() // 1_000_000
    objs = [_obj(buf, now - 60 * MIN + i) for i in range(n)]
    for i, k in enumerate(objs):
        buf.queue.append([NewEntry(k, ())], "p", i + 1)
    return buf, objs, now


def test_gc_with_a_cache_reads_only_the_root_and_listings_when_nothing_changed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    buf, _, now = _grown(tmp_path, 8)
    linked = gc.reachable(buf)[1]
    assert len(linked) >= 4  # m=2: the root links groups
    cache = gc.GroupCache()
    first = gc.run_once(buf, grace=timedelta(minutes=10), now_ms=now, cache=cache)
    assert first.groups_read == len(linked) and first.groups_cached == 0
    assert first.requests["get/group"] == len(linked)
    assert len(cache) == len(linked)
    second = gc.run_once(buf, grace=timedelta(minutes=10), now_ms=now, cache=cache)
    assert second.groups_read == 0 and second.groups_cached == len(linked)
    assert second.requests == UNCHANGED_PASS
    # without a cache, every pass reads every group again
    uncached = gc.run_once(buf, grace=timedelta(minutes=10), now_ms=now)
    assert uncached.requests["get/group"] == len(linked)


def test_gc_with_a_cache_reads_only_the_groups_linked_since_its_last_pass(tmp_path) -> None:  # type: ignore[no-untyped-def]
    buf, objs, now = _grown(tmp_path, 8)
    cache = gc.GroupCache()
    gc.run_once(buf, grace=timedelta(minutes=10), now_ms=now, cache=cache)
    before = gc.reachable(buf)[1]
    more = [_obj(buf, now - 30 * MIN + i) for i in range(8)]
    for i, k in enumerate(more):
        buf.queue.append([NewEntry(k, ())], "p", 9 + i)
    after = gc.reachable(buf)[1]
    new = after - before
    assert new and before & after  # some groups are new, some were read before
    report = gc.run_once(buf, grace=timedelta(minutes=10), now_ms=now, cache=cache)
    assert report.groups_read == len(new) == report.requests["get/group"]
    assert report.referenced == len(objs) + len(more)


def test_I5_gc_with_a_cache_decides_as_one_without_and_forgets_unlinked_groups(tmp_path) -> None:  # type: ignore[no-untyped-def]
    buf, objs, now = _grown(tmp_path, 12)
    cache = gc.GroupCache()
    gc.run_once(buf, grace=timedelta(minutes=10), now_ms=now, cache=cache)
    e = buf.queue.initialize("c")
    buf.queue.dequeue(6, e)  # unlinks the groups below the head
    later = now + 10**9
    with_cache = gc.run_once(
        buf, grace=timedelta(minutes=10), now_ms=later, dry_run=True, cache=cache
    )
    without = gc.run_once(buf, grace=timedelta(minutes=10), now_ms=later, dry_run=True)
    assert with_cache.deleted_keys == without.deleted_keys
    assert any(k.startswith("data/") for k in with_cache.deleted_keys)
    assert any(k.startswith(keys.GROUPS_PREFIX) for k in with_cache.deleted_keys)
    assert set(cache.nodes) == gc.reachable(buf)[1]  # bounded by the linked tree (I8)
    report = gc.run_once(buf, grace=timedelta(minutes=10), now_ms=later, cache=cache)
    assert report.deleted_keys == without.deleted_keys
    assert [x.location for x in buf.entries()] == objs[7:]


def test_gc_run_forever_keeps_its_cache_across_passes_until_stopped(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import threading

    buf, _, _ = _grown(tmp_path, 8)
    stop = threading.Event()
    reports: list[gc.GcReport] = []

    def seen(report: gc.GcReport, seconds: float) -> None:
        reports.append(report)
        if len(reports) == 3:
            stop.set()

    gc.run_forever(buf, interval=timedelta(0), stop=stop, on_report=seen)
    assert len(reports) == 3
    assert reports[0].groups_read > 0
    assert [r.groups_read for r in reports[1:]] == [0, 0]
    assert all(r.requests == UNCHANGED_PASS for r in reports[1:])
