"""Disk faults (I1): ENOSPC and EIO on WAL writes, fdatasync, segment writes and
renames.  A caller whose data was not made durable gets a typed error (DiskFullError
or DiskIOError, with errno and path); nothing acknowledged is lost; appends work
again once the disk does; the stage reports the fault while it lasts (readiness).

A full disk is real here where the test can mount a small tmpfs (root); EIO, and
ENOSPC from an fdatasync or a rename, cannot be made on a real disk in this sandbox,
so those are injected at the stage's file-system seam (tests/stage/simfs.py) -- the
stage code above the seam is the real one.  After each fault the simulated machine's
power is cut and the stage recovered, so "nothing acknowledged is lost" is checked
against what an fsync made durable, not against the page cache.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from tests.stage.powercut import ROOT
from tests.stage.simfs import SimFs
from tieredbuf.config import SegmentConfig, StageConfig, WalConfig
from tieredbuf.errors import DiskError, DiskFullError, DiskIOError
from tieredbuf.format.batch import decode_batch
from tieredbuf.stage.stage import Stage

CFG = StageConfig(
    wal=WalConfig(flush_interval=timedelta(0), rotation_target=1500),
    segment=SegmentConfig(target_size=900, max_open_duration=timedelta(seconds=60)),
    backpressure_timeout=timedelta(seconds=5),
)


def _poll(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def _records(stage: Stage) -> list[bytes]:
    out: list[bytes] = []
    for seg in stage.sealed_segments():
        out += decode_batch(stage.read_segment(seg), str(seg.path))
    return out


class _Writer:
    """Appends ``rec-<i>`` one at a time and sorts every outcome."""

    def __init__(self, stage: Stage) -> None:
        self.stage = stage
        self.i = 0
        self.acked: list[bytes] = []
        self.typed: list[DiskError] = []

    def append(self) -> bool:
        rec = b"rec-%05d" % self.i + b"." * 60
        self.i += 1
        try:
            self.stage.append_records([rec]).result(timeout=10)
        except DiskError as e:  # the typed error; anything else fails the test
            self.typed.append(e)
            return False
        self.acked.append(rec)
        return True


def _check_after_power_cut(sim: SimFs, stage: Stage, acked: list[bytes]) -> None:
    """Cut the power (keep only what is durable), recover, check I1 and I2."""
    sim.cut()
    with contextlib.suppress(Exception):
        stage.close()
    again = Stage(ROOT, "p", CFG, fs=sim.reconstruct("drop"))
    try:
        found = Counter(_records(again))
    finally:
        again.close()
    assert not set(acked) - set(found), "I1: an acknowledged record was lost"
    assert all(n == 1 for n in found.values()), "I2: a record was recovered twice"


FAULTS = [
    # (operation, path part, errno): where the disk fails
    ("writev", "/wal/", errno.ENOSPC),
    ("writev", "/wal/", errno.EIO),
    ("fdatasync", "/wal/", errno.EIO),
    ("fdatasync", "/wal/", errno.ENOSPC),
    ("writev", "/segments/", errno.ENOSPC),
    ("fdatasync", "/segments/", errno.EIO),
    ("rename", "/segments/", errno.ENOSPC),
    ("rename", "/wal/quiver.wal", errno.EIO),
    ("fsync_dir", "/segments", errno.EIO),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("op", "where", "err"),
    FAULTS,
    ids=[f"{o}-{w.strip('/')}-{errno.errorcode[e]}" for o, w, e in FAULTS],
)
def test_I1_a_failing_disk_gives_typed_errors_loses_nothing_acked_and_recovers(
    op: str, where: str, err: int
) -> None:
    """Injected (see the module doc).  While the fault lasts, appends fail with the
    typed error of its errno and disk_fault() names it; once it clears, appends work
    again; after a power cut every acknowledged record is there, once."""
    sim = SimFs()
    sim.makedirs_durable(ROOT)
    st = Stage(ROOT, "p", CFG, fs=sim)
    w = _Writer(st)
    for _ in range(30):  # some rotations and seals before the fault
        assert w.append()
    fault = sim.fail(op, err, path_contains=where, times=None)
    # seals run on the stage's own threads: append until callers see the fault
    _poll(lambda: not w.append() and len(w.typed) >= 3)
    assert fault.fired
    cls = DiskFullError if err == errno.ENOSPC else DiskIOError
    assert all(isinstance(e, cls) and e.errno == err and e.path for e in w.typed), w.typed
    assert isinstance(st.disk_fault(), cls), "the stage does not report the failing disk"
    sim.heal()
    _poll(w.append)  # appends work again (the stage repairs / re-seals on its own)
    for _ in range(20):
        assert w.append()
    _poll(lambda: st.disk_fault() is None)
    st.seal_all()
    _check_after_power_cut(sim, st, w.acked)


def test_I1_a_failed_wal_fdatasync_is_never_retried_on_the_same_file() -> None:
    """fsyncgate: after a failed fdatasync the WAL never syncs that file's unsynced
    data again to ack it.  It cuts the file back to its last durable byte and writes
    the unacknowledged entries again into a new file; a transient fault is then
    invisible to callers (their acks wait for the new file's fdatasync)."""
    sim = SimFs()
    sim.makedirs_durable(ROOT)
    st = Stage(ROOT, "p", CFG, fs=sim)
    w = _Writer(st)
    for _ in range(3):
        assert w.append()
    sim.fail("fdatasync", errno.EIO, path_contains="/wal/quiver.wal", times=1)
    assert w.append(), "a single failed fdatasync should be repaired transparently"
    trace = list(sim.trace)
    i = next(n for n, x in enumerate(trace) if "FAULT fdatasync" in x)
    after = trace[i + 1 :]
    assert any("ftruncate" in x or "truncate" in x for x in after[:3]), after[:6]
    assert any("create" in x and "quiver.wal.new" in x for x in after), after
    renamed = next(x for x in after if "rename" in x and "quiver.wal ->" in x)
    assert "quiver.wal." in renamed.split("->")[1]  # the failed file became quiver.wal.N
    for _ in range(5):
        assert w.append()
    _check_after_power_cut(sim, st, w.acked)


def test_I1_appends_whose_wal_fdatasync_failed_get_the_error_not_an_ack() -> None:
    """Persistent EIO: the repair fails too, so the appends waiting for the failed
    fdatasync fail (DiskIOError) -- none is acknowledged -- and so does every append
    until the disk works."""
    sim = SimFs()
    sim.makedirs_durable(ROOT)
    st = Stage(ROOT, "p", CFG, fs=sim)
    w = _Writer(st)
    assert w.append()
    sim.fail("fdatasync", errno.EIO, times=None)
    assert not w.append() and not w.append()
    assert [type(e) for e in w.typed] == [DiskIOError, DiskIOError]
    assert len(w.acked) == 1
    sim.heal()
    assert w.append()
    _check_after_power_cut(sim, st, w.acked)


# --- a real full disk (tmpfs) -------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs: a file system that really fills up (needs root to mount)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here ({r.stderr.strip()}); the injected "
            "ENOSPC tests cover a full disk"
        )
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(path: Path) -> None:
    """Write zeros until the file system is full."""
    with open(path, "wb") as f:
        chunk = bytes(64 << 10)
        with contextlib.suppress(OSError):
            while True:
                f.write(chunk)
                f.flush()
        with contextlib.suppress(OSError):
            os.fsync(f.fileno())


@pytest.mark.slow
def test_I1_a_really_full_disk_gives_disk_full_errors_and_appends_resume_when_freed(
    small_disk: Path,
) -> None:
    """Real ENOSPC on a full tmpfs: appends fail with DiskFullError (errno ENOSPC, a
    path) and disk_fault() says so; after the filler is deleted they work again; a
    reopen finds every acknowledged record once."""
    stage_dir = small_disk / "stage"
    st = Stage(stage_dir, "p", CFG)
    w = _Writer(st)
    for _ in range(20):
        assert w.append()
    _fill(small_disk / "filler")
    for _ in range(400):
        if not w.append() and len(w.typed) >= 3:
            break
    assert w.typed, "the disk never filled up"
    assert all(
        isinstance(e, DiskFullError) and e.errno == errno.ENOSPC and e.path for e in w.typed
    ), w.typed
    assert isinstance(st.disk_fault(), DiskFullError)
    (small_disk / "filler").unlink()

    def healthy() -> bool:
        # an append clears the WAL's fault; a seal taken while the disk was full may
        # still fail after it (late, under load), and appends are then refused until
        # the stage has re-sealed from the WAL
        if not w.append():
            return False
        st.wait_committed()
        return st.disk_fault() is None

    _poll(healthy)
    for _ in range(20):
        assert w.append()
    _poll(lambda: st.disk_fault() is None)
    st.close()
    with Stage(stage_dir, "p", CFG) as again:
        found = Counter(_records(again))
    assert not set(w.acked) - set(found) and all(n == 1 for n in found.values())
