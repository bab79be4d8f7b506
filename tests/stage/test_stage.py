"""The Stage facade on real files: acks, sealing triggers, release and the cursor,
locking, producer ids, recovery (no loss, no duplicates), caps (I1, I3, I8)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pyarrow as pa
import pytest

from tieredbuf.config import SegmentConfig, StageConfig, WalConfig
from tieredbuf.errors import BackpressureError, StageError, StageLockedError
from tieredbuf.format.batch import decode_batch
from tieredbuf.format.segment import SegmentReader
from tieredbuf.stage.sealed_segment import SealedSegment
from tieredbuf.stage.stage import Stage

REPO = Path(__file__).resolve().parents[2]


def cfg(**kw: object) -> StageConfig:
    seg = kw.pop("segment", SegmentConfig(max_open_duration=timedelta(seconds=60)))
    wal = kw.pop("wal", WalConfig(flush_interval=timedelta(milliseconds=2)))
    return StageConfig(segment=seg, wal=wal, **kw)  # type: ignore[arg-type]


def records_of(segs: list[SealedSegment]) -> list[bytes]:
    out: list[bytes] = []
    for s in segs:
        if s.stream == "batch":
            out += decode_batch(s.path.read_bytes(), str(s.path))
    return out


def run_worker(d: Path, mode: str, n: int = 0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.stage.stage_worker", str(d), mode, str(n)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_records_round_trip_with_rfc_metadata_items(tmp_path: Path) -> None:
    with Stage(tmp_path, "p", cfg()) as st:
        a1 = st.append_records([b"a", b"b"], b"m1")
        a2 = st.append_records([], b"empty")
        a3 = st.append_records([b"c"], b"m3")
        acks = [a.result(timeout=5) for a in (a1, a2, a3)]
        assert [a.sequence for a in acks] == [0, 1, 2]
        assert acks[0].wal_end == acks[1].wal_start
        (seg,) = st.seal_all()
        assert seg.stream == "batch" and seg.path.suffix == ".batch"
        assert decode_batch(seg.path.read_bytes()) == [b"a", b"b", b"c"]
        assert [(i.start_index, i.payload) for i in seg.items] == [
            (0, b"m1"),
            (2, b"empty"),
            (2, b"m3"),
        ]
        assert seg.sequences == ((0, 2),)
        assert (seg.wal_start, seg.wal_end) == (acks[0].wal_start, acks[2].wal_end)
        assert stat.S_IMODE(seg.path.stat().st_mode) == 0o400
        assert seg.sidecar_path.exists()
        assert st.sealed_segments() == [seg]
        # Quiver's rule: the cursor moves once the segment is durable, not at release
        assert st.wal_cursor() == acks[2].wal_end


def test_bundles_round_trip_with_schema_drift(tmp_path: Path) -> None:
    b1 = pa.record_batch({"x": pa.array([1, 2], pa.int32())})
    b2 = pa.record_batch({"x": pa.array([3], pa.int32()), "y": pa.array(["z"])})
    d8 = pa.record_batch(
        {"k": pa.DictionaryArray.from_arrays(pa.array([0, 0], pa.uint8()), pa.array(["v"]))}
    )
    with Stage(tmp_path, "p", cfg()) as st:
        for b in ({0: b1, 3: d8}, {0: b2}, {3: d8}):
            st.append_bundle(b).result(timeout=5)
        (seg,) = st.seal_all()
        assert seg.stream == "qseg" and seg.entry_count == 3
        got = SegmentReader(seg.path.read_bytes(), str(seg.path)).bundles()
        assert [g.sequence for g in got] == [0, 1, 2]
        assert got[0].slots[0].equals(b1) and got[1].slots[0].equals(b2)
        assert got[2].slots[3].schema.field("k").type.index_type == pa.uint8()


def test_release_deletes_the_file(tmp_path: Path) -> None:
    with Stage(tmp_path, "p", cfg()) as st:
        st.append_records([b"x"]).result(timeout=5)
        (seg,) = st.seal_all()
        st.release(seg)
        assert not seg.path.exists() and not seg.sidecar_path.exists()
        assert st.sealed_segments() == []
        with pytest.raises(StageError):
            st.release(seg)


def test_second_opener_gets_stage_locked_error_in_process_and_across_processes(
    tmp_path: Path,
) -> None:
    st = Stage(tmp_path, "p", cfg())
    try:
        with pytest.raises(StageLockedError):
            Stage(tmp_path, "p", cfg())
        code = (
            "import sys\nfrom tieredbuf.stage.stage import Stage\n"
            "from tieredbuf.errors import StageLockedError\n"
            f"try:\n    Stage({str(tmp_path)!r}, 'p')\nexcept StageLockedError:\n"
            "    sys.exit(7)\n"
        )
        r = subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=60)
        assert r.returncode == 7
    finally:
        st.close()
    Stage(tmp_path, "p", cfg()).close()  # released on close


def test_producer_id_is_stable_across_restarts(tmp_path: Path) -> None:
    with Stage(tmp_path, config=cfg()) as a:
        pid = a.producer_id
        assert a.path == tmp_path / pid
    with Stage(tmp_path, config=cfg()) as b:
        assert b.producer_id == pid


def test_segment_only_acks_at_seal_and_max_open_duration_seals_by_timer(
    tmp_path: Path,
) -> None:
    c = cfg(
        durability="segment_only",
        segment=SegmentConfig(max_open_duration=timedelta(milliseconds=50)),
    )
    with Stage(tmp_path, "p", c) as st:
        f = st.append_records([b"x"])
        ack = f.result(timeout=10)  # completes only when the timer seals the segment
        assert ack.wal_start is None
        (seg,) = st.sealed_segments()
        assert records_of([seg]) == [b"x"]
        assert not (st.path / "wal").exists()


def test_target_size_triggers_a_seal(tmp_path: Path) -> None:
    c = cfg(
        durability="segment_only",
        segment=SegmentConfig(target_size=1000, max_open_duration=timedelta(seconds=60)),
    )
    with Stage(tmp_path, "p", c) as st:
        futs = [st.append_records([b"r" * 100]) for _ in range(12)]
        futs[9].result(timeout=10)
        assert len(st.sealed_segments()) >= 1


def test_sequence_never_goes_backwards_after_cleanup_and_restart(tmp_path: Path) -> None:
    """Quiver issue #4024: the per-core sequence is persisted, not re-derived."""
    for mode in ("segment_only", "wal"):
        d = tmp_path / mode
        with Stage(d, "p", cfg(durability=mode)) as st:
            futs = [st.append_records([b"x"]) for _ in range(5)]
            for seg in st.seal_all():
                st.release(seg)
            assert [f.result(timeout=5).sequence for f in futs] == [0, 1, 2, 3, 4]
        wal_dir = d / "p" / "wal"
        if wal_dir.exists():  # wipe every WAL byte that could reveal the high-water
            for p in wal_dir.iterdir():
                p.unlink()
        with Stage(d, "p", cfg(durability=mode)) as st:
            f = st.append_records([b"y"])
            st.seal_all()
            assert f.result(timeout=5).sequence == 5


def test_I1_crash_after_acks_replays_everything_exactly_once(tmp_path: Path) -> None:
    """I1: every acked entry survives os._exit without close, sealed on reopen."""
    r = run_worker(tmp_path, "exit-after-acks", 300)
    assert r.returncode == 0, r.stderr
    acked = {int(x) for x in r.stdout.split()}
    assert len(acked) == 300
    with Stage(tmp_path, "p", cfg()) as st:
        got = records_of(st.sealed_segments())
        assert st.stats.replayed_entries > 0
    assert sorted(got) == sorted(f"rec-{i}".encode() for i in range(300))


def test_I2_crash_after_segment_commit_before_cursor_moves_has_no_duplicates(
    tmp_path: Path,
) -> None:
    r = run_worker(tmp_path, "exit-before-cursor", 50)
    assert r.returncode == 3, r.stderr
    segs_dir = tmp_path / "p" / "segments"
    assert any(p.suffix == ".batch" for p in segs_dir.iterdir())
    with Stage(tmp_path, "p", cfg()) as st:
        got = records_of(st.sealed_segments())
    assert sorted(got) == sorted(f"rec-{i}".encode() for i in range(50))


def test_I2_segment_whose_sidecar_rename_was_lost_is_quarantined_and_replayed(
    tmp_path: Path,
) -> None:
    """A seal renames the sidecar, then the segment, under one directory fsync. Were a
    filesystem to keep only the segment's rename, the segment has no sidecar: it is
    set aside as ``.orphan`` and its entries come back from the WAL, once each."""
    r = run_worker(tmp_path, "exit-before-cursor", 50)
    assert r.returncode == 3, r.stderr
    segs_dir = tmp_path / "p" / "segments"
    (seg,) = [p for p in segs_dir.iterdir() if p.suffix == ".batch"]
    seg.with_name(seg.name + ".json").unlink()
    with Stage(tmp_path, "p", cfg()) as st:
        got = records_of(st.sealed_segments())
        assert st.stats.replayed_entries > 0
    assert sorted(got) == sorted(f"rec-{i}".encode() for i in range(50))
    assert seg.with_name(seg.name + ".orphan").exists() and not seg.exists()


def test_half_written_segment_is_discarded_and_its_entries_replayed(tmp_path: Path) -> None:
    r = run_worker(tmp_path, "exit-after-acks", 20)
    assert r.returncode == 0
    segs = tmp_path / "p" / "segments"
    segs.mkdir(exist_ok=True)
    (segs / "01J00000000000000000000000.batch.tmp").write_bytes(b"partial")
    (segs / "01J00000000000000000000000.batch.json").write_bytes(b"{}")
    with Stage(tmp_path, "p", cfg()) as st:
        got = records_of(st.sealed_segments())
    assert sorted(got) == sorted(f"rec-{i}".encode() for i in range(20))
    assert not (segs / "01J00000000000000000000000.batch.tmp").exists()
    assert not (segs / "01J00000000000000000000000.batch.json").exists()


def test_I8_disk_cap_backpressure_then_release_unblocks(tmp_path: Path) -> None:
    """I8: at the staging disk budget the default is backpressure."""
    c = cfg(size_cap=6000, backpressure_timeout=timedelta(milliseconds=50))
    with Stage(tmp_path, "p", c) as st:
        with pytest.raises(BackpressureError):
            for _ in range(100):
                st.append_records([b"z" * 200]).result(timeout=5)
        assert st.stats.backpressure_waits > 0
        assert st.disk_bytes() <= 6000 + 400
        for seg in st.sealed_segments():
            st.release(seg)
        st.append_records([b"after"]).result(timeout=5)


def test_I8_drop_oldest_counts_every_drop(tmp_path: Path) -> None:
    c = cfg(size_cap=6000, size_cap_policy="drop_oldest", backpressure_timeout=timedelta(seconds=5))
    with Stage(tmp_path, "p", c) as st:
        for _ in range(60):
            st.append_records([b"z" * 200]).result(timeout=5)
        assert st.stats.dropped_segments > 0
        st.seal_all()  # then list: a timer seal may land between two snapshots
        kept = records_of(st.sealed_segments())
        assert len(kept) + st.stats.dropped_records == 60


def test_I8_open_segment_memory_cap_forces_early_seals(tmp_path: Path) -> None:
    c = cfg(
        segment=SegmentConfig(
            target_size=1 << 30, max_open_bytes=5000, max_open_duration=timedelta(seconds=60)
        )
    )
    with Stage(tmp_path, "p", c) as st:
        for _ in range(50):
            st.append_records([b"q" * 500]).result(timeout=5)
        assert len(st.sealed_segments()) >= 4
        st.seal_all()
        assert len(records_of(st.sealed_segments())) == 50


def test_I8_wal_full_is_relieved_by_sealing(tmp_path: Path) -> None:
    c = cfg(wal=WalConfig(flush_interval=timedelta(0), rotation_target=2000, max_size=6000))
    with Stage(tmp_path, "p", c) as st:
        for _ in range(100):
            st.append_records([b"w" * 300]).result(timeout=5)
        st.seal_all()
        assert len(records_of(st.sealed_segments())) == 100
        wal_bytes = sum(
            p.stat().st_size
            for p in (st.path / "wal").glob("quiver.wal*")
            if not p.name.endswith("cursor")
        )
        assert wal_bytes <= 6000  # I8: the WAL never outgrew max_size


def _kill_mid_append(d: Path, min_acks: int) -> set[int]:
    p = subprocess.Popen(
        [sys.executable, "-m", "tests.stage.stage_worker", str(d), "loop"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None
    acked: set[int] = set()
    for line in p.stdout:
        acked.add(int(line))
        if len(acked) >= min_acks:
            break
    os.kill(p.pid, 9)
    p.wait(timeout=30)
    # acks already written to the pipe before the kill count too
    acked |= {int(x) for x in p.stdout.read().split()}
    return acked


def _check_recovery(d: Path, acked: set[int]) -> None:
    with Stage(d, "p", cfg()) as st:
        got = records_of(st.sealed_segments())
    assert len(got) == len(set(got)), "duplicate after recovery"
    ids = {int(r.decode().split("-")[1]) for r in got}
    missing = acked - ids
    assert not missing, f"acked but lost: {sorted(missing)[:10]}"


def test_I1_sigkill_mid_append_loses_no_acked_entry(tmp_path: Path) -> None:
    """I1 with a real SIGKILL while appends are in flight."""
    _check_recovery(tmp_path, _kill_mid_append(tmp_path, 2000))


@pytest.mark.slow
def test_I1_sigkill_loop_repeated_crashes_and_recoveries(tmp_path: Path) -> None:
    acked: set[int] = set()
    for round_ in range(8):
        d = tmp_path / str(round_)
        acked = _kill_mid_append(d, 500 + 700 * round_)
        _check_recovery(d, acked)


def test_concurrent_appenders_keep_sequence_wal_and_segment_order_aligned(
    tmp_path: Path,
) -> None:
    """I3: one producer's data stays in its order (sequence = WAL order = batch order)."""
    import threading

    c = cfg(wal=WalConfig(flush_interval=timedelta(0)))
    with Stage(tmp_path, "p", c) as st:
        acks: list[tuple[int, int, bytes]] = []
        lock = threading.Lock()

        def worker(k: int) -> None:
            for i in range(40):
                rec = f"{k}-{i}".encode()
                a = st.append_records([rec]).result(timeout=5)
                assert a.wal_start is not None
                with lock:
                    acks.append((a.sequence, a.wal_start, rec))

        ts = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        acks.sort()
        assert [s for s, _, _ in acks] == list(range(240))
        assert [w for _, w, _ in acks] == sorted(w for _, w, _ in acks)
        assert records_of(st.seal_all()) == [r for _, _, r in acks]


def test_regression_seal_and_release_threads_race_on_the_sequence_sidecar(tmp_path: Path) -> None:
    """Found by the kill -9 harness: the sealer and the exporter's release() both wrote
    ``sequence`` through one temp name, and one rename failed with ENOENT, failing the
    stage.  Writers are serialised now (SequenceFile, which both call)."""
    import threading

    from tieredbuf.format.cursor import decode_sequence
    from tieredbuf.stage.filesystem import FileSystem
    from tieredbuf.stage.stage_state import SequenceFile, StageState

    state = StageState(StageConfig(), tmp_path / "stage", FileSystem())
    state.next_seq = 7
    sequence = SequenceFile(state)
    start = threading.Barrier(8)
    errors: list[BaseException] = []

    def hammer() -> None:
        start.wait()
        try:
            for _ in range(100):
                sequence.write()
        except BaseException as e:  # pragma: no cover - the bug
            errors.append(e)

    threads = [threading.Thread(target=hammer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert decode_sequence(sequence.path.read_bytes(), "sequence") == 7


_UNSEALED_CHILD = """
import os, sys
from datetime import timedelta
from tieredbuf.config import SegmentConfig, StageConfig, WalConfig
from tieredbuf.stage.stage import Stage
cfg = StageConfig(wal=WalConfig(rotation_target=1 << 20),
                  segment=SegmentConfig(target_size=1 << 30, max_open_bytes=1 << 30,
                                        max_open_duration=timedelta(hours=1)))
st = Stage(sys.argv[1], "p", cfg)
futs = [st.append_records([b"%05d-%04d" % (i, j) + bytes(1014) for j in range(100)])
        for i in range(50)]
for f in futs:
    f.result()                     # every record LOCAL-acked (fdatasynced)
print("ready", flush=True)
sys.stdin.read()                   # wait to be killed
"""


def test_I1_regression_replay_seal_must_not_purge_unread_wal_files(tmp_path: Path) -> None:
    """Found by bench/stage.py: a seal during replay moved the WAL cursor to the end of
    the whole WAL (the entries map then held only what was replayed so far), so the
    rotated files not yet read were purged: the reopen failed, and the next one kept
    1,100 of 5,000 acked records."""
    import signal

    p = subprocess.Popen(
        [sys.executable, "-c", _UNSEALED_CHILD, str(tmp_path)],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
    assert len(list((tmp_path / "p" / "wal").glob("quiver.wal.*"))) >= 3  # rotated files
    small = StageConfig(
        segment=SegmentConfig(
            target_size=1 << 20, max_open_bytes=1 << 30, max_open_duration=timedelta(hours=1)
        )
    )
    with Stage(tmp_path, "p", small) as st:  # seals every ~1 MiB while replaying
        assert len(st.sealed_segments()) > 2
        got = records_of(st.sealed_segments())
    assert len(got) == 5000 and len(set(got)) == 5000
    with Stage(tmp_path, "p", small) as st:  # and nothing is replayed twice
        assert len(records_of(st.sealed_segments())) == 5000


@pytest.mark.slow
def test_I8_producers_waiting_at_the_memory_cap_do_not_wake_each_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: every waiter at a cap used to notify_all on each wake-up, so waiting
    producers woke each other in a loop (33 k wake-ups a second) and starved the sealer."""
    import threading
    import time

    from tieredbuf.stage.segments import PreparedSegment, SegmentDir

    real = SegmentDir.prepare

    def slow_prepare(
        self: SegmentDir, acc: object, ulid: object = None, written: object = None
    ) -> PreparedSegment:
        time.sleep(0.3)  # a slow disk under the sealer, not a synchronisation
        return real(self, acc, ulid, written)  # type: ignore[arg-type]

    monkeypatch.setattr(SegmentDir, "prepare", slow_prepare)
    c = cfg(
        segment=SegmentConfig(
            target_size=20_000, max_open_bytes=60_000, max_open_duration=timedelta(seconds=60)
        )
    )
    with Stage(tmp_path, "p", c) as st:

        def work() -> None:
            for _ in range(40):
                st.append_records([b"m" * 2000]).result(timeout=30)

        ts = [threading.Thread(target=work) for _ in range(3)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert st.stats.backpressure_waits < 200
        st.seal_all()
        assert len(records_of(st.sealed_segments())) == 120


def test_overlapping_seals_commit_in_sequence_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two sealer threads write segments concurrently; a later segment that finishes
    writing first still commits after the earlier one (the exporter relies on order)."""
    import threading

    from tieredbuf.stage.segments import PreparedSegment, SegmentDir

    real_prepare, real_commit = SegmentDir.prepare, SegmentDir.commit
    committed: list[SealedSegment] = []
    first = threading.Event()
    later_written = threading.Event()

    def prepare(
        self: SegmentDir, acc: object, ulid: object = None, written: object = None
    ) -> PreparedSegment:
        if not first.is_set():
            first.set()
            # the first segment finishes writing only after a later one has
            assert later_written.wait(timeout=30), "seals did not overlap"
            return real_prepare(self, acc, ulid, written)  # type: ignore[arg-type]
        prep = real_prepare(self, acc, ulid, written)  # type: ignore[arg-type]
        later_written.set()
        return prep

    def commit(self: SegmentDir, prep: PreparedSegment) -> SealedSegment:
        committed.append(real_commit(self, prep))
        return committed[-1]

    monkeypatch.setattr(SegmentDir, "prepare", prepare)
    monkeypatch.setattr(SegmentDir, "commit", commit)
    c = cfg(segment=SegmentConfig(target_size=5000, max_open_duration=timedelta(seconds=60)))
    with Stage(tmp_path, "p", c) as st:
        for i in range(30):
            st.append_records([b"%04d" % i + b"o" * 996]).result(timeout=10)
        st.seal_all()
        assert len(committed) >= 3
        firsts = [s.first_sequence for s in committed]
        assert firsts == sorted(firsts)
        assert [s.ulid for s in committed] == sorted(s.ulid for s in committed)
        assert [s.ulid for s in st.sealed_segments()] == [s.ulid for s in committed]
        assert [r[:4] for r in records_of(st.sealed_segments())] == [b"%04d" % i for i in range(30)]


def test_a_failed_seal_stops_later_seals_from_committing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If segment N cannot be written, N + 1 (written concurrently) must not commit:
    its entries would be exported before N's, which the WAL still holds (I3).  The
    stage then seals everything after the cursor again from the WAL, in order."""
    import threading
    import time

    from tieredbuf.errors import DiskFullError
    from tieredbuf.stage.segments import PreparedSegment, SegmentDir

    real_prepare = SegmentDir.prepare
    first = threading.Event()
    later_written = threading.Event()
    failed = threading.Event()

    def prepare(
        self: SegmentDir, acc: object, ulid: object = None, written: object = None
    ) -> PreparedSegment:
        if not first.is_set():
            first.set()
            # fail only once a later segment has been written, ready to commit
            later_written.wait(timeout=60)
            failed.set()
            raise OSError(28, "No space left on device")
        prep = real_prepare(self, acc, ulid, written)  # type: ignore[arg-type]
        later_written.set()
        return prep

    monkeypatch.setattr(SegmentDir, "prepare", prepare)
    c = cfg(segment=SegmentConfig(target_size=5000, max_open_duration=timedelta(seconds=60)))
    st = Stage(tmp_path, "p", c)
    acked: list[bytes] = []
    for i in range(12):
        rec = b"%04d" % i + b"f" * 996
        try:
            st.append_records([rec]).result(timeout=10)
        except DiskFullError:  # refused while the stage re-seals
            continue
        acked.append(rec)
    assert failed.wait(timeout=60)
    assert later_written.is_set(), "a later segment was written while the first failed"
    deadline = time.monotonic() + 60
    while True:  # the stage re-seals from the WAL on its own; then appends work again
        try:
            st.append_records([b"late"]).result(timeout=10)
            break
        except DiskFullError:
            assert time.monotonic() < deadline, "appends never worked again"
            time.sleep(0.01)
    st.seal_all()
    segs = sorted(st.sealed_segments(), key=lambda x: x.ulid)
    assert [s.sequences for s in segs] == sorted(s.sequences for s in segs)
    replayed = records_of(segs)
    assert replayed == [*acked, b"late"]  # every acked entry once, in order
    st.close()
    assert not list((tmp_path / "p" / "segments").glob("*.tmp"))


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_segment_reuses_the_wal_record_block_byte_for_byte(
    tmp_path: Path, compression: str
) -> None:
    """A sealed .batch is the RFC 0001 batch of the staged records whether each call's
    records came as the WAL body's record block (many small records), as records (a few
    large ones), or none at all; item start indexes count every record."""
    from tieredbuf.config import Compression
    from tieredbuf.format.batch import encode_batch

    c = cfg(
        segment=SegmentConfig(
            max_open_duration=timedelta(seconds=60),
            records_compression=Compression[compression.upper()],
        )
    )
    calls: list[list[bytes]] = [
        [b"s%03d" % i for i in range(40)],
        [b"L" * 9000, b"M" * 7000],
        [],
        [b"t%d" % i * 50 for i in range(20)],
    ]
    with Stage(tmp_path, "p", c) as st:
        for i, recs in enumerate(calls):
            st.append_records(recs, b"meta%d" % i).result(timeout=5)
        (seg,) = st.seal_all()
        flat = [r for recs in calls for r in recs]
        assert records_of([seg]) == flat
        assert [i.start_index for i in seg.items] == [0, 40, 42, 42]
        assert seg.record_count == len(flat)
        if compression == "none":
            assert seg.path.read_bytes() == encode_batch(flat)


def test_sequence_sidecar_is_written_before_a_release_not_at_each_seal(tmp_path: Path) -> None:
    """Seals leave the sequence sidecar alone (the segment's sidecar holds its
    sequences); the first release persists the next sequence, later releases of
    segments below it skip the write; a reopen never goes backwards (Quiver #4024)."""
    seq_file = tmp_path / "p" / "sequence"
    with Stage(tmp_path, "p", cfg()) as st:
        opened = seq_file.read_bytes()
        futs = [st.append_records([b"a"]) for _ in range(3)]
        first = st.seal_all()
        futs += [st.append_records([b"b"]) for _ in range(2)]
        second = st.seal_all()
        for f in futs:
            f.result(timeout=5)
        assert seq_file.read_bytes() == opened, "a seal wrote the sequence sidecar"
        st.release(first[0])
        persisted = seq_file.read_bytes()
        assert persisted != opened
        before = seq_file.stat().st_mtime_ns
        st.release(second[0])  # 3..4 < the persisted 5: no write
        assert seq_file.stat().st_mtime_ns == before
    with Stage(tmp_path, "p", cfg()) as st:
        f = st.append_records([b"c"])
        st.seal_all()
        assert f.result(timeout=5).sequence == 5


def test_segment_write_back_waits_while_a_wal_sync_round_runs(tmp_path: Path) -> None:
    """IoGate: a sealer's write-back step starts only when no WAL round is running
    (and after ``max_wait`` at most), so a LOCAL ack does not queue behind it."""
    import os
    import threading

    from tieredbuf.stage import filesystem

    if not filesystem.FileSystem().can_write_back:
        pytest.skip("no sync_file_range here: write-back is the fdatasync alone")
    gate = filesystem.IoGate()
    fd = os.open(tmp_path / "seg", os.O_WRONLY | os.O_CREAT, 0o640)
    try:
        os.write(fd, b"x" * 10_000)
        done = threading.Event()
        t = threading.Thread(target=lambda: (gate.write_back(fd, 10_000), done.set()))
        with gate.wal_round():
            t.start()
            assert not done.wait(0.1), "write-back ran during a WAL round"
        assert done.wait(5)
        t.join()
    finally:
        os.close(fd)


def test_released_segment_files_are_recycled_and_never_read_as_segments(tmp_path: Path) -> None:
    """A released segment becomes a spare (``free.<K>``) that the next seal overwrites
    and truncates to its own size; spares count as disk bytes, are dropped at close,
    and a crash leaves nothing of them that load() would read as a segment."""
    from tieredbuf.stage.filesystem import FileSystem
    from tieredbuf.stage.segments import SPARE_PREFIX

    class LockFs(FileSystem):
        lock_fd: int | None = None

        def lock(self, path: Path) -> int:
            self.lock_fd = super().lock(path)
            return self.lock_fd

    segs = tmp_path / "p" / "segments"
    fs = LockFs()
    st = Stage(tmp_path, "p", cfg(), fs=fs)
    st.append_records([b"L" * 5000 for _ in range(20)]).result(timeout=5)
    big = st.seal_all()[0]
    st.release(big)
    spares = [p for p in segs.iterdir() if p.name.startswith(SPARE_PREFIX)]
    assert [p.stat().st_size for p in spares] == [big.size]
    assert st.disk_bytes() >= big.size  # a spare is disk the size cap sees
    st.append_records([b"s1", b"s2"], b"m").result(timeout=5)
    small = st.seal_all()[0]
    assert not [p for p in segs.iterdir() if p.name.startswith(SPARE_PREFIX)], "not reused"
    assert small.size < big.size and small.path.stat().st_size == small.size
    assert records_of([small]) == [b"s1", b"s2"]
    st.release(small)
    # a crash now (its lock goes with the process): the spare is left behind, and a
    # reopen deletes it
    assert fs.lock_fd is not None
    os.close(fs.lock_fd)
    assert [p for p in segs.iterdir() if p.name.startswith(SPARE_PREFIX)]
    with Stage(tmp_path, "p", cfg()) as again:
        assert again.sealed_segments() == []
        assert not [p for p in segs.iterdir() if p.name.startswith(SPARE_PREFIX)]
        again.append_records([b"x"]).result(timeout=5)
        again.release(again.seal_all()[0])
    assert not [p for p in segs.iterdir() if p.name.startswith(SPARE_PREFIX)], "kept at close"
