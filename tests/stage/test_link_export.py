"""Export by hard link (I1, I2, I5, I7): a ``file://`` store on the stage's file system
takes each sealed segment as a second name of the sealed file (Stage.link_segment +
LocalDirStore.put_link), and the stage never recycles -- overwrites -- a file that
another name shares.  Real files throughout; a crash mid-export is in
tests/test_crash.py (SIGKILL) and tests/stage/test_power_cut.py (power cuts)."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

import tieredbuf
from tieredbuf.config import SegmentConfig, StageConfig, WalConfig
from tieredbuf.format.batch import decode_batch
from tieredbuf.stage.sealed_segment import SealedSegment
from tieredbuf.stage.segment_check import verify
from tieredbuf.stage.segments import SPARE_PREFIX, SegmentDir
from tieredbuf.stage.stage import Stage


def cfg() -> StageConfig:
    return StageConfig(
        wal=WalConfig(flush_interval=timedelta(milliseconds=2)),
        segment=SegmentConfig(max_open_duration=timedelta(seconds=60)),
    )


def _seal(st: Stage, tag: str, n: int = 20, size: int = 3000) -> SealedSegment:
    st.append_records([f"{tag}:{i}:".encode() + b"x" * size for i in range(n)]).result(timeout=5)
    (seg,) = st.seal_all()
    return seg


def _spares(st: Stage) -> list[Path]:
    return [p for p in (st.path / "segments").iterdir() if p.name.startswith(SPARE_PREFIX)]


def test_I1_a_released_segment_another_name_shares_is_never_overwritten(tmp_path: Path) -> None:
    """Without links, released files are recycled (overwritten by the next seals); a
    linked one is unlinked instead, and its other name keeps its bytes through many
    seals that reuse every spare there is."""
    outside = tmp_path / "store"
    outside.mkdir()
    with Stage(tmp_path, "p", cfg()) as st:
        plain = _seal(st, "plain")
        st.release(plain)
        assert len(_spares(st)) == 1  # recycled: the usual path
        kept: list[tuple[Path, bytes, SealedSegment]] = []
        for i in range(6):
            seg = _seal(st, f"linked{i}")
            st.link_segment(seg, outside / f"{i}.batch")
            kept.append((outside / f"{i}.batch", seg.path.read_bytes(), seg))
            st.release(seg)
            assert not (outside / f"{i}.batch").samefile(*_spares(st)[:1] or [tmp_path])
            for j in range(3):  # seals that reuse whatever spare there is
                st.release(_seal(st, f"other{i}.{j}"))
        for path, data, seg in kept:
            assert path.read_bytes() == data and verify(seg, path.read_bytes()) is None
            assert path.stat().st_nlink == 1  # the stage's name is gone
            assert not stat.S_IMODE(path.stat().st_mode) & 0o222  # still read-only


@contextlib.contextmanager
def _link_count_checked_too_early(outside: Path) -> Iterator[None]:
    """The race the reuse-time check closes: a link made after release looked at the link
    count (1) but before the file lost its segment name (became a spare)."""
    real = SegmentDir.delete

    def delete(self: SegmentDir, seg: SealedSegment, keep: bool = True) -> None:
        count = self.fs.link_count

        def then_link(path: Path) -> int:
            n = count(path)
            os.link(path, outside / path.name)  # ... and the exporter links it now
            return n

        self.fs.link_count = then_link  # type: ignore[method-assign]
        try:
            real(self, seg, keep)
        finally:
            del self.fs.link_count

    SegmentDir.delete = delete  # type: ignore[method-assign]
    try:
        yield
    finally:
        SegmentDir.delete = real  # type: ignore[method-assign]


def test_I1_a_spare_that_gained_a_name_is_unlinked_not_reused(tmp_path: Path) -> None:
    outside = tmp_path / "store"
    outside.mkdir()
    with Stage(tmp_path, "p", cfg()) as st:
        seg = _seal(st, "raced", n=40)
        data = seg.path.read_bytes()
        with _link_count_checked_too_early(outside):
            st.release(seg)
        (spare,) = _spares(st)
        assert spare.stat().st_nlink == 2
        nxt = _seal(st, "next")  # would overwrite the spare, which the store shares
        assert _spares(st) == [] and nxt.path.stat().st_nlink == 1
        assert (outside / seg.path.name).read_bytes() == data


def _consume(buf: tieredbuf.Buffer) -> list[bytes]:
    c = buf.consumer()
    c.initialize()
    out: list[bytes] = []
    while (b := c.next_batch()) is not None:
        out += b.entries
        c.ack(b.sequence)
    c.flush()
    c.close()
    return out


def test_I2_I7_a_same_disk_file_store_gets_links_exactly_once(tmp_path: Path) -> None:
    buf = tieredbuf.open(f"file://{tmp_path}/store")
    p = buf.producer(
        staging_dir=tmp_path / "stage",
        target_size=20_000,
        max_open_duration=timedelta(milliseconds=20),
        flush_interval=timedelta(milliseconds=2),
    )
    sent = [f"r{i}".encode() * 300 for i in range(400)]
    handles = []
    for half in (sent[:200], sent[200:]):  # a flush each: at least two segments
        handles += [p.produce(half[i : i + 4]) for i in range(0, len(half), 4)]
        p.flush(timeout=60)
    stats = p.stats
    p.close()
    assert all(h.result() is not None for h in handles)
    assert stats["objects_linked"] == stats["segments_exported"] >= 2
    assert _consume(buf) == sent  # every record once, in order
    objs = sorted((tmp_path / "store" / "data").iterdir())
    assert len(objs) == stats["segments_exported"]
    for o in objs:  # each object is the sealed file itself, whose stage name is gone
        assert o.stat().st_nlink == 1 and decode_batch(o.read_bytes(), str(o))
    assert not list((tmp_path / "stage" / p.producer_id / "segments").iterdir())
    buf.close()


def _other_device(tmp_path: Path) -> Path | None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        return None
    if shm.stat().st_dev == tmp_path.stat().st_dev:
        return None
    return shm


def test_a_file_store_on_another_file_system_gets_the_bytes(tmp_path: Path) -> None:
    """EXDEV: the first link is refused, the object is uploaded instead, and the exporter
    uploads from then on; nothing is lost or doubled."""
    shm = _other_device(tmp_path)
    if shm is None:
        pytest.skip("no writable file system other than tmp_path's (/dev/shm) here")
    stage_dir = shm / f"tb-stage-{os.getpid()}-{tmp_path.name}"
    try:
        buf = tieredbuf.open(f"file://{tmp_path}/store")
        p = buf.producer(
            staging_dir=stage_dir,
            target_size=20_000,
            max_open_duration=timedelta(milliseconds=20),
            flush_interval=timedelta(milliseconds=2),
        )
        sent = [f"x{i}".encode() * 300 for i in range(200)]
        for half in (sent[:100], sent[100:]):  # a flush each: at least two segments
            for i in range(0, len(half), 4):
                p.produce(half[i : i + 4])
            p.flush(timeout=60)
        stats = p.stats
        p.close()
        assert stats.get("objects_linked", 0) == 0 and stats["segments_exported"] >= 2
        assert _consume(buf) == sent
        buf.close()
    finally:
        import shutil

        shutil.rmtree(stage_dir, ignore_errors=True)
