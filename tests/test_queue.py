"""The CAS queue: append / initialize / dequeue, exactly-once append (I2), fencing (I4)."""

from __future__ import annotations

import pytest

import tieredbuf
from tests.faults import FaultInjectingStore
from tieredbuf.errors import (
    AlreadyExistsError,
    FencedError,
    OutcomeUnknownError,
    PreconditionFailedError,
    ProducerIdReusedError,
)
from tieredbuf.format.manifest import MetadataItem, NewEntry
from tieredbuf.keys import MANIFEST_KEY
from tieredbuf.queue.manifest_queue import ManifestQueue
from tieredbuf.store import open_store


def _e(loc: str) -> NewEntry:
    return NewEntry(loc, (MetadataItem(0, 1, b"m"),))


def _queue(store) -> ManifestQueue:  # type: ignore[no-untyped-def]
    return ManifestQueue(store, sleep=lambda s: None)


def test_I3_append_assigns_contiguous_sequences_on_every_backend(any_url) -> None:  # type: ignore[no-untyped-def]
    url, opts = any_url
    q = _queue(open_store(url, **opts))
    assert q.append([_e("a"), _e("b")], "p1", 2) == [0, 1]
    assert q.append([_e("c")], "p2", 1) == [2]
    snap = q.read()
    assert [(e.sequence, e.location) for e in snap.entries()] == [(0, "a"), (1, "b"), (2, "c")]
    assert snap.footer.next_sequence == 3


@pytest.mark.parametrize(
    ("error", "mode_first"),
    [
        (OutcomeUnknownError, False),  # connection reset after the If-Match PUT landed
        (PreconditionFailedError, False),  # obstore retried the landed If-Match PUT
        (AlreadyExistsError, True),  # obstore retried the landed create of a new manifest
    ],
)
def test_I2_append_whose_outcome_is_unknown_leaves_exactly_one_entry(
    error: type[Exception], mode_first: bool
) -> None:
    store = FaultInjectingStore(open_store("memory://"))
    q = _queue(store)
    if not mode_first:
        q.append([_e("seed")], "other", 1)
    fault = store.arm("put", key=MANIFEST_KEY, when="after", error=error, times=1)
    seqs = q.append([_e("x"), _e("y")], "p", 2)
    assert fault.fired == 1
    locs = [e.location for e in q.read().entries()]
    assert locs.count("x") == 1 and locs.count("y") == 1
    assert seqs == [locs.index("x"), locs.index("y")]
    assert q.stats.get("deduplicated_appends") == 1


def test_I2_retry_after_unknown_outcome_when_others_appended_meanwhile() -> None:
    store = FaultInjectingStore(open_store("memory://"))
    q = _queue(store)
    q.append([_e("seed")], "other", 1)
    other = _queue(store.inner)

    def lost_response(key: str) -> Exception:
        other.append([_e("rival")], "rival", 1)  # lands between our PUT and our retry
        return OutcomeUnknownError("connection reset by peer")

    store.arm("put", key=MANIFEST_KEY, when="after", error=lost_response)
    assert q.append([_e("mine")], "p", 1) == [1]
    assert [e.location for e in q.read().entries()] == ["seed", "mine", "rival"]


def test_I2_a_regrouped_retry_appends_only_what_did_not_land() -> None:
    q = _queue(open_store("memory://"))
    q.append([_e("s1"), _e("s2")], "exporter", 2)
    # after a restart the exporter retries segments 1..3 as one group
    seqs = q.append([_e("s1"), _e("s2"), _e("s3")], "exporter", 3)
    assert seqs == [None, None, 2]
    assert [e.location for e in q.read().entries()] == ["s1", "s2", "s3"]


def test_I2_append_once_without_a_watermark_recognises_its_own_landing() -> None:
    """The Spark sink's batch jobs without a producer id: no watermark is written (one
    per job used to evict other producers' after 16,384 jobs); a retry after a lost
    response finds its first entry's location at the sequence it wrote."""
    store = FaultInjectingStore(open_store("memory://"))
    q = _queue(store)
    other = _queue(store.inner)
    q.append([_e("seed")], "other", 1)

    def lost_response(key: str) -> Exception:
        other.append([_e("rival")], "rival", 1)
        return OutcomeUnknownError("connection reset by peer")

    store.arm("put", key=MANIFEST_KEY, when="after", error=lost_response, times=1)
    assert q.append_once([_e("x"), _e("y")]) == [1, 2]
    assert [e.location for e in q.read().entries()] == ["seed", "x", "y", "rival"]
    assert set(q.read().view.watermarks) == {"other", "rival"}
    store.arm("put", key=MANIFEST_KEY, when="before", error=PreconditionFailedError, times=2)
    assert q.append_once([_e("z")]) == [4]  # a conflict that did not land is retried
    assert [e.location for e in q.read().entries()][-1:] == ["z"]


def test_I2_append_strict_refuses_a_watermark_it_did_not_write() -> None:
    q = _queue(open_store("memory://"))
    q.append([_e("a"), _e("b")], "sink", 20)
    assert q.append([_e("a2")], "sink", 20, strict=True) == [1]  # its own retry: landed
    with pytest.raises(ProducerIdReusedError, match="'sink'"):
        q.append([_e("c")], "sink", 10, strict=True)  # below: another writer
    with pytest.raises(ProducerIdReusedError):
        q.append([_e("c"), _e("d")], "sink", 21, strict=True)  # 20 inside 20..21
    assert q.append([_e("e")], "sink", 30, strict=True) == [2]
    assert [e.location for e in q.read().entries()] == ["a", "b", "e"]


def test_I2_a_conflict_that_did_not_land_is_retried() -> None:
    store = FaultInjectingStore(open_store("memory://"))
    q = _queue(store)
    store.arm("put", key=MANIFEST_KEY, when="before", error=PreconditionFailedError, times=3)
    assert q.append([_e("a")], "p", 1) == [0]
    assert q.stats.get("conflicts") == 3
    assert q.stats.get("deduplicated_appends") == 0
    assert len(q.read().entries()) == 1


def test_I4_initialize_bumps_epoch_and_dequeue_is_fenced() -> None:
    q = _queue(open_store("memory://"))
    q.append([_e("a"), _e("b"), _e("c")], "p", 3)
    e1 = q.initialize("c1")
    e2 = q.initialize("c2")
    assert e2 == e1 + 1
    before = q.store.get(MANIFEST_KEY).data
    with pytest.raises(FencedError):
        q.dequeue(1, e1)
    assert q.store.get(MANIFEST_KEY).data == before
    q.dequeue(1, e2)
    assert [e.sequence for e in q.read().entries()] == [2]
    q.dequeue(1, e2)  # idempotent
    assert q.read().footer.entry_count == 1


def test_I2_initialize_whose_response_was_lost_bumps_the_epoch_once() -> None:
    store = FaultInjectingStore(open_store("memory://"))
    q = _queue(store)
    q.append([_e("a")], "p", 1)
    store.arm("put", key=MANIFEST_KEY, when="after", error=OutcomeUnknownError)
    assert q.initialize("me") == 1
    assert q.read().footer.epoch == 1


def test_I6_append_does_not_decode_existing_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    q = _queue(open_store("memory://"))
    q.append([_e(f"l{i}") for i in range(50)], "p", 50)
    from tieredbuf.format import manifest

    def boom(*a, **k):  # type: ignore[no-untyped-def]
        raise AssertionError("append decoded the existing entries")

    monkeypatch.setattr(manifest, "iter_entries", boom)
    q.append([_e("z")], "p", 51)
    monkeypatch.undo()
    assert q.read().footer.entry_count == 51


def test_reads_a_plain_rfc_v1_manifest_and_upgrades_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tests.format.test_manifest import _rfc_v1_manifest

    buf = tieredbuf.open(f"file://{tmp_path}/b")
    buf.store.put(MANIFEST_KEY, _rfc_v1_manifest())
    assert [e.sequence for e in buf.entries()] == [5, 6]
    buf.queue.append([_e("n")], "p", 1)
    snap = buf.snapshot()
    assert snap.footer.version == 2 and [e.sequence for e in snap.entries()] == [5, 6, 7]
