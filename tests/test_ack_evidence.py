"""I10: a handle becomes REMOTE only from evidence -- its own entry located in a manifest.

Each test here is one of the review's cases where a handle was told REMOTE with no
sequence and its records were in no manifest: a writer whose first upload went stale
before the holder saw it, a damaged announcement followed by a lease hand-over, tree
node reads failing while the records were committed, a producer id reused on a wiped
stage.  Two hubs on one store in one process stand for two processes (each buffer
object has its own hub); the torture test with real processes, kills, stops, skew and
GC is ``tests/test_ack_torture.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import tieredbuf
from tieredbuf import errors, keys
from tieredbuf.config import TreeConfig
from tieredbuf.produce.fanin import hub_for
from tieredbuf.produce.handles import WriteHandle, WriteOutcome
from tieredbuf.store import open_store


def _records(buf: tieredbuf.Buffer) -> dict[bytes, int]:
    """record -> the sequence of the entry holding it (every record once, or it fails)."""
    out: dict[bytes, int] = {}
    for e in buf.entries():
        batch = tieredbuf.ConsumedBatch(e.sequence, e.location, e.metadata, buf.read_object(e))
        for r in batch.entries:
            assert r not in out, f"I2: {r!r} twice"
            out[r] = e.sequence
    return out


def _check_evidence(handles: dict[bytes, WriteHandle], got: dict[bytes, int]) -> int:
    """The checker of I10: a REMOTE handle names a sequence, and the entry there holds its
    record; a handle not REMOTE failed loudly.  Returns how many were REMOTE."""
    remote = 0
    for rec, h in handles.items():
        try:
            out = h.result()
        except errors.TieredBufError:
            continue  # failed loudly: allowed, never a silent loss
        assert out is not None, f"{rec!r}: neither REMOTE nor failed"
        assert out.sequence is not None, f"I10: {rec!r} REMOTE with no sequence"
        assert got.get(rec) == out.sequence, f"I10: {rec!r} REMOTE at {out.sequence}, not there"
        remote += 1
    return remote


def _wait_for(cond: Any, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@contextmanager
def _busy(p: Any, fmt: bytes) -> Iterator[list[int]]:
    """``p`` keeps producing ``fmt % i`` one after another, so its hub keeps its lease."""
    stop = threading.Event()
    sent = [0]

    def run() -> None:
        while not stop.is_set():
            p.produce([fmt % sent[0]]).wait(timeout=60)
            sent[0] += 1

    t = threading.Thread(target=run)
    t.start()
    try:
        yield sent
    finally:
        stop.set()
        t.join(timeout=60)


class SlowFirstDataPut:
    """Forwards to a store; the first data object's PUT lands ``delay`` seconds late (an
    upload throttled and retried under the same ULID)."""

    def __init__(self, inner: Any, delay: float) -> None:
        self._inner = inner
        self.delay = delay
        self.slowed = False

    def put(self, key: str, data: Any, *, mode: Any = "overwrite") -> str:
        if key.startswith(keys.DATA_PREFIX) and not self.slowed:
            self.slowed = True
            threading.Event().wait(self.delay)  # the throttled upload, not synchronisation
        etag: str = self._inner.put(key, data, mode=mode)
        return etag

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@pytest.mark.slow
def test_I10_a_writer_whose_first_upload_went_stale_is_never_told_remote_without_its_entry(
    tmp_path: Path,
) -> None:
    """The review's case 1: a writer's first upload lands past half the GC grace period,
    its second is fresh.  The holder holds the first back; the second must not go in past
    it (its watermark would cover the first), and the first is uploaded again by its
    writer: both land, once, in order, each handle REMOTE with its own entry."""
    url = f"file://{tmp_path}/b"
    holder = tieredbuf.open(url)
    holder.create()
    holder.set_gc_grace_period(timedelta(seconds=2), force=True)  # half: 1 s
    slow = SlowFirstDataPut(open_store(url), 1.5)
    other = tieredbuf.Buffer(slow)  # type: ignore[arg-type]
    theirs = hub_for(other.store, other.queue)
    hp = holder.producer(manifest_writes_per_s=5.0)
    hp.produce([b"h:first"]).wait(timeout=60)  # the holder takes the lease
    with _busy(hp, b"h:%d"):
        op = other.producer(flush_interval=timedelta(milliseconds=5))
        handles = {b"w:0": op.produce([b"w:0"])}
        _wait_for(lambda: theirs.stats.get("announcements") >= 1)
        handles[b"w:1"] = op.produce([b"w:1"])
        for h in handles.values():
            h.wait(tieredbuf.Durability.REMOTE, timeout=30)
        op.close(timeout=30)
    hp.close(timeout=30)
    got = _records(holder)
    assert _check_evidence(handles, got) == 2
    assert got[b"w:0"] < got[b"w:1"]  # I3


class DamagedSecondAnnouncement:
    """Forwards to a store; the second announcement it writes lands with a byte of its
    body flipped and its key form dropped (the reader has to read the damaged body)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.seen = 0
        self.damaged: str | None = None

    def put(self, key: str, data: Any, *, mode: Any = "overwrite") -> str:
        if key.startswith(keys.PENDING_PREFIX):
            self.seen += 1
            if self.seen == 2:
                parsed = keys.parse_pending_key(key)
                assert parsed is not None
                key = keys.pending_key(*parsed, "")
                raw = bytearray(data)
                raw[len(raw) // 2] ^= 0xFF
                data = bytes(raw)
                self.damaged = key
        etag: str = self._inner.put(key, data, mode=mode)
        return etag

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@pytest.mark.slow
def test_I10_a_damaged_announcement_then_a_lease_handover_loses_nothing(tmp_path: Path) -> None:
    """The review's case 3: a writer's second announcement is damaged, then the holder
    leaves and hands its lease to that writer's hub.  The new holder commits everything
    of its own that is unresolved (announced or not), so the group in the damaged
    announcement goes in before the later one, and every handle is REMOTE with its own
    entry; the damaged announcement is deleted, not left behind."""
    url = f"file://{tmp_path}/b"
    holder = tieredbuf.open(url)
    damaging = DamagedSecondAnnouncement(open_store(url))
    other = tieredbuf.Buffer(damaging)  # type: ignore[arg-type]
    theirs = hub_for(other.store, other.queue)
    hp = holder.producer(manifest_writes_per_s=5.0)
    hp.produce([b"h:first"]).wait(timeout=60)  # the holder takes the lease
    op = other.producer(flush_interval=timedelta(milliseconds=5))
    handles: dict[bytes, WriteHandle] = {}
    with _busy(hp, b"h:%d"):
        handles[b"a:0"] = op.produce([b"a:0"])
        handles[b"a:0"].wait(timeout=30)
        handles[b"a:1"] = op.produce([b"a:1"])
        _wait_for(lambda: damaging.damaged is not None)
    hp.close(timeout=30)  # its last writer leaves: the lease goes to the hub heard last
    _wait_for(lambda: theirs.cutoff_in() is not None)  # it knows it holds the lease
    handles[b"a:2"] = op.produce([b"a:2"])
    for h in handles.values():
        h.wait(tieredbuf.Durability.REMOTE, timeout=30)
    op.close(timeout=30)
    got = _records(holder)
    assert _check_evidence(handles, got) == 3
    assert got[b"a:0"] < got[b"a:1"] < got[b"a:2"]  # I3
    assert list(holder.store.list(keys.PENDING_PREFIX)) == []


class Refusing:
    """Forwards to a store; refuses (503, a transient error) reads of the root while
    ``root`` is set and reads of tree nodes while ``groups`` is set, counting them."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.root = self.groups = False
        self.refused_groups = 0

    def _check(self, key: str) -> None:
        if self.root and key == keys.MANIFEST_KEY:
            raise errors.TransientStoreError(f"injected 503 SlowDown on {key}")
        if self.groups and key.startswith(keys.GROUPS_PREFIX):
            self.refused_groups += 1
            raise errors.TransientStoreError(f"injected 503 SlowDown on {key}")

    def get(self, key: str) -> Any:
        self._check(key)
        return self._inner.get(key)

    def get_if_changed(self, key: str, etag: str) -> Any:
        self._check(key)
        return self._inner.get_if_changed(key, etag)

    def get_range(self, key: str, start: int, end: int) -> Any:
        self._check(key)
        return self._inner.get_range(key, start, end)

    def get_suffix(self, key: str, length: int) -> Any:
        self._check(key)
        return self._inner.get_suffix(key, length)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@pytest.mark.slow
def test_I10_records_in_the_manifest_reach_remote_once_tree_reads_work_again(
    tmp_path: Path,
) -> None:
    """The review's case 4: the writer's reads of tree nodes fail (503) while its records
    are committed and moved into a group node.  Its handles are neither lost nor told
    REMOTE blindly: once the reads work, each is REMOTE with its own entry."""
    url = f"file://{tmp_path}/b"
    tree = TreeConfig(m=4)
    holder = tieredbuf.Buffer(open_store(url), tree)
    refusing = Refusing(open_store(url))
    other = tieredbuf.Buffer(refusing, tree)  # type: ignore[arg-type]
    hp = holder.producer(manifest_writes_per_s=10.0)
    hp.produce([b"h:first"]).wait(timeout=60)  # the holder takes the lease
    op = other.producer(flush_interval=timedelta(milliseconds=5))
    op.produce([b"o:first"]).wait(timeout=60)  # the writer knows the holder
    with _busy(hp, b"h:%d") as sent:
        # the writer's root reads fail first, so it misses the commit that carries its
        # records; the holder's appends meanwhile move them into a group node, whose
        # reads then fail too
        refusing.root = True
        handles = {b"o:%d" % i: op.produce([b"o:%d" % i]) for i in range(5)}
        _wait_for(lambda: all(r in _records(holder) for r in handles))
        start = sent[0]
        _wait_for(lambda: sent[0] >= start + 12)  # three groups of four on top of them
        assert all(h.result() is None for h in handles.values())
        refusing.groups = True
        refusing.root = False
        # past the node reader's own retries: a whole lookup fails, and its turn with it
        _wait_for(lambda: refusing.refused_groups >= other.queue.nodes.max_attempts)
        refusing.groups = False
        for h in handles.values():
            h.wait(tieredbuf.Durability.REMOTE, timeout=30)
    op.close(timeout=30)
    hp.close(timeout=30)
    assert _check_evidence(handles, _records(holder)) == 5


@pytest.mark.slow
def test_I10_a_producer_id_reused_on_a_wiped_stage_is_refused_never_acked(
    tmp_path: Path,
) -> None:
    """The review's case 5: a staged producer given an explicit id on a new (wiped) stage
    starts its numbers again below the id's watermark.  Its writes must not be taken for
    duplicates of the old stage's and acked: the reuse is refused."""
    url = f"file://{tmp_path}/b"
    buf = tieredbuf.open(url)
    with buf.producer(tmp_path / "s1", producer_id="fixed") as p:
        for i in range(10):
            p.produce([b"old:%d" % i]).wait(timeout=30)
    with pytest.raises(errors.ProducerIdReusedError):
        p2 = buf.producer(tmp_path / "s2", producer_id="fixed")
        try:
            hs = [p2.produce([b"new:%d" % i]) for i in range(10)]
            for h in hs:
                out: WriteOutcome = h.wait(timeout=30)
                assert out.sequence is not None, "I10: REMOTE with no sequence"
        finally:
            p2.close(timeout=30)
    got = _records(buf)
    assert not [r for r in got if r.startswith(b"new:")]
