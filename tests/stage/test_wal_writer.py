"""The WAL writer on real files with real fdatasync: group commit, rotation, purge,
cursor sidecar, and recovery (torn tail, mid-file CRC error, bad header, sidecar
missing / corrupt / past the end / stale tmp).  I1 and I8 are named where they apply."""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

from tieredbuf.config import WalConfig
from tieredbuf.errors import ConfigHashMismatchError, CorruptError, WalFullError
from tieredbuf.format import cursor as cursor_fmt
from tieredbuf.format import wal as wal_fmt
from tieredbuf.stage.filesystem import FileSystem
from tieredbuf.stage.wal import ACTIVE_NAME, CURSOR_NAME, NEW_NAME, WalWriter
from tieredbuf.stage.wal_rotation import WalRotation

CFG = b"\x07" * 16


def _entry(seq: int, payload: bytes = b"x" * 10) -> list[bytes | memoryview]:
    return wal_fmt.encode_records_entry(seq, 1, [payload], b"m")


def _open(d: Path, **kw: object) -> WalWriter:
    return WalWriter(d, CFG, WalConfig(**kw))  # type: ignore[arg-type]


def _seqs(w: WalWriter, frm: int | None = None) -> list[int]:
    return [e.sequence for e, _, _ in w.replay(frm)]


def test_fresh_wal_has_header_and_cursor(tmp_path: Path) -> None:
    w = _open(tmp_path)
    assert w.recovery.cursor_status == "missing"
    w.close()
    assert (tmp_path / ACTIVE_NAME).read_bytes() == wal_fmt.encode_header(CFG, 0)
    assert cursor_fmt.decode_cursor((tmp_path / CURSOR_NAME).read_bytes()) == 0


@pytest.mark.parametrize("interval_ms", [0, 25])
def test_I1_append_ack_completes_after_fdatasync_and_survives_reopen(
    tmp_path: Path, interval_ms: int
) -> None:
    """I1: an acked append is on disk."""
    w = _open(tmp_path, flush_interval=timedelta(milliseconds=interval_ms))
    acks = [w.append(_entry(i)) for i in range(20)]
    for a in acks:
        assert a.durable.result(timeout=5) == a.end
    assert w.durable_end == acks[-1].end
    assert [a.start for a in acks[1:]] == [a.end for a in acks[:-1]]
    w.close()
    w2 = _open(tmp_path)
    assert _seqs(w2) == list(range(20))
    assert w2.end == acks[-1].end
    w2.close()


def test_flush_interval_zero_returns_done_and_concurrent_appenders_share_syncs(
    tmp_path: Path,
) -> None:
    """Group commit with flush_interval=0: the first appender's fdatasync is held until
    the seven others have written their entries and are waiting; the second sync then
    covers all seven.  Exactly two fdatasyncs for eight appends, every append durable
    when it returns."""
    calls: list[int] = []
    syncing = threading.Event()
    box: list[WalWriter] = []
    entry = b"".join(_entry(0))

    class CountingFs(FileSystem):
        def fdatasync(self, fd: int) -> None:  # type: ignore[override]
            if not box:  # the WAL's own syncs while it opens
                os.fdatasync(fd)
                return
            w = box[0]
            calls.append(w.end)  # what the sync covers, at most: every byte written so far
            if len(calls) == 1:  # hold the first sync until the 7 others have written
                syncing.set()
                deadline = time.monotonic() + 30
                while w.end < base + 8 * len(entry):
                    assert time.monotonic() < deadline, "the other appenders never wrote"
                    time.sleep(0.001)  # polling the writer's end offset against a deadline
            os.fdatasync(fd)

    w = WalWriter(tmp_path, CFG, WalConfig(flush_interval=timedelta(0)), fs=CountingFs())
    box.append(w)
    base = w.end
    results: list[bool] = []

    def worker(k: int) -> None:
        if k:  # append only once appender 0's sync (covering its entry alone) runs
            assert syncing.wait(30)
        a = w.append(_entry(k))
        results.append(a.durable.done() and a.durable.result() == a.end)

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert results == [True] * 8
    assert len(calls) == 2, f"{len(calls)} fdatasyncs for 8 concurrent appends: {calls}"
    assert w.fsyncs == 2 and w.durable_end == base + 8 * len(entry)
    w.close()
    assert sorted(_seqs(_open(tmp_path))) == list(range(8))


def test_rotation_keeps_positions_stable_and_purge_deletes_covered_files(tmp_path: Path) -> None:
    w = _open(tmp_path, rotation_target=200)
    acks = [w.append(_entry(i)) for i in range(30)]
    assert w.file_count() > 2
    rotated = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("quiver.wal."))
    assert any(n[len("quiver.wal.") :].isdigit() for n in rotated)
    w.advance_cursor(acks[20].start)
    assert _seqs(w) == list(range(20, 30))
    remaining = [p for p in tmp_path.iterdir() if p.name[len("quiver.wal.") :].isdigit()]
    for p in remaining:  # every kept rotated file still holds data at/after the cursor
        h = wal_fmt.decode_header(p.read_bytes()[:38])
        assert h.wal_position_start + p.stat().st_size - 38 > acks[20].start
    w.close()
    w2 = _open(tmp_path, rotation_target=200)
    assert w2.cursor == acks[20].start
    assert _seqs(w2) == list(range(20, 30))
    assert [e.sequence for e, s, _ in w2.replay(acks[25].start)] == list(range(25, 30))
    w2.close()


def test_I8_max_size_is_a_cap_until_the_cursor_advances(tmp_path: Path) -> None:
    """I8: the WAL footprint stays under max_size."""
    w = _open(tmp_path, rotation_target=300, max_size=1000)
    acks = []
    with pytest.raises(WalFullError):
        for i in range(100):
            acks.append(w.append(_entry(i)))
    assert w.disk_bytes() <= 1000
    w.advance_cursor(acks[-1].end)
    for i in range(10):
        w.append(_entry(1000 + i))
    assert w.disk_bytes() <= 1000
    w.close()


def test_max_rotated_files_trips_wal_full(tmp_path: Path) -> None:
    w = _open(tmp_path, rotation_target=100, max_rotated_files=3)
    with pytest.raises(WalFullError, match="files"):
        for i in range(100):
            w.append(_entry(i))
    assert w.file_count() == 3
    w.close()


def test_torn_tail_is_truncated_to_the_last_good_entry(tmp_path: Path) -> None:
    w = _open(tmp_path)
    acks = [w.append(_entry(i)) for i in range(5)]
    w.close()
    p = tmp_path / ACTIVE_NAME
    good = p.stat().st_size
    with p.open("ab") as f:
        f.write(b"".join(_entry(99))[:-9])  # half an entry: crash mid-append
    w2 = _open(tmp_path)
    assert w2.recovery.torn_bytes > 0
    assert p.stat().st_size == good
    assert _seqs(w2) == list(range(5))
    a = w2.append(_entry(5))
    assert a.start == acks[-1].end
    w2.close()


def test_I7_crc_error_mid_file_refuses_to_open_naming_file_and_offset(tmp_path: Path) -> None:
    w = _open(tmp_path)
    acks = [w.append(_entry(i)) for i in range(5)]
    w.close()
    p = tmp_path / ACTIVE_NAME
    data = bytearray(p.read_bytes())
    off = 38 + (acks[2].start - acks[0].start)
    data[off + 12] ^= 0x10
    p.write_bytes(bytes(data))
    with pytest.raises(CorruptError) as ei:
        _open(tmp_path)
    assert ei.value.obj == str(p) and ei.value.offset == off
    w2 = _open(tmp_path, corrupt_policy="truncate")  # Quiver's behaviour, opt-in
    assert _seqs(w2) == [0, 1]
    assert w2.recovery.corrupt_bytes > 0
    w2.close()


def test_I7_bad_magic_version_and_config_hash_are_typed(tmp_path: Path) -> None:
    _open(tmp_path).close()
    p = tmp_path / ACTIVE_NAME
    with pytest.raises(ConfigHashMismatchError):
        WalWriter(tmp_path, b"\x08" * 16, WalConfig())
    data = bytearray(p.read_bytes())
    data[0] = ord("X")
    p.write_bytes(bytes(data))
    with pytest.raises(CorruptError, match="magic"):
        _open(tmp_path)


@pytest.mark.parametrize("damage", ["missing", "corrupt", "stale_tmp"])
def test_cursor_sidecar_missing_or_corrupt_falls_back_to_the_oldest_file(
    tmp_path: Path, damage: str
) -> None:
    w = _open(tmp_path)
    acks = [w.append(_entry(i)) for i in range(4)]
    w.advance_cursor(acks[2].start)
    w.close()
    c = tmp_path / CURSOR_NAME
    if damage == "missing":
        c.unlink()
    elif damage == "corrupt":
        c.write_bytes(b"QUIVER\x00T" + bytes(16))
    else:  # crash between writing the tmp and the rename: the live sidecar stands
        (tmp_path / (CURSOR_NAME + ".tmp")).write_bytes(cursor_fmt.encode_cursor(0))
    w2 = _open(tmp_path)
    if damage == "stale_tmp":
        assert (w2.recovery.cursor_status, w2.cursor) == ("ok", acks[2].start)
        assert not (tmp_path / (CURSOR_NAME + ".tmp")).exists()
    else:
        assert (w2.recovery.cursor_status, w2.cursor) == (damage, 0)
        assert _seqs(w2) == [0, 1, 2, 3]
    w2.close()


def test_cursor_past_the_end_is_clamped(tmp_path: Path) -> None:
    w = _open(tmp_path)
    acks = [w.append(_entry(i)) for i in range(3)]
    w.close()
    (tmp_path / CURSOR_NAME).write_bytes(cursor_fmt.encode_cursor(10**9))
    w2 = _open(tmp_path)
    assert (w2.recovery.cursor_status, w2.cursor) == ("past_end", acks[-1].end)
    assert _seqs(w2) == []
    a = w2.append(_entry(3))
    assert a.start == acks[-1].end  # new entries land at or after the cursor
    w2.close()


def test_crash_between_rotation_rename_and_new_active_file(tmp_path: Path) -> None:
    w = _open(tmp_path)
    acks = [w.append(_entry(i)) for i in range(3)]
    w.close()
    os.rename(tmp_path / ACTIVE_NAME, tmp_path / f"{ACTIVE_NAME}.1")
    w2 = _open(tmp_path)
    assert _seqs(w2) == [0, 1, 2]
    assert w2.append(_entry(3)).start == acks[-1].end
    w2.close()
    assert (
        wal_fmt.decode_header((tmp_path / ACTIVE_NAME).read_bytes()[:38]).wal_position_start
        == acks[-1].end
    )


def test_missing_middle_file_is_corrupt(tmp_path: Path) -> None:
    w = _open(tmp_path, rotation_target=100)
    for i in range(10):
        w.append(_entry(i))
    w.close()
    rotated = sorted(
        int(p.name.rsplit(".", 1)[1])
        for p in tmp_path.iterdir()
        if p.name.rsplit(".", 1)[1].isdigit()
    )
    assert len(rotated) >= 2
    (tmp_path / f"{ACTIVE_NAME}.{rotated[1]}").unlink()
    with pytest.raises(CorruptError, match="missing"):
        _open(tmp_path, rotation_target=100)


def test_recovery_reports_the_highest_sequence_in_any_file(tmp_path: Path) -> None:
    w = _open(tmp_path, rotation_target=100)
    acks = [w.append(_entry(i)) for i in range(10)]
    w.advance_cursor(acks[-1].end)
    w.close()
    w2 = _open(tmp_path, rotation_target=100)
    assert w2.recovery.max_sequence == 9  # the active file still holds the last entry
    w2.close()


def test_I1_rotation_syncs_outside_the_lock_and_acks_new_file_entries_only_after_commit(
    tmp_path: Path,
) -> None:
    """Rotation renames the old file and appends go on into ``quiver.wal.new``; a sync
    round commits it (fdatasyncs, rename to quiver.wal, directory fsync).  I1: no entry in
    the new file is acked before that, and a crash before it loses only unacked entries."""
    w = _open(tmp_path, rotation_target=100, flush_interval=timedelta(seconds=60))
    acks = [w.append(_entry(0))]
    acks[0].durable.result(timeout=5)  # the flusher's first round; the next is 60 s away
    acks += [w.append(_entry(i)) for i in range(1, 4)]  # 36 B each: rotation before the 4th
    assert (tmp_path / NEW_NAME).exists() and not (tmp_path / ACTIVE_NAME).exists()
    assert not any(a.durable.done() for a in acks[1:])
    crash = tmp_path.parent / "crash"
    crash.mkdir()
    for p in tmp_path.iterdir():  # the directory as a crash would leave it
        (crash / p.name).write_bytes(p.read_bytes())
    w.sync()
    assert [a.durable.result(timeout=5) for a in acks] == [a.end for a in acks]
    assert (tmp_path / ACTIVE_NAME).exists() and not (tmp_path / NEW_NAME).exists()
    w.close()
    w2 = _open(tmp_path)
    assert _seqs(w2) == [0, 1, 2, 3]
    w2.close()
    w3 = _open(crash)  # the unacked entry in quiver.wal.new is gone; the rest replay
    assert _seqs(w3) == [0, 1, 2]
    assert w3.append(_entry(9)).start == acks[2].end
    w3.close()
    assert not (crash / NEW_NAME).exists()


def test_rotations_in_quick_succession_commit_each_other(tmp_path: Path) -> None:
    """A file that fills before the flusher commits the previous rotation commits it
    inline; positions stay contiguous and every file is in place."""
    w = _open(tmp_path, rotation_target=60, flush_interval=timedelta(seconds=60))
    acks = [w.append(_entry(0))]
    acks[0].durable.result(timeout=5)
    acks += [w.append(_entry(i)) for i in range(1, 12)]
    assert w.file_count() >= 5
    w.sync()
    assert all(a.durable.result(timeout=5) == a.end for a in acks)
    w.close()
    w2 = _open(tmp_path)
    assert _seqs(w2) == list(range(12))
    assert w2.recovery.cursor_status == "ok" and w2.recovery.torn_bytes == 0
    w2.close()


def test_replay_reuses_recovery_scans_within_a_bound_and_never_serves_stale_ones(
    tmp_path: Path,
) -> None:
    """Recovery keeps its newest scans (up to 2 x rotation_target bytes) for replay(), so
    the files replayed first are decoded once; older files are read again, and an
    append before replay() drops the kept scans."""
    w = _open(tmp_path, rotation_target=150)
    acks = [w.append(_entry(i)) for i in range(12)]
    w.close()
    w2 = _open(tmp_path, rotation_target=150)
    assert 0 < sum(n for _, n in w2.kept_scans()) <= 300  # bounded
    assert len(w2.kept_scans()) < w2.file_count()  # the oldest file is read again
    assert [(e.sequence, s, t) for e, s, t in w2.replay()] == [
        (i, a.start, a.end) for i, a in enumerate(acks)
    ]
    assert not w2.kept_scans()
    assert _seqs(w2) == list(range(12))  # a second replay reads the files
    w2.close()
    w3 = _open(tmp_path, rotation_target=150)
    w3.append(_entry(12))
    assert _seqs(w3) == list(range(13))
    w3.close()


def test_rotation_round_acks_the_old_files_entries_before_committing_the_new_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rotation round makes three syncs; entries in the old file are durable after
    the first and are acked then, entries in the new file only after the rename and
    directory fsync.  Both survive a reopen."""
    w = _open(tmp_path, flush_interval=timedelta(0), rotation_target=4096)
    old = w.append(_entry(0, b"o" * 5000), wait=False)
    new = w.append(_entry(1), wait=False)  # rotates: ``old`` is in quiver.wal.1
    assert (tmp_path / NEW_NAME).exists()
    seen: list[tuple[bool, bool, bool]] = []
    real = WalRotation.commit

    def commit(self: WalRotation, rot: object, old_durable: object = None) -> None:
        def acked() -> None:
            assert callable(old_durable)
            old_durable()
            seen.append((old.durable.done(), new.durable.done(), (tmp_path / NEW_NAME).exists()))

        real(self, rot, acked)  # type: ignore[arg-type]

    monkeypatch.setattr(WalRotation, "commit", commit)
    w.sync()
    assert seen == [(True, False, True)]
    assert new.durable.result(timeout=5) == new.end
    w.close()
    w2 = _open(tmp_path)
    assert _seqs(w2) == [0, 1]
    w2.close()
