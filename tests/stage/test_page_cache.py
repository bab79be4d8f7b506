"""A sealed segment's pages leave the page cache once nobody is about to read them.

Filling fresh page-cache pages is what the stage pays most for on a VM that hands
free memory back to its hypervisor (docs/architecture.md): a plain Stage evicts a
segment right after its fdatasync; a stage with an exporter keeps it cached until the
exporter has read it (Stage.expect_reader), then evicts it.  The eviction is a hint
that changes nothing on disk, so it is checked here by counting the calls on the
stage's file-system seam (real files, real fsync underneath).
"""

from __future__ import annotations

import os
from pathlib import Path

from tieredbuf.config import StageConfig
from tieredbuf.stage.filesystem import FileSystem
from tieredbuf.stage.stage import Stage


class _CountingFs(FileSystem):
    def __init__(self) -> None:
        super().__init__()
        self.dropped: list[str] = []

    def drop_cache(self, fd: int) -> None:
        self.dropped.append(os.readlink(f"/proc/self/fd/{fd}"))
        super().drop_cache(fd)


def _stage(tmp_path: Path, fs: FileSystem) -> Stage:
    return Stage(tmp_path, "p", StageConfig(durability="wal"), fs=fs)


def test_plain_stage_evicts_a_segment_at_its_seal(tmp_path: Path) -> None:
    fs = _CountingFs()
    with _stage(tmp_path, fs) as st:
        st.append_records([b"a" * 100] * 10).result()
        [seg] = st.seal_all()
        # evicted while it had its temp name, after the fdatasync
        assert [Path(p).name for p in fs.dropped] == [seg.path.name + ".tmp"]
        assert len(st.read_segment(seg)) == seg.size  # readable (from disk) all the same
        assert len(fs.dropped) == 1  # no second eviction on read


def test_stage_with_a_reader_evicts_after_the_read(tmp_path: Path) -> None:
    fs = _CountingFs()
    with _stage(tmp_path, fs) as st:
        st.expect_reader()
        st.append_records([b"b" * 100] * 10).result()
        [seg] = st.seal_all()
        assert fs.dropped == []
        body = st.read_segment(seg)
        assert len(body) == seg.size
        assert [Path(p).name for p in fs.dropped] == [seg.path.name]
