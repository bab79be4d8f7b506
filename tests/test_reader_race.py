"""A continuous reader racing a writer that appends, dequeues, rebalances, applies
retention and runs GC: every sequence exactly once, in order (I3), nothing it still
needs reaped (I5), a transient group-read error retried and never read as empty."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest

from tests.faults import FaultInjectingStore
from tieredbuf import gc, keys
from tieredbuf.config import TreeConfig
from tieredbuf.consume.reader import ContinuousReader
from tieredbuf.errors import StoreError
from tieredbuf.format.manifest import MetadataItem, NewEntry
from tieredbuf.queue.manifest_queue import ManifestQueue
from tieredbuf.store import open_store


class _Buf:
    def __init__(self, store: Any, queue: ManifestQueue) -> None:
        self.store, self.queue = store, queue

    def snapshot(self) -> Any:
        return self.queue.read()


def _race(url: str, n: int, m: int) -> None:
    cfg = TreeConfig(m=m, retention_max_bytes=10 * 120)
    store = open_store(url)
    writer_q = ManifestQueue(store, sleep=lambda s: None, tree_config=cfg)
    window = 40
    cond = threading.Condition()
    state = {"appended": 0, "read": 0}
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            writer_q.create()  # a reader never creates the buffer; say so explicitly
            epoch = writer_q.initialize("c")
            # GC runs with the buffer's grace period: 0 here (no write of ours is in
            # flight when it runs)
            writer_q.set_gc_grace_period(timedelta(0), force=True)
            for i in range(n):
                with cond:  # keep the reader within `window` of the tail (retention keeps 120)
                    assert cond.wait_for(lambda i=i: i - state["read"] < window, timeout=30)
                writer_q.append(
                    [NewEntry(f"data/{i}.batch", (MetadataItem(0, i, b""),), 10)], "w", i + 1
                )
                with cond:
                    state["appended"] = i + 1
                    cond.notify_all()
                if i % 7 == 6:
                    writer_q.dequeue(i, epoch)
                if i % 50 == 49:  # no write of ours is in flight: grace 0 is safe here
                    gc.run_once(_Buf(store, writer_q), now_ms=2**40)
        except BaseException as e:
            errors.append(e)
            with cond:
                cond.notify_all()

    t = threading.Thread(target=writer)
    t.start()
    reader = ContinuousReader(ManifestQueue(store, tree_config=cfg), start_sequence=0)
    seen: list[int] = []
    while reader.next_sequence < n and not errors:
        got = reader.poll(max_entries=5)
        seen += [e.sequence for e in got]
        assert all(e.location == f"data/{e.sequence}.batch" for e in got)
        with cond:
            state["read"] = reader.next_sequence
            cond.notify_all()
            if not got:
                cond.wait_for(
                    lambda: state["appended"] > reader.next_sequence or bool(errors), timeout=30
                )
    t.join()
    assert not errors, errors
    assert seen == list(range(n))
    assert writer_q.stats.get("groups_written") > 0
    assert reader.lost == 0


def test_I3_reader_sees_every_sequence_once_while_writer_rebalances_retains_and_gcs() -> None:
    _race("memory://", n=400, m=3)


@pytest.mark.slow
def test_I3_reader_race_on_a_local_directory(tmp_path) -> None:  # type: ignore[no-untyped-def]
    _race(f"file://{tmp_path}/b", n=600, m=4)


def test_transient_group_read_error_is_retried_never_read_as_empty() -> None:
    store = FaultInjectingStore(open_store("memory://"))
    q = ManifestQueue(store, sleep=lambda s: None, tree_config=TreeConfig(m=2))
    for i in range(9):
        q.append([NewEntry(f"data/{i}.batch", ())], "p", i + 1)
    group = next(m.key for m in store.list(keys.GROUPS_PREFIX) if m.key.endswith(".kgroup"))
    fault = store.arm("get", key=group, when="before", error=StoreError, times=3)
    reader = ContinuousReader(ManifestQueue(store, sleep=lambda s: None), start_sequence=0)
    reader.nodes.sleep = lambda s: None
    assert [e.sequence for e in reader] == list(range(9))
    assert fault.fired == 3
