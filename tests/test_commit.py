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
from tieredbuf.queue.commit import (
    GAP,
    STALE,
    Committed,
    HeldBack,
    Pending,
    commit,
    lease_free,
)
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


def _seqs(res: Committed) -> dict[str, dict[int, int]]:
    """What a commit placed, by writer and producer seq: the sequence only (each placed
    entry's location is checked to be what the queue holds there)."""
    entries = {e.sequence: e.location for e in res.snapshot.entries()} if res.snapshot else {}
    out: dict[str, dict[int, int]] = {}
    for pid, placed in res.placed.items():
        for pseq, (seq, loc) in placed.items():
            if entries:
                assert entries[seq] == loc, f"placed {loc} at {seq}, the queue holds another"
            out.setdefault(pid, {})[pseq] = seq
    return out


def test_I2_I3_one_commit_appends_every_writers_appends_in_their_order() -> None:
    q = _queue(open_store("memory://"))
    res = _commit(q, [_p("a", (1, "a1"), (2, "a2")), _p("b", (7, "b7")), _p("a", (3, "a3"))])
    assert _locations(q) == ["a1", "a2", "a3", "b7"]  # a writer's appends stay together
    assert _seqs(res) == {"a": {1: 0, 2: 1, 3: 2}, "b": {7: 3}}
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
    assert _seqs(res) == {"exp": {40: 3, 55: 4}}
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
    assert res.placed == {"a": {1: (0, new), 2: (1, "a2")}}


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
    assert _seqs(res) == {"a": {2: 1}, "b": {1: 2}}
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
    assert _seqs(res) == {"b": {1: 1}} and q.read().root.lease.holder == "h2"  # type: ignore[union-attr]


def test_a_release_gives_the_lease_up_in_the_commit_that_carries_the_rest() -> None:
    clock = Clock()
    q = _queue(open_store("memory://"), clock)
    _commit(q, [_p("a", (1, "a1"))], holder="h1")
    res = _commit(q, [_p("b", (1, "b1"))], holder="h1", release=True)
    assert _seqs(res) == {"b": {1: 1}}
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
    assert _seqs(_commit(q, [_p("c", (1, "c1"))], holder="h2")) == {"c": {1: 2}}


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
    assert _seqs(res) == {"b": {1: 0}}  # b is not held back by a's stale object
    assert "a" not in q.read().view.watermarks


def test_I10_a_run_goes_in_only_once_the_append_it_follows_is_in() -> None:
    """The review's case: a writer's first append was held back (or its announcement
    lost), its second is announced as following it.  The second alone must not go in:
    the watermark would cover the first, and its writer would be told REMOTE for it."""
    q = _queue(open_store("memory://"))
    second = Pending("a", (_a(2, "a2"),), after=1)
    res = _commit(q, [second, _p("b", (1, "b1"))])
    assert res.held == {"a": HeldBack(2, GAP)}
    assert _locations(q) == ["b1"] and "a" not in q.read().view.watermarks
    res = _commit(q, [second, _p("a", (1, "a1"))])  # the first announced again
    assert _seqs(res) == {"a": {1: 1, 2: 2}} and not res.held


def test_I10_a_run_following_a_covered_append_goes_in_across_a_gap_in_numbers() -> None:
    """Exporter-style numbers (a segment's last per-core sequence + 1) leave gaps: a run
    following an append the watermark covers goes in whatever the gap."""
    q = _queue(open_store("memory://"))
    _commit(q, [_p("exp", (10, "s1"))])
    res = _commit(q, [Pending("exp", (_a(25, "s2"), _a(40, "s3")), after=10)])
    assert _seqs(res) == {"exp": {25: 1, 40: 2}}


def test_I10_I5_nothing_of_a_writer_goes_in_past_its_stale_append() -> None:
    """A stale append in the middle of a run stops the run there, and a later run that
    follows it waits too; the writer's refresh (a fresh upload announced again) lets the
    whole chain in, in order."""
    clock = Clock()
    q = _queue(open_store("memory://"), clock)
    old = keys.data_key(ULID.from_timestamp((clock.t - 6 * 60_000) / 1000))
    fresh = keys.data_key(ULID.from_timestamp(clock.t / 1000))
    again = keys.data_key(ULID.from_timestamp(clock.t / 1000))
    half = {"max_age_ms": lambda snap: 5 * 60_000}
    first = Pending("a", (_a(1, "a1"), _a(2, old), _a(3, fresh)))
    later = Pending("a", (_a(4, "a4"),), after=3)
    res = _commit(q, [first, later], **half)
    assert res.held == {"a": HeldBack(2, STALE, 6 * 60_000)} and res.stale == frozenset({"a"})
    assert _seqs(res) == {"a": {1: 0}}
    res = _commit(q, [later], **half)  # only the later run listed: it waits for 2 and 3
    assert res.held == {"a": HeldBack(4, GAP)} and res.placed == {}
    res = _commit(q, [later, Pending("a", (_a(2, again), _a(3, fresh)), after=1)], **half)
    assert _seqs(res) == {"a": {2: 1, 3: 2, 4: 3}}
    assert _locations(q) == ["a1", again, fresh, "a4"]
