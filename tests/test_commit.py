"""Cross-writer group commit, the queue's side (tieredbuf.queue.commit): one CAS appends
what several writers announced, exactly once (I2), each writer's appends in order (I3),
under the root's commit lease."""

from __future__ import annotations

import pytest
from ulid import ULID

from tests.faults import FaultInjectingStore
from tieredbuf import keys
from tieredbuf.errors import OutcomeUnknownError, PreconditionFailedError
from tieredbuf.format import announce as fa
from tieredbuf.format.manifest import MetadataItem
from tieredbuf.queue.commit import Pending, commit, lease_free
from tieredbuf.queue.manifest_queue import ManifestQueue
from tieredbuf.store import open_store

MANIFEST_KEY = keys.MANIFEST_KEY


class Clock:
    def __init__(self, t: int = 1_800_000_000_000) -> None:
        self.t = t

    def __call__(self) -> int:
        return self.t


def _queue(store, clock: Clock | None = None) -> ManifestQueue:  # type: ignore[no-untyped-def]
    return ManifestQueue(store, sleep=lambda s: None, clock_ms=clock or Clock())


def _a(pseq: int, loc: str) -> fa.Announced:
    return fa.Announced(pseq, loc, 10, (MetadataItem(0, 1, b"m"),))


def _p(pid: str, *entries: tuple[int, str]) -> Pending:
    return Pending(pid, tuple(_a(s, loc) for s, loc in entries))


def _commit(q: ManifestQueue, pending: list[Pending], holder: str = "h1", **kw):  # type: ignore[no-untyped-def]
    return commit(q, pending, holder=holder, lease_ms=5_000, interval_ms=200, **kw)


def _locations(q: ManifestQueue) -> list[str]:
    return [e.location for e in q.read().entries()]


def test_I2_I3_one_commit_appends_every_writers_appends_in_their_order() -> None:
    q = _queue(open_store("memory://"))
    res = _commit(q, [_p("a", (1, "a1"), (2, "a2")), _p("b", (7, "b7")), _p("a", (3, "a3"))])
    assert _locations(q) == ["a1", "a2", "a3", "b7"]  # a writer's appends stay together
    assert res.placed == {"a": {1: 0, 2: 1, 3: 2}, "b": {7: 3}}
    wm = q.read().view.watermarks
    assert (wm["a"].producer_seq, wm["a"].last_sequence) == (3, 2)
    assert (wm["b"].producer_seq, wm["b"].last_sequence) == (7, 3)
    assert q.stats.get("commits") == 1


def test_I2_what_a_watermark_covers_is_never_appended_again() -> None:
    """A second committer, a retry after a crash, or a writer's re-announcement after a
    restart: producer numbers the watermark covers are skipped (gaps allowed, as the
    exporter's per-core numbers have)."""
    clock = Clock()
    q = _queue(open_store("memory://"), clock)
    _commit(q, [_p("exp", (10, "s1"), (25, "s2"))])
    _commit(q, [_p("other", (1, "rival"))])
    clock.t += 10_000  # the first committer died; its lease lapsed
    res = _commit(q, [_p("exp", (25, "s2"), (40, "s3"), (55, "s4"))], holder="h2")
    assert _locations(q) == ["s1", "s2", "rival", "s3", "s4"]
    assert res.placed == {"exp": {40: 3, 55: 4}}
    again = _commit(q, [_p("exp", (10, "s1"), (25, "s2"), (40, "s3"))], holder="h2")
    assert again.snapshot is None and again.placed == {}  # nothing new: no write
    assert len(_locations(q)) == 5


@pytest.mark.parametrize("fresh_first", [True, False])
def test_I5_of_two_announcements_of_one_append_the_freshest_upload_is_appended(
    fresh_first: bool,
) -> None:
    """A writer whose appends waited past half the GC grace period uploads them again and
    announces the fresh objects, while its older announcement may still be listed: the
    commit appends the fresh object (the old one may be GC'd), whichever it reads first."""
    clock = Clock()
    q = _queue(open_store("memory://"), clock)
    old = keys.data_key(ULID.from_timestamp((clock.t - 60_000) / 1000))
    new = keys.data_key(ULID.from_timestamp(clock.t / 1000))
    pending = [_p("a", (1, old), (2, "a2")), _p("a", (1, new))]
    res = _commit(q, pending[::-1] if fresh_first else pending)
    assert _locations(q) == [new, "a2"]
    assert res.placed == {"a": {1: 0, 2: 1}}


@pytest.mark.parametrize("error", [OutcomeUnknownError, PreconditionFailedError])
def test_I2_a_commit_whose_response_was_lost_is_recognised_with_its_own_placements(
    error: type[Exception],
) -> None:
    store = FaultInjectingStore(open_store("memory://"))
    q = _queue(store)
    _commit(q, [_p("a", (1, "a1"))])
    fault = store.arm("put", key=MANIFEST_KEY, when="after", error=error, times=1)
    res = _commit(q, [_p("a", (2, "a2")), _p("b", (1, "b1"))])
    assert fault.fired == 1
    assert res.placed == {"a": {2: 1}, "b": {1: 2}}
    assert _locations(q) == ["a1", "a2", "b1"]
    assert q.stats.get("deduplicated_appends") == 1


def test_I2_two_committers_at_once_cost_a_conflict_never_a_duplicate() -> None:
    """Clock skew can make two writers both believe they hold the lease: the loser's
    retry finds the appends already covered by the winner's watermarks."""
    store = FaultInjectingStore(open_store("memory://"))
    q1, q2 = _queue(store), _queue(store.inner, Clock(1_800_000_000_001))
    _commit(q1, [_p("a", (1, "a1"))])
    pending = [_p("a", (2, "a2")), _p("b", (1, "b1"))]

    def rival_commits_first(key: str) -> Exception:
        _commit(q2, pending, holder="h2", force=True)
        return PreconditionFailedError(key, "the rival's commit moved the root")

    store.arm("put", key=MANIFEST_KEY, when="before", error=rival_commits_first, times=1)
    res = _commit(q1, pending, force=True)
    assert res.placed == {}  # the rival appended them; this retry appends nothing
    assert _locations(q1) == ["a1", "a2", "b1"]
    assert q1.stats.get("conflicts") == 1


def test_the_lease_holder_commits_others_wait_until_it_lapses() -> None:
    clock = Clock()
    q = _queue(open_store("memory://"), clock)
    _commit(q, [_p("a", (1, "a1"))], holder="h1")
    lease = q.read().root.lease
    assert lease is not None and lease.holder == "h1"
    assert lease.expires_ms == clock.t + 5_000 and lease.interval_ms == 200
    assert not lease_free(lease, "h2", clock.t)
    res = _commit(q, [_p("b", (1, "b1"))], holder="h2")
    assert res.snapshot is None and res.lease == lease  # held elsewhere: nothing written
    clock.t += 5_001
    res = _commit(q, [_p("b", (1, "b1"))], holder="h2")  # lapsed: taken over
    assert res.placed == {"b": {1: 1}} and q.read().root.lease.holder == "h2"  # type: ignore[union-attr]


def test_a_release_gives_the_lease_up_in_the_commit_that_carries_the_rest() -> None:
    clock = Clock()
    q = _queue(open_store("memory://"), clock)
    _commit(q, [_p("a", (1, "a1"))], holder="h1")
    res = _commit(q, [_p("b", (1, "b1"))], holder="h1", release=True)
    assert res.placed == {"b": {1: 1}}
    lease = q.read().root.lease
    assert lease is not None and lease.expires_ms == 0
    assert lease_free(lease, "h2", clock.t)
    assert _commit(q, [], holder="h2", release=True).snapshot is None  # not its lease


def test_a_release_may_hand_the_lease_to_a_successor_who_commits_next() -> None:
    clock = Clock()
    q = _queue(open_store("memory://"), clock)
    _commit(q, [_p("a", (1, "a1"))], holder="h1")
    _commit(q, [_p("b", (1, "b1"))], holder="h1", release=True, successor="h2")
    lease = q.read().root.lease
    assert lease is not None and (lease.holder, lease.expires_ms) == ("h2", clock.t + 5_000)
    assert _commit(q, [_p("c", (1, "c1"))], holder="h3").snapshot is None  # h2's now
    assert _commit(q, [_p("c", (1, "c1"))], holder="h2").placed == {"c": {1: 2}}


def test_I5_an_append_naming_an_object_older_than_half_the_grace_is_held_back() -> None:
    """The RFC's GC race: the committer never links an object GC may have judged garbage;
    its writer uploads it again (the hub does that) and the rest of its appends wait."""
    from ulid import ULID

    clock = Clock()
    q = _queue(open_store("memory://"), clock)
    old = keys.data_key(ULID.from_timestamp((clock.t - 6 * 60_000) / 1000))
    fresh = keys.data_key(ULID.from_timestamp(clock.t / 1000))
    res = _commit(
        q,
        [_p("a", (1, old), (2, fresh)), _p("b", (1, fresh + "x"))],
        max_age_ms=lambda snap: 5 * 60_000,
    )
    assert res.stale == frozenset({"a"})
    assert res.placed == {"b": {1: 0}}  # b is not held back by a's stale object
    assert "a" not in q.read().view.watermarks
