"""The tiered producer: LOCAL and REMOTE acks, bundles, exactly-once export, drain."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

import tieredbuf
from tieredbuf import Durability
from tieredbuf.errors import ConfigError, StageLockedError
from tieredbuf.format.announce import Announced
from tieredbuf.produce.publish import Pending, Publisher
from tieredbuf.queue.commit import Pending as CommitPending
from tieredbuf.queue.commit import commit
from tieredbuf.stage.stage import Stage

FAST = {"max_open_duration": timedelta(milliseconds=20)}


def _drain_consumer(buf: tieredbuf.Buffer) -> list[tieredbuf.ConsumedBatch]:
    c = buf.consumer()
    c.initialize()
    out = []
    while (b := c.next_batch()) is not None:
        out.append(b)
        c.ack(b.sequence)
    c.flush()
    c.close()
    return out


def test_I1_local_then_remote_ack_and_close_empties_the_stage(any_url, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    url, opts = any_url
    buf = tieredbuf.open(url, **opts)
    p = buf.producer(staging_dir=tmp_path / "stage", **FAST)
    h = p.produce([b"a", b"b"], metadata=b"m1")
    local = h.wait(Durability.LOCAL, timeout=10)
    assert local.durability >= Durability.LOCAL
    remote = h.wait(Durability.REMOTE, timeout=30)
    assert remote.sequence == 0 and remote.location and remote.location.endswith(".batch")
    h2 = p.produce([b"c"], metadata=b"m2")
    p.close()
    assert h2.result() is not None
    assert p.stage.sealed_segments() == []
    assert not list((tmp_path / "stage" / p.producer_id / "segments").glob("*.batch"))
    batches = _drain_consumer(buf)
    assert [r for b in batches for r in b.entries] == [b"a", b"b", b"c"]
    assert [m.payload for b in batches for m in b.metadata] == [b"m1", b"m2"]


def test_bundles_round_trip_with_slots_schemas_and_dictionary_key_types(tmp_path: Path) -> None:
    buf = tieredbuf.open(f"file://{tmp_path}/buf")
    dict_col = pa.DictionaryArray.from_arrays(pa.array([0, 1, 0], pa.int8()), pa.array(["x", "y"]))
    b0 = pa.record_batch({"n": pa.array([1, 2, 3], pa.int64()), "d": dict_col})
    b3 = pa.record_batch({"s": pa.array(["p", "q"])})
    with buf.producer(staging_dir=tmp_path / "stage", **FAST) as p:
        p.ingest({0: b0, 3: b3}).wait(Durability.LOCAL, timeout=10)
        p.ingest({0: b0}).wait(Durability.LOCAL, timeout=10)
    # one segment, or two when it was sealed between the ingests (its age, under load)
    batches = _drain_consumer(buf)
    assert batches and all(b.location.endswith(".qseg") for b in batches)
    bundles = [x for b in batches for x in b.bundles()]
    assert [sorted(b) for b in bundles] == [[0, 3], [0]]
    assert bundles[0][0].equals(b0) and bundles[0][3].equals(b3) and bundles[1][0].equals(b0)
    assert bundles[0][0].schema.field("d").type.index_type == pa.int8()
    only_slot3 = [x for b in batches for x in b.bundles(slots=[3])]
    assert [sorted(b) for b in only_slot3] == [[3], []]


def test_I2_segment_appended_before_a_crash_is_not_appended_again(tmp_path: Path) -> None:
    buf = tieredbuf.open(f"file://{tmp_path}/buf")
    stage = Stage(tmp_path / "stage")
    stage.append_records([b"r1"], b"m").result(timeout=10)
    (seg,) = stage.seal_all()
    # what the exporter does, up to the crash: upload and commit, but no release
    pend = _upload_and_commit(buf, f"{stage.producer_id}.batch", seg, seg.last_sequence + 1)
    stage.close()
    # restart: the exporter finds the sealed segment still staged
    p = buf.producer(staging_dir=tmp_path / "stage")
    p.close()
    entries = buf.entries()
    assert len(entries) == 1 and entries[0].location == pend.location
    assert p.stage.sealed_segments() == []


def test_I2_group_commit_after_a_crash_appends_only_what_did_not_land(tmp_path: Path) -> None:
    from tests.faults import FaultInjectingStore
    from tieredbuf.errors import OutcomeUnknownError
    from tieredbuf.keys import MANIFEST_KEY
    from tieredbuf.store import open_store

    url = f"file://{tmp_path}/buf"
    stage = Stage(tmp_path / "stage")
    segs = []
    for i in range(3):  # per-core sequences 0-1, 2-4, 5-7: append numbers 2, 5, 8
        for j in range(2 + (i > 0)):
            stage.append_records([b"r%d" % j], b"m").result(timeout=10)
        segs += stage.seal_all()
    assert [s.last_sequence + 1 for s in segs] == [2, 5, 8]
    # before the crash the exporter appended the first segment but did not release it
    first = tieredbuf.open(url)
    pend = _upload_and_commit(first, f"{stage.producer_id}.batch", segs[0], 2)
    stage.close()
    # restart: all three go in one group; the group commit lands and its response is lost
    faulty = FaultInjectingStore(open_store(url))
    fault = faulty.arm("put", key=MANIFEST_KEY, when="after", error=OutcomeUnknownError, times=1)
    buf = tieredbuf.Buffer(faulty)
    p = buf.producer(staging_dir=tmp_path / "stage")
    p.close()
    assert fault.fired == 1
    entries = buf.entries()
    assert len(entries) == 3 and entries[0].location == pend.location
    assert len({e.location for e in entries}) == 3
    assert buf.queue.stats.get("deduplicated_appends") == 1  # the lost response, recognised
    assert p.stage.sealed_segments() == []
    records = [r for b in _drain_consumer(buf) for r in b.entries]
    assert records == [b"r0", b"r1", b"r0", b"r1", b"r2", b"r0", b"r1", b"r2"]


def _upload_and_commit(buf: tieredbuf.Buffer, pid: str, seg: Any, pseq: int) -> Pending:
    """What an exporter does before it releases a segment: upload it and commit it."""
    pend = Pending(seg.path.read_bytes(), ".batch", seg.items, pseq)
    Publisher(buf.store, pid, retry=tieredbuf.RetryConfig()).upload(pend)
    commit(
        buf.queue,
        [CommitPending(pid, (Announced(pseq, pend.location, pend.size, pend.metadata),))],
        holder="h-test",
        lease_ms=0,
        interval_ms=0,
    )
    return pend


def test_a_second_producer_on_the_same_stage_is_refused(tmp_path: Path) -> None:
    buf = tieredbuf.open(f"file://{tmp_path}/buf")
    p = buf.producer(staging_dir=tmp_path / "stage")
    with pytest.raises(StageLockedError):
        buf.producer(staging_dir=tmp_path / "stage")
    p.close()


def test_unknown_staged_option_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown staged producer option"):
        tieredbuf.open("memory://").producer(staging_dir=tmp_path / "s", flush_sise=1)


def test_a_handle_waited_for_local_only_registers_nothing_until_asked_for_more(
    tmp_path: Path,
) -> None:
    """A call waited for LOCAL (or not at all) is not wired to the export tracker; a
    handle asked for REMOTE later, after its export, still gets the export's outcome."""
    buf = tieredbuf.open(f"file://{tmp_path}/buf")
    p = buf.producer(staging_dir=tmp_path / "stage")  # default 5 s segments: no seal yet
    handles = [p.produce([b"r%d" % i]) for i in range(20)]
    for h in handles:
        assert h.wait(Durability.LOCAL, timeout=10).durability == Durability.LOCAL
    assert p._tracker._waiting == {}
    p.flush(timeout=30)  # sealed and exported, nobody told: the tracker remembers
    outcomes = [h.result() for h in handles]
    assert all(o is not None and o.durability == Durability.REMOTE for o in outcomes)
    assert {o.location for o in outcomes if o is not None} == {outcomes[0].location}
    assert outcomes[0] is not None and outcomes[0].location.endswith(".batch")
    # a LOCAL wait after the export reports where the write got: REMOTE, with its entry
    late = p.produce([b"late"])
    p.flush(timeout=30)
    got = late.wait(Durability.LOCAL, timeout=10)
    assert got.durability == Durability.REMOTE and got.location is not None
    p.close()
    assert [r for b in _drain_consumer(buf) for r in b.entries] == [
        b"r%d" % i for i in range(20)
    ] + [b"late"]


def test_a_local_wait_times_out_with_the_level_it_waited_for(tmp_path: Path) -> None:
    buf = tieredbuf.open(f"file://{tmp_path}/buf")
    with buf.producer(staging_dir=tmp_path / "stage", flush_interval=timedelta(seconds=30)) as p:
        h = p.produce([b"x"])
        with pytest.raises(TimeoutError, match="not LOCAL after 0 s"):
            h.wait(Durability.LOCAL, timeout=0)


def test_I8_the_exporter_starts_all_its_upload_threads_at_once(tmp_path: Path) -> None:
    """Flat thread count from the start: uploads that first overlap later in a run
    start no new threads (the soak's leak check would see them as growth)."""
    buf = tieredbuf.open(f"file://{tmp_path}/buf")
    with buf.producer(staging_dir=tmp_path / "stage", max_uploads_in_flight=3) as p:
        assert len(_pool_threads(p)) == 3  # before any upload
        for i in range(20):
            p.produce([b"%d" % i])
        p.flush(timeout=30)
        assert len(_pool_threads(p)) == 3


def _pool_threads(p: object) -> set[object]:
    return set(p.exporter._pool._threads)  # type: ignore[attr-defined]
