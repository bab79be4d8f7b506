"""Root section 6 (buffer id, creation time, GC grace period) and who reads the grace.

The section is added by the first write that finds it missing and kept as found by every
other write; GC and every writer take the grace period from it, so they cannot disagree
(I5): GC honours an explicit ``grace`` only when it is longer than the buffer's, and a
publisher re-uploads what is older than half the *buffer's* grace."""

from __future__ import annotations

from datetime import timedelta

import pytest
from ulid import ULID

import tieredbuf
from tieredbuf import gc, keys
from tieredbuf.errors import BufferNotFoundError, ConfigError
from tieredbuf.format.manifest import MetadataItem, NewEntry
from tieredbuf.queue.manifest_queue import ManifestQueue
from tieredbuf.store import open_store


def _entry(i: int) -> NewEntry:
    return NewEntry(keys.data_key(ULID()), (MetadataItem(0, i, b""),), 10)


def test_buffer_id_is_made_once_and_kept_by_every_writer(any_url: tuple[str, dict]) -> None:
    url, opts = any_url
    buf = tieredbuf.open(url, tree=tieredbuf.TreeConfig(m=2), **opts)
    assert buf.snapshot().buffer is None and not buf.exists()
    buf.queue.append([_entry(0)], "p", 1)
    first = buf.snapshot()
    assert first.buffer is not None and first.buffer_id is not None
    assert first.gc_grace_ms == 600_000 and buf.gc_grace_period == timedelta(minutes=10)
    epoch = buf.queue.initialize("c")
    for i in range(1, 9):  # appends that rebalance into groups, dequeues, retention
        buf.queue.append([_entry(i)], "p", i + 1)
    buf.queue.dequeue(3, epoch)
    buf.set_retention(max_bytes=10**9)
    buf.set_gc_grace_period(timedelta(hours=1))
    after = buf.snapshot()
    assert after.root.n_refs > 0
    assert after.buffer_id == first.buffer_id
    assert after.buffer is not None and after.buffer.created_ms == first.buffer.created_ms
    assert after.gc_grace_ms == 3_600_000


def test_a_buffer_created_again_has_a_new_id(tmp_path) -> None:  # type: ignore[no-untyped-def]
    url = f"file://{tmp_path}/b"
    buf = tieredbuf.open(url)
    buf.queue.append([_entry(0)], "p", 1)
    old = buf.snapshot().buffer_id
    buf.store.delete_many([keys.MANIFEST_KEY])
    buf.queue.append([_entry(1)], "p", 1)
    assert buf.snapshot().buffer_id not in (None, old)


def test_set_gc_grace_period_refuses_less_than_twice_the_link_deadline() -> None:
    buf = tieredbuf.open("memory://")
    with pytest.raises(ConfigError, match="link deadline"):
        buf.set_gc_grace_period(timedelta(minutes=3))
    with pytest.raises(ConfigError, match=">= 0"):
        buf.set_gc_grace_period(timedelta(seconds=-1), force=True)
    assert buf.set_gc_grace_period(timedelta(0), force=True) == timedelta(0)
    assert buf.gc_grace_period == timedelta(0)
    before = buf.snapshot().etag
    buf.set_gc_grace_period(timedelta(0), force=True)  # idempotent: no second write
    assert buf.snapshot().etag == before


def test_a_reader_call_never_creates_a_buffer(tmp_path) -> None:  # type: ignore[no-untyped-def]
    q = ManifestQueue(open_store(f"file://{tmp_path}/nothing-here"))
    with pytest.raises(BufferNotFoundError, match="nothing-here"):
        q.initialize("c", create=False)
    with pytest.raises(BufferNotFoundError):
        q.append([_entry(0)], "p", 1, create=False)
    assert not (tmp_path / "nothing-here" / "queue").exists()


def _garbage(buf: tieredbuf.Buffer, age_ms: int, now_ms: int) -> str:
    key = keys.data_key(ULID.from_timestamp((now_ms - age_ms) / 1000))
    buf.store.put(key, b"x", mode="create")
    return key


def test_I5_gc_uses_the_buffer_grace_and_only_a_longer_explicit_one() -> None:
    buf = tieredbuf.open("memory://")
    buf.queue.append([_entry(0)], "p", 1)
    buf.queue.dequeue(0, buf.queue.initialize("c"))  # an empty queue: no oldest-entry rule
    buf.set_gc_grace_period(timedelta(hours=1))
    now = 1_900_000_000_000
    young = _garbage(buf, 30 * 60_000, now)  # 30 min: inside the buffer's hour
    old = _garbage(buf, 90 * 60_000, now)
    report = gc.run_once(buf, grace=timedelta(minutes=10), now_ms=now, dry_run=True)
    assert report.grace_override_ignored and report.grace_ms == 3_600_000
    assert young not in report.deleted_keys and old in report.deleted_keys
    report = gc.run_once(buf, grace=timedelta(hours=2), now_ms=now, dry_run=True)
    assert not report.grace_override_ignored and report.grace_ms == 7_200_000
    assert old not in report.deleted_keys
    report = gc.run_once(buf, now_ms=now)
    assert report.deleted_keys == [old]
    assert [m.key for m in buf.store.list("data/")] == [young]


def test_I5_the_committer_holds_back_by_the_buffers_grace_not_a_writers_config() -> None:
    """Half the buffer's grace period (root section 6) decides which announced objects a
    commit holds back for a fresh upload -- not a writer's config."""
    from ulid import ULID

    from tieredbuf.format.announce import Announced
    from tieredbuf.produce.fanin import CommitHub
    from tieredbuf.queue.commit import Pending as CommitPending
    from tieredbuf.queue.commit import commit

    store = open_store("memory://")
    now = [1_900_000_000_000]
    q = ManifestQueue(store, clock_ms=lambda: now[0])
    q.append([_entry(0)], "other", 1)
    q.set_gc_grace_period(timedelta(hours=2))
    hub = CommitHub(store, q)
    hub.attach(5.0, timedelta(minutes=10))  # the writer's config says 10 minutes

    def pending(pseq: int, age_min: int) -> CommitPending:
        loc = keys.data_key(ULID.from_timestamp((now[0] - age_min * 60_000) / 1000))
        return CommitPending("p", (Announced(pseq, loc, 8, (MetadataItem(0, 0, b""),)),))

    res = commit(
        q, [pending(1, 30)], holder="h", lease_ms=1000, interval_ms=200, max_age_ms=hub.max_age_ms
    )  # past half the config's, inside the buffer's
    assert {p: {k: s for k, (s, _) in v.items()} for p, v in res.placed.items()} == {"p": {1: 1}}
    assert not res.stale
    q.set_gc_grace_period(timedelta(minutes=20))
    res = commit(
        q, [pending(2, 11)], holder="h", lease_ms=1000, interval_ms=200, max_age_ms=hub.max_age_ms
    )  # past half the buffer's new 20 minutes
    assert res.stale == frozenset({"p"}) and res.placed == {}
