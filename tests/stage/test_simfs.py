"""The simulated file layer itself: a power cut keeps exactly what an fsync covered
(file data by the file's fsync/fdatasync, directory entries by the directory's fsync),
and the stage's compound helpers run on it unchanged.  The power-cut suite
(test_power_cut.py) is only as strict as this model, so the model is tested first."""

from __future__ import annotations

import errno
import os
import random
from pathlib import Path

import pytest

from tests.stage.simfs import PowerCut, SimFs

D = Path("/sim/d")


def _fresh() -> SimFs:
    fs = SimFs()
    fs.makedirs_durable(D)
    return fs


def _write(fs: SimFs, path: Path, data: bytes, sync: bool) -> None:
    fd = fs.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    fs.lseek(fd, 0, os.SEEK_END)
    fs.writev(fd, [data])
    if sync:
        fs.fdatasync(fd)
    fs.close(fd)


def test_unsynced_data_and_unsynced_names_are_gone_after_a_cut() -> None:
    fs = _fresh()
    _write(fs, D / "a", b"durable", sync=True)
    fs.fsync_dir(D)
    _write(fs, D / "a", b"+lost", sync=False)  # data after the last fdatasync
    _write(fs, D / "b", b"synced data, name never fsynced", sync=True)
    fs.cut()
    after = fs.reconstruct("drop")
    assert after.read_bytes(D / "a") == b"durable"
    assert not after.exists(D / "b"), "a file's fdatasync does not make its name durable"
    kept = fs.reconstruct("keep")
    assert kept.read_bytes(D / "a") == b"durable+lost" and kept.exists(D / "b")


def test_a_hard_link_shares_the_file_and_is_durable_after_its_directorys_fsync() -> None:
    """What the exporter's hard link into a local-directory store relies on: both names
    show one file (its link count says so), and the new name survives a cut only once
    the directory holding it was fsynced."""
    fs = _fresh()
    other = fs.makedirs_durable("/sim/store")
    _write(fs, D / "seg", b"sealed", sync=True)
    fs.fsync_dir(D)
    fs.link(D / "seg", other / "obj")
    assert fs.link_count(D / "seg") == fs.link_count(other / "obj") == 2
    assert fs.read_bytes(other / "obj") == b"sealed"
    with pytest.raises(FileExistsError):
        fs.link(D / "seg", other / "obj")
    fs.cut()
    assert fs.reconstruct("drop").listdir(other) == []
    kept = fs.reconstruct("keep")
    assert kept.read_bytes(other / "obj") == b"sealed" and kept.link_count(D / "seg") == 2

    fs = _fresh()
    other = fs.makedirs_durable("/sim/store")
    _write(fs, D / "seg", b"sealed", sync=True)
    fs.fsync_dir(D)
    fs.link(D / "seg", other / "obj")
    fs.fsync_dir(other)
    fs.unlink(D / "seg")
    assert fs.link_count(other / "obj") == 1
    fs.cut()
    after = fs.reconstruct("drop")  # the unlink was never made durable: both names
    assert after.read_bytes(other / "obj") == b"sealed" and after.link_count(D / "seg") == 2


def test_rename_and_unlink_are_durable_only_after_the_directory_fsync() -> None:
    fs = _fresh()
    _write(fs, D / "x.tmp", b"x", sync=True)
    _write(fs, D / "old", b"o", sync=True)
    fs.fsync_dir(D)
    fs.rename(D / "x.tmp", D / "x")
    fs.unlink(D / "old")
    fs.cut()
    drop = fs.reconstruct("drop")
    assert drop.listdir(D) == ["old", "x.tmp"]
    states = {tuple(fs.reconstruct("subset", random.Random(s)).listdir(D)) for s in range(40)}
    # each of the two operations kept or lost on its own: all four outcomes occur
    assert states == {("old", "x.tmp"), ("old", "x"), ("x.tmp",), ("x",)}


def test_write_atomic_survives_only_once_it_returned() -> None:
    fs = _fresh()
    fs.write_atomic(D / "c", [b"v1"])
    ops_v2 = fs.ops
    fs.write_atomic(D / "c", [b"v2"])
    ops_v2 = fs.ops - ops_v2
    for k in range(1, ops_v2 + 1):  # a cut before each operation of the second write
        f = _fresh()
        f.write_atomic(D / "c", [b"v1"])
        f.arm(k)
        with pytest.raises(PowerCut):
            f.write_atomic(D / "c", [b"v2"])
        for mode in ("drop", "keep", "subset"):
            got = f.reconstruct(mode, random.Random(k)).read_bytes(D / "c")
            assert got in (b"v1", b"v2")
    f = _fresh()
    f.write_atomic(D / "c", [b"v2"])
    f.cut()
    assert f.reconstruct("drop").read_bytes(D / "c") == b"v2"


def test_subset_mode_loses_tears_and_keeps_writes_independently() -> None:
    fs = _fresh()
    fd = fs.open(D / "w", os.O_WRONLY | os.O_CREAT, 0o644)
    fs.writev(fd, [b"A" * 100])
    fs.fdatasync(fd)
    fs.writev(fd, [b"B" * 1000])  # crosses the 512 and 1024 boundaries
    fs.writev(fd, [b"C" * 100])
    fs.fsync_dir(D)
    fs.cut()
    seen = set()
    for s in range(200):
        data = fs.reconstruct("subset", random.Random(s)).read_bytes(D / "w")
        assert data[:100] == b"A" * 100, "durable bytes always survive"
        seen.add((len(data), data.count(b"B"), data.count(b"C")))
    assert (100, 0, 0) in seen  # both lost
    assert (1200, 1000, 100) in seen  # both kept
    assert (1200, 0, 100) in seen  # the first lost, the later one kept: a zero hole
    assert any(0 < b < 1000 for _, b, _ in seen)  # torn at a sector boundary
    assert all(b in (0, 1000) or (100 + b) % 512 == 0 for _, b, _ in seen)


def test_sync_file_range_is_not_a_barrier() -> None:
    fs = _fresh()
    fd = fs.open(D / "s", os.O_WRONLY | os.O_CREAT, 0o644)
    fs.writev(fd, [b"x" * 4096])
    fs.write_back(fd, 0, 4096)
    fs.fsync_dir(D)
    fs.cut()
    assert fs.reconstruct("drop").read_bytes(D / "s") == b""


def test_after_a_cut_everything_fails_and_a_new_machine_starts_clean() -> None:
    fs = _fresh()
    fs.arm(2)
    fd = fs.open(D / "a", os.O_WRONLY | os.O_CREAT, 0o644)  # op 1: create
    with pytest.raises(PowerCut):
        fs.writev(fd, [b"2"])  # op 2: the power goes before it runs
    with pytest.raises(PowerCut):
        fs.listdir(D)
    after = fs.reconstruct("keep")
    assert after.listdir(D) == ["a"] and after.read_bytes(D / "a") == b""
    assert not after.dead


def test_injected_faults_and_capacity() -> None:
    fs = _fresh()
    fault = fs.fail("fdatasync", errno.EIO, path_contains="wal", times=1)
    fd = fs.open(D / "wal", os.O_WRONLY | os.O_CREAT, 0o644)
    fs.writev(fd, [b"x"])
    with pytest.raises(OSError) as e:
        fs.fdatasync(fd)
    assert e.value.errno == errno.EIO and fault.fired == 1
    fs.fdatasync(fd)  # times=1: the next one goes through
    small = _fresh()
    small.capacity = 10
    fd = small.open(D / "f", os.O_WRONLY | os.O_CREAT, 0o644)
    assert small.writev(fd, [b"x" * 25]) == 10  # a short write: what fits
    with pytest.raises(OSError) as e:
        small.writev(fd, [b"y"])
    assert e.value.errno == errno.ENOSPC
    small.close(fd)
    small.unlink(D / "f")
    assert small.used_bytes() == 0
