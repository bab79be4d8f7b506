"""WAL file recycling: a purged file becomes a zeroed spare (``quiver.wal.free.<K>``)
that the next rotation overwrites instead of creating a new file (unlinking a 64 MiB
file on ext4 with ``discard`` stalled concurrent fdatasyncs).  Recovery ignores and
deletes spares; a recycled file never yields its stale entries, also after a real
SIGKILL; a torn frame followed by the recycled file's zeros is torn, while damage
followed by later entries is still corrupt (I7)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from tieredbuf.config import WalConfig
from tieredbuf.errors import CorruptError
from tieredbuf.format import wal as wal_fmt
from tieredbuf.stage.wal import ACTIVE_NAME, FREE_PREFIX, WalWriter, zero_file

CFG = b"\x07" * 16
REPO = Path(__file__).resolve().parents[2]
PAYLOAD = 300  # every entry the same size, so a stale entry would sit on a frame boundary


def _entry(seq: int) -> list[bytes | memoryview]:
    return wal_fmt.encode_records_entry(seq, 1, [seq.to_bytes(4, "little") * (PAYLOAD // 4)], b"m")


def _open(d: Path, **kw: object) -> WalWriter:
    kw.setdefault("rotation_target", 2000)
    kw.setdefault("flush_interval", timedelta(0))
    return WalWriter(d, CFG, WalConfig(**kw))  # type: ignore[arg-type]


def _seqs(w: WalWriter, frm: int | None = None) -> list[int]:
    return [e.sequence for e, _, _ in w.replay(frm)]


def _spares(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.name.startswith(FREE_PREFIX))


@pytest.fixture(autouse=True)
def _needs_zero_range(tmp_path: Path) -> None:
    p = tmp_path / "probe"
    p.write_bytes(b"x" * 8192)
    try:
        zero_file(p, 8192)
    except OSError as e:
        pytest.skip(f"fallocate(FALLOC_FL_ZERO_RANGE) unsupported here: {e}")
    finally:
        p.unlink()


def _fill_and_recycle(w: WalWriter, d: Path) -> tuple[int, int, int]:
    """Fill two files with entries 0.., purge them (one becomes the spare), and rotate
    into the spare.  Returns (next sequence, the cursor = position of sequence ``first``,
    ``first``)."""
    seq = 0
    while w.file_count() < 3:
        w.append(_entry(seq))
        seq += 1
    w.advance_cursor(w.end)
    first = seq
    (spare,) = _spares(d)
    assert spare.stat().st_size > 2000 and spare.read_bytes().count(0) == spare.stat().st_size
    cursor = w.cursor
    while w.recycled == 0:
        w.append(_entry(seq))
        seq += 1
    assert _spares(d) == []
    return seq, cursor, first


def test_purged_file_becomes_a_zeroed_spare_reused_by_the_next_rotation(tmp_path: Path) -> None:
    w = _open(tmp_path)
    seq, cursor, first = _fill_and_recycle(w, tmp_path)
    recycled_start = w.active_span.start  # the recycled file is the active one
    active = tmp_path / ACTIVE_NAME
    assert active.stat().st_size > w.active_span.file_size  # zeros after the entries
    for i in range(3):
        w.append(_entry(seq + i))
    w.close()
    assert _spares(tmp_path) == []  # close deletes spares ...
    assert active.stat().st_size == 38 + w.end - recycled_start  # ... and the zero tail
    w2 = _open(tmp_path)
    assert w2.recovery.torn_bytes == 0 and w2.recovery.corrupt_bytes == 0
    assert w2.cursor == cursor and _seqs(w2) == list(range(first, seq + 3))
    w2.close()


def test_a_recycled_rotated_file_is_truncated_to_its_entries(tmp_path: Path) -> None:
    """Only the newest file may end in zeros: rotating a recycled file truncates it."""
    w = _open(tmp_path)
    seq, _, _ = _fill_and_recycle(w, tmp_path)
    rid = w.active_span
    while w.active_span is rid:
        w.append(_entry(seq))
        seq += 1
    w.sync()
    assert rid.path != tmp_path / ACTIVE_NAME and rid.path.stat().st_size == rid.file_size
    w.close()
    w2 = _open(tmp_path)
    assert w2.recovery.torn_bytes == 0 and w2.recovery.corrupt_bytes == 0
    w2.close()


def test_recovery_ignores_and_deletes_spares(tmp_path: Path) -> None:
    """A spare is not a WAL file, whatever it holds: even a copy of a real WAL file
    (as after a crash before its zeroing was durable) is neither replayed nor checked
    for contiguity, and it is deleted."""
    w = _open(tmp_path)
    acks = [w.append(_entry(i)) for i in range(3)]
    w.close()
    shutil.copy(tmp_path / ACTIVE_NAME, tmp_path / f"{FREE_PREFIX}0")
    (tmp_path / f"{FREE_PREFIX}1").write_bytes(b"\0" * 4096)
    w2 = _open(tmp_path)
    assert _spares(tmp_path) == []
    assert _seqs(w2) == [0, 1, 2] and w2.end == acks[-1].end
    w2.close()


def _crash_copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():  # the directory as a crash would leave it (incl. zeros)
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def test_torn_frame_before_the_zeros_of_a_recycled_file_is_torn(tmp_path: Path) -> None:
    w = _open(tmp_path / "w")
    seq, _, _ = _fill_and_recycle(w, tmp_path / "w")
    w.append(_entry(seq))
    end = w.end
    crash = _crash_copy(tmp_path / "w", tmp_path / "crash")
    w.close()
    active = crash / ACTIVE_NAME
    off = 38 + w.end - w.active_span.start
    with active.open("r+b") as f:  # half of the next entry landed, its rest is zeros
        f.seek(off)
        f.write(b"".join(_entry(seq + 1))[:100])
    w2 = _open(crash)
    assert w2.recovery.torn_bytes > 0 and w2.recovery.corrupt_bytes == 0
    assert w2.end == end and _seqs(w2)[-1] == seq
    assert active.stat().st_size == off
    w2.close()


def test_I7_damage_in_a_recycled_file_followed_by_entries_is_still_corrupt(
    tmp_path: Path,
) -> None:
    w = _open(tmp_path / "w")
    seq, _, _ = _fill_and_recycle(w, tmp_path / "w")
    for i in range(3):
        w.append(_entry(seq + i))
    crash = _crash_copy(tmp_path / "w", tmp_path / "crash")
    first = 38 + (w.active_span.end - w.active_span.start) - 4 * len(b"".join(_entry(0)))
    w.close()
    active = crash / ACTIVE_NAME
    data = bytearray(active.read_bytes())
    data[first + 20] ^= 0x10  # an entry followed by three good ones, then zeros
    active.write_bytes(bytes(data))
    with pytest.raises(CorruptError) as ei:
        _open(crash)
    assert ei.value.offset == first


WORKER = """
import os, signal, sys
from datetime import timedelta
from pathlib import Path
sys.path.insert(0, {repo!r})
from tests.stage.test_wal_recycle import _entry, _fill_and_recycle, _open, CFG
d = Path(sys.argv[1])
w = _open(d)
seq, cursor, first = _fill_and_recycle(w, d)
assert w.recycled == 1
for s in range(seq, seq + 2):  # far fewer entries than the spare held
    w.append(_entry(s))  # flush_interval=0: returns once fdatasynced (acked)
print(cursor, *range(first, seq + 2), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_I1_sigkill_in_a_recycled_file_recovers_exactly_the_new_entries(tmp_path: Path) -> None:
    """A real process fills two files, recycles one, writes fewer (same-sized) entries
    into it, and is SIGKILLed: recovery yields exactly the acked new entries -- none of
    the stale ones the file held before, which would sit on the same frame boundaries."""
    d = tmp_path / "wal"
    p = subprocess.run(
        [sys.executable, "-c", WORKER.format(repo=str(REPO)), str(d)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == -signal.SIGKILL, p.stderr
    cursor, *acked = map(int, p.stdout.split())
    active = d / ACTIVE_NAME
    assert active.stat().st_size > 38 + 2 * len(b"".join(_entry(0)))  # the spare's zeros
    w = _open(d)
    assert w.recovery.corrupt_bytes == 0 and w.recovery.torn_bytes > 0  # the zero tail
    assert w.cursor == cursor
    assert [e.sequence for e, s, _ in w.replay(cursor)] == acked
    assert _spares(d) == []
    w.close()
    os.sync()
