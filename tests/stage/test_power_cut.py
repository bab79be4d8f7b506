"""Power-loss tests (I1, I2, I3): the real stage and exporter on a simulated file layer
that, at a power cut, keeps only what a completed fsync/fdatasync covered
(tests/stage/simfs.py; the harness is tests/stage/powercut.py).

A SIGKILL (tests/test_crash.py) leaves the page cache behind, so it cannot tell an ack
that followed its fdatasync from one that did not; these tests can, and the broken
twins below prove it: a stage that acks before its fdatasync fails the same suite.

The quick run cuts the power a few dozen times; ``slow`` runs the full 200+ (CI runs
everything).  Every cut is seeded; a failure prints the seed, the cut and the last
operations before it (run ``run_cut(seed, ...)`` to reproduce it).
"""

from __future__ import annotations

import contextlib
import errno
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pyarrow as pa
import pytest

import tieredbuf
from tests.stage.powercut import FAST_RETRY, ROOT, CutResult, run_cut
from tests.stage.simfs import SimFs
from tieredbuf.config import SegmentConfig, StageConfig, WalConfig
from tieredbuf.errors import CorruptError, DiskError
from tieredbuf.format import wal as wal_fmt
from tieredbuf.format.batch import decode_batch
from tieredbuf.produce.exporter import Exporter
from tieredbuf.stage.stage import Stage
from tieredbuf.stage.wal import ACTIVE_NAME, NEW_NAME, WalWriter
from tieredbuf.stage.wal_state import resolve
from tieredbuf.stage.wal_sync import WalSync


def _poll(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.002)


def _queue(buf: tieredbuf.Buffer) -> list[bytes]:
    if not buf.exists():  # nothing was ever exported (a consumer never creates a buffer)
        return []
    c = buf.consumer()
    c.initialize()
    out: list[bytes] = []
    while (b := c.next_batch()) is not None:
        out += (
            b.entries
            if b.location.endswith(".batch")
            else [str(v).encode() for x in b.bundles() for v in x[0].column("id").to_pylist()]
        )
    c.close()
    return out


# --- regressions the power-cut suite found --------------------------------------------


def test_I2_a_released_segment_is_not_replayed_while_the_other_kind_holds_the_cursor() -> None:
    """The cursor stops at the first entry not yet in a sealed segment; an open bundle
    segment holds it before a records segment that was then exported.  Releasing that
    segment deleted its sidecar, so after a crash its entries (past the cursor, covered
    by no sidecar) were replayed -- together with a later entry, in a segment the
    manifest's watermark did not recognise -- and exported a second time."""
    sim = SimFs()
    sim.makedirs_durable(ROOT)
    cfg = StageConfig(
        wal=WalConfig(flush_interval=timedelta(0)),
        segment=SegmentConfig(target_size=2000, max_open_duration=timedelta(seconds=60)),
    )
    buf = tieredbuf.open(f"memory://pc-{uuid.uuid4().hex}")
    st = Stage(ROOT, "p", cfg, fs=sim)
    exp = Exporter(st, buf.store, buf.queue, retry=FAST_RETRY)
    st.append_bundle({0: pa.record_batch({"id": pa.array(["b0"])})}).result(timeout=5)
    st.append_records([b"r" * 3000]).result(timeout=5)  # a batch segment, sealed alone
    _poll(lambda: exp.stats.get("segments_exported") == 1)  # exported and released
    st.append_records([b"after"]).result(timeout=5)  # durable in the WAL, not sealed
    sim.cut()  # then the power goes (keep: as much as a SIGKILL would leave)
    exp.stop()
    with contextlib.suppress(Exception):
        st.close()
    disk = sim.reconstruct("keep")
    # restarted with a larger target, replay puts the released entry and the later one
    # in one segment (timer seals group entries differently too)
    cfg2 = StageConfig(wal=cfg.wal, segment=SegmentConfig(target_size=1 << 20))
    st2 = Stage(ROOT, "p", cfg2, fs=disk)
    exp2 = Exporter(st2, buf.store, buf.queue, retry=FAST_RETRY)
    st2.seal_all()
    exp2.drain(timeout=30)
    exp2.stop()
    st2.close()
    assert {r[:5]: n for r, n in Counter(_queue(buf)).items()} == {
        b"rrrrr": 1,
        b"b0": 1,
        b"after": 1,
    }


SYNC = StageConfig(
    wal=WalConfig(flush_interval=timedelta(0)),
    segment=SegmentConfig(max_open_duration=timedelta(seconds=60)),
)
WAL_CFG = b"\x07" * 16


def _entry(seq: int, n: int = 10) -> list[bytes | memoryview]:
    return wal_fmt.encode_records_entry(seq, 1, [b"x" * n], b"m")


def _wal(fs: SimFs, **kw: object) -> WalWriter:
    return WalWriter(ROOT / "wal", WAL_CFG, WalConfig(**kw), fs=fs)  # type: ignore[arg-type]


def _seqs(w: WalWriter) -> list[int]:
    return [e.sequence for e, _, _ in w.replay()]


def _abandon(w: WalWriter) -> None:
    with contextlib.suppress(Exception):
        w.close()


def test_I1_a_new_stage_directory_survives_a_power_cut() -> None:
    """The stage created ``<producer>/``, ``wal/`` and ``segments/`` without fsyncing
    their parents: a power cut could take the directories, and every acked entry in
    them, away."""
    sim = SimFs()
    sim.makedirs_durable(ROOT)
    _an_acked_entry_survives_a_cut(sim)


def _an_acked_entry_survives_a_cut(sim: SimFs) -> None:
    """Open the stage on ``sim``, ack one entry, cut the power: recovery (replay and
    seal) on the disk a reboot finds keeps it."""
    st = Stage(ROOT, "p", SYNC, fs=sim)
    st.append_records([b"acked"]).result(timeout=5)
    sim.cut()
    with contextlib.suppress(Exception):
        st.close()
    st2 = Stage(ROOT, "p", SYNC, fs=sim.reconstruct("drop"))
    (seg,) = st2.sealed_segments()  # recovery replays and seals
    assert decode_batch(st2.read_segment(seg)) == [b"acked"]
    st2.close()


def test_I1_a_stage_directory_whose_parent_fsync_failed_is_made_durable_on_reopen() -> None:
    """``<producer>/`` made, the fsync of its parent refused: the open fails, and the
    next open found the directory and trusted it, so a power cut could take it and
    every acked entry in it.  A directory makedirs finds but did not itself make
    durable has its parent fsynced once before it is used."""
    sim = SimFs()
    sim.makedirs_durable(ROOT)
    sim.fail("fsync_dir", errno.EIO, str(ROOT), times=1)
    with pytest.raises(OSError):
        Stage(ROOT, "p", SYNC, fs=sim)
    _an_acked_entry_survives_a_cut(sim)


def test_I1_a_rotation_never_leaves_the_old_wal_file_without_a_name() -> None:
    """Rotation renames the old file ``quiver.wal.N``, then the new one ``quiver.wal``,
    and fsynced the directory once, after both.  A power cut that keeps only the second
    rename leaves the old file -- acknowledged entries -- with no name."""
    sim = SimFs()
    sim.makedirs_durable(ROOT)
    w = _wal(sim, flush_interval=timedelta(0), rotation_target=200)
    sim.cut_after(lambda op: op.endswith(f"{NEW_NAME} -> {ACTIVE_NAME}") and w.file_count() > 1)
    acked = []
    with contextlib.suppress(Exception):
        for i in range(100):
            w.append(_entry(i))
            acked.append(i)
    assert sim.dead and acked
    _abandon(w)

    def only_the_new_name(where: str, op: tuple[object, ...]) -> bool | None:
        if op[0] == "rename":  # keep quiver.wal.new -> quiver.wal, lose quiver.wal -> .N
            return op[1] == NEW_NAME
        return None

    w2 = _wal(sim.reconstruct("subset", decide=only_the_new_name))
    assert set(acked) <= set(_seqs(w2))
    w2.close()


def test_I1_a_lost_write_before_a_kept_one_in_the_newest_wal_file_is_a_torn_tail() -> None:
    """After the newest file's last fdatasync a power cut may keep a later write and
    lose an earlier one (pages reach the disk in any order): zeros, then a whole frame.
    Recovery took that for mid-file corruption and refused to open (the acked entries
    before it were fine).  Nothing after the zeros was acknowledged."""
    sim = SimFs()
    sim.makedirs_durable(ROOT)
    w = _wal(sim, flush_interval=timedelta(0))
    w.append(_entry(0))  # acked: fdatasynced
    b = w.append(_entry(1), wait=False)  # written, never synced
    w.append(_entry(2), wait=False)
    sim.cut()
    _abandon(w)
    b_off = 38 + b.start  # the file offset of entry 1

    def lose_entry_1(where: str, op: tuple[object, ...]) -> bool | None:
        return not (op[0] == "write" and op[1] == b_off)

    w2 = _wal(sim.reconstruct("subset", decide=lose_entry_1))
    assert _seqs(w2) == [0] and w2.recovery.torn_bytes > 0
    w2.close()


def test_I1_a_purge_cut_short_by_a_power_cut_leaves_a_gap_recovery_accepts() -> None:
    """A purge renames the oldest purged file into a spare and unlinks the others, with
    one directory fsync for all.  A cut that keeps an unlink but loses the rename leaves
    ``quiver.wal.1`` and ``.3`` but no ``.2``; recovery took that for a missing file and
    refused to open, though all three lie behind the durable cursor."""
    sim = SimFs()
    sim.makedirs_durable(ROOT)
    w = _wal(sim, flush_interval=timedelta(0), rotation_target=150)
    seq = 0
    while w.file_count() < 5:
        w.append(_entry(seq))
        seq += 1
    end = w.end
    w.append(_entry(seq))  # after the cursor: must survive
    sim.cut_after(lambda op: "unlink" in op and op.endswith(".2"))
    with contextlib.suppress(DiskError):
        w.advance_cursor(end)
    assert sim.dead
    _abandon(w)

    def keep_unlinks_lose_renames(where: str, op: tuple[object, ...]) -> bool | None:
        if where.endswith("/wal") and op[0] in ("rename", "unlink"):
            return op[0] == "unlink"
        return None

    w2 = _wal(sim.reconstruct("subset", decide=keep_unlinks_lose_renames))
    assert _seqs(w2) == [seq]
    w2.close()


def test_I7_only_never_written_bytes_make_a_torn_tail(tmp_path: Path) -> None:
    """On real files: in the newest WAL file, a frame that is zero from a sector
    boundary to its end (a write torn at the sector) followed by a whole frame is a
    torn tail; a flipped bit at the same place is corruption, and still refuses."""
    w = WalWriter(tmp_path, WAL_CFG, WalConfig(flush_interval=timedelta(0)))
    acks = [w.append(_entry(i, n=900 if i == 1 else 10)) for i in range(3)]
    w.close()
    p = tmp_path / ACTIVE_NAME
    good = p.read_bytes()
    start, end = 38 + acks[1].start, 38 + acks[1].end
    boundary = (start // 512 + 1) * 512
    assert start < boundary < end
    torn = good[:boundary] + bytes(end - boundary) + good[end:]
    p.write_bytes(torn)
    w = WalWriter(tmp_path, WAL_CFG, WalConfig())
    assert [e.sequence for e, _, _ in w.replay()] == [0] and w.recovery.torn_bytes > 0
    w.close()
    flipped = bytearray(good)
    flipped[boundary + 5] ^= 0x01
    p.write_bytes(bytes(flipped))
    with pytest.raises(CorruptError):
        WalWriter(tmp_path, WAL_CFG, WalConfig())


# --- the suite: seeded random power cuts ------------------------------------------


def _suite(
    seeds: range, export: bool, tmp_path: Path | None = None, faults: int = 0, link: bool = False
) -> list[CutResult]:
    out = []
    for seed in seeds:
        real = (
            tmp_path / f"real-{seed}"
            if tmp_path is not None and seed % 8 == 0 and not link
            else None
        )
        out.append(run_cut(seed, export=export, real_dir=real, faults=faults, link=link))
    return out


def _assert_survived(results: list[CutResult]) -> int:
    bad = [r for r in results if not r.ok()]
    assert not bad, "\n\n".join(r.report() for r in bad[:3])
    cuts = sum(len(r.traces) for r in results)
    acked = sum(len(r.acked) for r in results)
    print(
        f"\n{cuts} power cuts survived ({len(results)} runs, {acked} LOCAL-acked records, "
        "none lost, none twice)"
    )
    return cuts


def test_I1_I2_power_cuts_during_appends_rotation_and_sealing() -> None:
    _assert_survived(_suite(range(1000, 1016), export=False))


@pytest.mark.slow
def test_I1_I2_I3_power_cuts_during_export_and_recovery() -> None:
    _assert_survived(_suite(range(2000, 2016), export=True))


@pytest.mark.slow
def test_I1_I2_I3_I5_power_cuts_during_export_by_hard_link() -> None:
    """The exporter links sealed segments into a store directory on the same disk: a cut
    at any step (the link to the temp name, the create-if-absent link, the directory
    fsync, the append, the release that unlinks instead of recycling) loses no acked
    record, doubles none, and never leaves an appended entry without its object."""
    _assert_survived(_suite(range(5000, 5016), export=True, link=True))


@pytest.mark.slow
def test_I1_I2_power_cuts_after_injected_disk_faults() -> None:
    """Three ENOSPC / EIO faults at random operations (WAL, segments, renames, directory
    fsyncs) before the cut: the WAL repairs, the stage re-seals, and still every acked
    record comes back once."""
    _assert_survived(
        _suite(range(3000, 3008), export=False, faults=3)
        + _suite(range(3100, 3108), export=True, faults=3)
    )


@pytest.mark.slow
def test_I1_I2_I3_two_hundred_and_more_power_cuts(tmp_path: Path) -> None:
    """120 runs on the stage alone, 120 with the exporter, 80 with injected disk faults
    first, 80 exporting by hard link (20 of them with faults), with recovery cuts on
    top; one run in eight (not linking) recovers on the real file system from the
    rebuilt directory."""
    results = _suite(range(120), export=False, tmp_path=tmp_path)
    results += _suite(range(10_000, 10_120), export=True, tmp_path=tmp_path)
    results += _suite(range(20_000, 20_040), export=False, faults=3)
    results += _suite(range(30_000, 30_040), export=True, faults=3)
    results += _suite(range(50_000, 50_060), export=True, link=True)
    results += _suite(range(60_000, 60_020), export=True, link=True, faults=3)
    assert _assert_survived(results) >= 200


# --- the broken twins: the suite must catch a stage that acks too early -------------


@contextlib.contextmanager
def _acks_before_fdatasync(sync: bool) -> Iterator[None]:
    """The WAL resolves its appends' LOCAL acks, and only then fdatasyncs (``sync``) --
    or never does."""
    real = WalSync.round

    def sync_round(self: WalSync) -> None:
        st = self.state
        with st.lock:
            if st.rotation is not None:
                done = None
            else:
                f = st.active
                st.durable = max(st.durable, st.written)
                done = st.pop_durable()
        if done is None:
            real(self)
            return
        resolve(done)  # the acks go out ...
        if sync:
            try:
                with f.sync_lock:
                    if not f.closed:
                        st.fs.fdatasync(f.fd)  # ... before the fdatasync
            except OSError as e:
                self.repair.fail(e)

    WalSync.round = sync_round  # type: ignore[method-assign]
    try:
        yield
    finally:
        WalSync.round = real  # type: ignore[method-assign]


@pytest.mark.parametrize("sync", [True, False], ids=["ack-then-fdatasync", "no-fdatasync"])
def test_broken_twin_a_stage_that_acks_before_its_fdatasync_fails_the_suite(sync: bool) -> None:
    caught = None
    for seed in range(4000, 4040):
        r = run_cut(
            seed,
            export=False,
            modes=("drop",),
            recovery_cuts=0,
            patch=lambda: _acks_before_fdatasync(sync),
        )
        assert not r.error, r.report()
        if r.lost:
            caught = r
            break
    assert caught is not None, "the power-cut harness missed acks that preceded fdatasync"
    print(f"\ncaught after {caught.seed - 3999} cuts: {caught.report().splitlines()[2]}")


@contextlib.contextmanager
def _recycles_linked_files() -> Iterator[None]:
    """The stage takes every released file for a spare, shared or not."""
    real = SimFs.link_count
    SimFs.link_count = lambda self, path: 1  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        SimFs.link_count = real  # type: ignore[method-assign]


@pytest.mark.parametrize("twin", ["stage-recycles-linked-files", "store-skips-dir-fsync"])
def test_broken_twin_export_by_hard_link_fails_the_suite(twin: str) -> None:
    """The link suite must catch a stage that overwrites a file a store object shares,
    and a store that does not fsync the directory of a new link before it returns."""
    caught = None
    for seed in range(5000, 5040):
        recycle = twin == "stage-recycles-linked-files"
        with _recycles_linked_files() if recycle else contextlib.nullcontext():
            r = run_cut(seed, export=True, link=True, link_dir_fsync=recycle)
        if not r.ok():
            caught = r
            break
    assert caught is not None, f"the power-cut harness missed the {twin} twin"
    print(f"\ncaught after {caught.seed - 4999} cuts: {caught.report().splitlines()[2]}")
