"""Stateful model test of the manifest tree (M <= 4): append, dequeue, rebalance, retention
(which wins over the unacked: the head is pushed past), reload from storage, GC, and a crash
between a group PUT and the root CAS.

After every step the tree is reloaded from storage through a fresh queue (cold node
cache) and compared with a plain list model; every invariant is checked (I3, I5, I6).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tests.faults import FaultInjectingStore
from tieredbuf import gc, keys
from tieredbuf.config import TreeConfig
from tieredbuf.format import tree as ft
from tieredbuf.format.manifest import MetadataItem, NewEntry
from tieredbuf.queue import tree
from tieredbuf.queue.manifest_queue import ManifestQueue, retention_of
from tieredbuf.store import open_store


class Crash(Exception):
    """The process dies here (not a store error: nothing retries it)."""


class _Buf:
    """What gc.run_once needs of a Buffer."""

    def __init__(self, store: Any, queue: ManifestQueue) -> None:
        self.store, self.queue = store, queue

    def snapshot(self) -> Any:
        return self.queue.read()


def first_leaf(root: tree.Root, load: Any) -> tuple[int, int, int, int] | None:
    """(first, last, bytes, max_time) of the oldest linked leaf (root entry or level-0 group)."""
    if root.refs:
        r = root.refs[0]
        while r.level:
            r = load(r).refs[0]
        return r.first, r.last, r.total_bytes, r.max_time_ms
    if root.n_entries:
        s = root.stats[0]
        return root.entries_first, root.entries_first, s.size, s.time_ms
    return None


class TreeMachine(RuleBasedStateMachine):
    @initialize(
        m=st.integers(2, 4),
        max_bytes=st.sampled_from([None, None, 0, 40, 120]),
        max_age_ms=st.sampled_from([None, None, 0, 50, 500]),
    )
    def setup(self, m: int, max_bytes: int | None, max_age_ms: int | None) -> None:
        self.now = 1_000_000
        age = None if max_age_ms is None else timedelta(milliseconds=max_age_ms)
        self.cfg = TreeConfig(m=m, retention_max_bytes=max_bytes, retention_max_age=age)
        self.inner = open_store("memory://")
        self.store = FaultInjectingStore(self.inner)
        self.q = self._queue(self.store)
        self.model: list[tuple[str, int, int]] = []  # (location, size, time) by sequence
        self.head = 0
        self.low = 0
        self.pseq = 0
        self.q.create()
        self.epoch = self.q.initialize("c")

    def _queue(self, store: Any) -> ManifestQueue:
        return ManifestQueue(
            store, sleep=lambda s: None, clock_ms=lambda: self.now, tree_config=self.cfg
        )

    def _new(self, sizes: list[int]) -> list[NewEntry]:
        n = len(self.model)
        return [
            NewEntry(f"data/{n + i}.batch", (MetadataItem(0, self.now, b""),), s)
            for i, s in enumerate(sizes)
        ]

    @rule(sizes=st.lists(st.integers(0, 30), min_size=1, max_size=3))
    def append(self, sizes: list[int]) -> None:
        self.pseq += len(sizes)
        seqs = self.q.append(self._new(sizes), "p", self.pseq)
        assert seqs == list(range(len(self.model), len(self.model) + len(sizes)))
        self.model += [
            (f"data/{len(self.model) + i}.batch", s, self.now) for i, s in enumerate(sizes)
        ]

    @rule(k=st.integers(1, 6))
    def dequeue(self, k: int) -> None:
        if self.head >= len(self.model):
            return
        through = min(self.head + k - 1, len(self.model) - 1)
        self.q.dequeue(through, self.epoch)
        self.head = through + 1

    @rule(ms=st.integers(0, 200))
    def tick_and_apply_retention(self, ms: int) -> None:
        self.now += ms
        self.q.apply_retention()

    @rule(sizes=st.lists(st.integers(0, 30), min_size=1, max_size=3))
    def crash_between_group_put_and_root_cas(self, sizes: list[int]) -> None:
        self.store.arm("put", key=keys.MANIFEST_KEY, when="before", error=Crash("kill -9"))
        try:
            self.q.append(self._new(sizes), "p", self.pseq + len(sizes))
            raise AssertionError("the root CAS should have crashed")
        except Crash:
            pass
        self.store.disarm()  # the old root stays valid; any group written is an orphan

    @rule()
    def reload_from_storage(self) -> None:
        self.q = self._queue(self.store)

    @rule()
    def gc_reaps_unreachable_groups(self) -> None:
        # the buffer's grace period (10 min) is long past at now + 10^9 ms
        report = gc.run_once(_Buf(self.inner, self._queue(self.inner)), now_ms=self.now + 10**9)
        assert report.failed == 0

    @invariant()
    def tree_from_storage_equals_the_model(self) -> None:
        if not hasattr(self, "q"):
            return
        snap = self._queue(self.inner).read()
        root = snap.root
        load = snap.nodes.load
        n = len(self.model)
        # the head is the consumer's published position, unless retention passed it (it
        # wins over a stalled subscriber: the consumer is then told, DataLossError)
        assert root.next_seq == n and snap.head == max(self.head, snap.low)
        assert root.linked_first <= snap.low <= snap.head <= n
        assert snap.low >= self.low, "first retained sequence went backwards"
        self.low = snap.low
        if not self.cfg.retains:
            assert snap.low == snap.head
        got = list(tree.iter_from(root, root.linked_first, load))
        assert [e.sequence for e in got] == list(range(root.linked_first, n))  # I3
        assert [e.location for e in got] == [x[0] for x in self.model[root.linked_first :]]
        assert root.total_bytes == sum(x[1] for x in self.model[root.linked_first :])
        assert [e.sequence for e in snap.entries()] == list(range(snap.head, n))
        # I6: at most M root entries and M refs of each level below the top one
        m = self.cfg.m
        assert root.n_entries <= m
        levels = [r.level for r in root.refs]
        assert levels == sorted(levels, reverse=True)
        for lv in range(ft.MAX_LEVEL):
            assert levels.count(lv) <= m
        self._check_nodes(root.refs, load, m)
        leaf = first_leaf(root, load)
        if leaf is not None and self.cfg.retains:
            _first, _last, _nbytes, max_t = leaf
            assert snap.retention == retention_of(self.cfg)  # seeded by the first write
            p = self.q.policy(snap.head, self.now, snap.retention)
            too_old = p.age_limit_ms is not None and max_t < p.age_limit_ms
            too_big = p.max_bytes is not None and root.total_bytes > p.max_bytes
            # retention ran in the last write; it left nothing it should have unlinked
            # (the clock may have moved since, so only check what bytes alone demand)
            if not too_old and too_big:
                raise AssertionError(f"retention left {leaf} with {root.total_bytes} bytes")

    def _check_nodes(self, refs: Any, load: Any, m: int) -> None:
        for r in refs:
            node = load(r)
            if node.level:
                assert 1 <= len(node.refs) <= m
                assert ft.ref_for(r.level, node.first, None, node.refs, r.ulid) == r
                self._check_nodes(node.refs, load, m)
            else:
                assert 1 <= node.count <= m
                assert ft.ref_for(0, node.first, node.stats, None, r.ulid) == r


TreeMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_I3_I5_I6_tree_matches_model = TreeMachine.TestCase
