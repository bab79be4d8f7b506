"""The committer's reader of ``queue/pending/`` (tieredbuf/produce/announcements.py):
which announcements a commit retires, and when they are deleted.

A real local-directory store (real files); the watermarks are built by hand, as a
commit would leave them."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from ulid import ULID

from tests.faults import CountingStore, FaultInjectingStore
from tieredbuf import keys
from tieredbuf.errors import AccessDeniedError
from tieredbuf.format import announce as fa
from tieredbuf.format.manifest import MetadataItem, Watermark
from tieredbuf.format.spelled import key_form
from tieredbuf.produce.announcements import AnnouncementReader
from tieredbuf.runtime.stats import Stats
from tieredbuf.store import open_store
from tieredbuf.store.base import Store

HOUR_MS = 3_600_000


def _announce(
    store: object, hub: str, n: int, producer: str, seq: int, made_ms: int, legacy: bool = False
) -> str:
    """An announcement of one append whose data object was named at ``made_ms`` (its
    body read by a GET; ``legacy``: under the key an older tieredbuf gave it)."""
    loc = keys.data_key(ULID.from_timestamp(made_ms / 1000))
    body = fa.encode([fa.make(producer, 0, [fa.Announced(seq, loc, 10, ())])], made_ms)
    key = keys.legacy_pending_key(hub, n) if legacy else keys.pending_key(hub, n)
    store.put(key, body, mode="create")  # type: ignore[attr-defined]
    return key


def test_a_commit_retires_what_the_watermarks_cover_and_what_a_gone_writer_left(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Covered by a watermark: retired.  Not covered, its data object older than the
    whole grace period (a writer that died before anyone acked it): retired too, with a
    warning.  Not covered and young: kept, and read and committed again.  Retired ones
    are skipped by the next LIST and deleted together by a sweep."""
    store = open_store(f"file://{tmp_path}/b")
    now = int(time.time() * 1000)
    covered = _announce(store, "h-a", 1, "p-covered", 3, now)
    gone = _announce(store, "h-b", 1, "p-gone", 1, now - 3 * HOUR_MS, legacy=True)
    young = _announce(store, "h-c", 1, "p-young", 1, now)
    stats = Stats()
    reader = AnnouncementReader(store, stats, clock=lambda: 0.0)  # no sweep is due
    anns = reader.read(list(store.list(keys.PENDING_PREFIX)))
    assert set(anns) == {covered, gone, young}
    marks = {"p-covered": Watermark("p-covered", 3, 7, now)}
    with caplog.at_level(logging.WARNING):
        reader.retire(anns, marks, now, expired_after_ms=2 * HOUR_MS)
    assert "p-gone" in caplog.text and "can never be committed" in caplog.text
    assert stats.get("announcements_expired") == 1
    # retired, not deleted yet (the clock stands still: no sweep is due)
    listed = list(store.list(keys.PENDING_PREFIX))
    assert {m.key for m in listed} == {covered, gone, young}
    assert set(reader.read(listed)) == {young}
    assert stats.get("announcements_read") == 3  # each read once, never again
    reader.sweep(force=True)
    assert [m.key for m in store.list(keys.PENDING_PREFIX)] == [young]
    assert stats.get("announcements_deleted") == 2


def test_retired_announcements_are_deleted_in_one_request_at_most_once_a_second(
    tmp_path: Path,
) -> None:
    """Each commit retires a few; one DELETE a second takes them all (``force``: at once,
    when the hub gives its lease up)."""
    store = CountingStore(open_store(f"file://{tmp_path}/b"))
    now = int(time.time() * 1000)
    clock = [100.0]
    reader = AnnouncementReader(store, Stats(), clock=lambda: clock[0])  # type: ignore[arg-type]
    for n in range(1, 5):  # a commit every 0.3 s, each retiring one announcement
        made = _announce(store, "h-a", n, "p", n, now)
        anns = reader.read(list(store.list(keys.PENDING_PREFIX)))
        assert set(anns) == {made}
        clock[0] += 0.3
        reader.retire(anns, {"p": Watermark("p", n, n, now)}, now, 2 * HOUR_MS)
    # swept once, at 101.2 (the fourth commit): the four in one request
    assert store.counts["delete_many"] == 1
    assert store.of("announcement")["delete"] == 4
    assert list(store.list(keys.PENDING_PREFIX)) == []
    _announce(store, "h-a", 5, "p", 5, now)
    anns = reader.read(list(store.list(keys.PENDING_PREFIX)))
    clock[0] += 0.1
    reader.retire(anns, {"p": Watermark("p", 5, 5, now)}, now, 2 * HOUR_MS)
    assert store.counts["delete_many"] == 1  # not due again yet
    reader.sweep(force=True)
    assert store.counts["delete_many"] == 2
    assert store.of("announcement")["delete"] == 5
    assert list(store.list(keys.PENDING_PREFIX)) == []


class RefusesEachKeyOnce:
    """Forwards to a store; its first DeleteObjects answers every key with AccessDenied
    (S3 reports a refused key inside a 200 answer, not as an error)."""

    def __init__(self, inner: Store) -> None:
        self._inner = inner
        self.refused = False

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)

    def delete_many(self, keys: Sequence[str]) -> list[tuple[str, Exception]]:
        if not self.refused:
            self.refused = True
            return [(k, AccessDeniedError(f"AccessDenied: {k}")) for k in keys]
        return self._inner.delete_many(keys)


def _refusing(how: str, inner: Store) -> Store:
    if how == "per key":
        return RefusesEachKeyOnce(inner)  # type: ignore[return-value]
    faulty = FaultInjectingStore(inner)  # the whole request refused: a 403
    faulty.arm("delete_many", when="before", error=AccessDeniedError("403 Forbidden"))
    return faulty  # type: ignore[return-value]


@pytest.mark.parametrize("how", ["per key", "whole request"])
def test_an_announcement_whose_delete_failed_stays_retired_and_is_deleted_later(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    """A refused delete is logged; the announcement is neither read nor committed
    again, and the next sweep (a second later even when forced) deletes it."""
    store = CountingStore(_refusing(how, open_store(f"file://{tmp_path}/b")))
    now = int(time.time() * 1000)
    clock = [100.0]
    stats = Stats()
    reader = AnnouncementReader(store, stats, clock=lambda: clock[0])  # type: ignore[arg-type]
    key = _announce(store, "h-a", 1, "p", 1, now)
    anns = reader.read(list(store.list(keys.PENDING_PREFIX)))
    assert reader.retire(anns, {"p": Watermark("p", 1, 0, now)}, now, 2 * HOUR_MS) == {}
    with caplog.at_level(logging.WARNING):
        reader.sweep(force=True)
    assert "could not delete 1 committed announcement" in caplog.text
    assert [m.key for m in store.list(keys.PENDING_PREFIX)] == [key]
    assert reader.read(list(store.list(keys.PENDING_PREFIX))) == {}  # skipped, not read
    assert stats.get("announcements_read") == 1
    reader.sweep(force=True)  # too soon after a failure: nothing sent
    assert store.counts["delete_many"] == 1
    clock[0] += 1.0
    reader.sweep(force=True)
    assert store.counts["delete_many"] == 2
    assert list(store.list(keys.PENDING_PREFIX)) == []
    assert stats.get("announcements_deleted") == 1


def test_a_holder_reads_an_announcement_its_key_spells_out_without_a_get(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One writer's appends whose metadata has no payloads are spelled out in the key
    (the common case: a GET each was a request per data object); the holder takes them
    from its LIST.  A key form that is not its body's (written by hand, or by a version that
    spells differently) is never trusted: the body is read instead."""
    store = CountingStore(open_store(f"file://{tmp_path}/b"))
    now = int(time.time() * 1000)
    item = MetadataItem(0, now - 5, b"")  # a produce() call's
    run = fa.make("p-1", 0, [fa.Announced(5, keys.data_key(ULID()), 10, (item,))])
    body = fa.encode([run], now)
    spelled = key_form([run], now, body, keys.pending_room("h-a", 1))
    assert spelled is not None
    good = keys.pending_key("h-a", 1, spelled)
    store.put(good, body, mode="create")
    other = fa.encode([fa.make("p-1", 0, [fa.Announced(6, keys.data_key(ULID()), 10, ())])], now)
    # the key spells run, with the CRC of the body it names: another one
    fields = spelled.split(".")
    others = key_form(fa.decode(other), now, other, 10_000)
    assert others is not None
    fields[1] = others.split(".")[1]
    liar = keys.pending_key("h-b", 1, ".".join(fields))
    store.put(liar, other, mode="create")
    # the key spells run, consistently, over a body of another length
    another = fa.encode([fa.make("p-22", 0, [fa.Announced(1, keys.data_key(ULID()), 7, ())])], now)
    assert len(another) != len(body)
    masked = keys.pending_key("h-c", 1, spelled)
    store.put(masked, another, mode="create")
    stats = Stats()
    reader = AnnouncementReader(store, stats, clock=lambda: 0.0)
    with caplog.at_level(logging.WARNING):
        anns = reader.read(list(store.list(keys.PENDING_PREFIX)))
    assert anns == {good: fa.decode(body), liar: fa.decode(other), masked: fa.decode(another)}
    assert store.of("announcement").get("get", 0) == 2  # the two bodies, only
    assert stats.get("announcements_read_from_key") == 1
    assert stats.get("announcements_read") == 3
    assert "h-b" in caplog.text and "CRC mismatch" in caplog.text
    assert "h-c" in caplog.text and "the body has" in caplog.text
