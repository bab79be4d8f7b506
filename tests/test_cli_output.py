"""Output that cannot be written: a closed pipe, a full disk, an ``--out`` nobody can
create.  Each is one line on stderr (a closed pipe: none but the summary), never a
traceback, and ``consume`` acks only what reached its output (I10).

The full disk is ``/dev/full`` for stdout, and a file-size limit (RLIMIT_FSIZE, with
SIGXFSZ ignored) for ``--out``: each write past it fails with EFBIG as a full disk
fails one with ENOSPC.  A reader that closes its end of the pipe early is a real pipe
read by this process, a few bytes at a time, so how much reached it is known exactly.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
from pathlib import Path

import pytest

import tieredbuf
from tests.test_cli_first_hour import EXE, env_for, no_traceback

DEADLINE = 60.0


def _buffer(path: Path, entries: list[list[bytes]]) -> str:
    """A local buffer holding one entry per item of ``entries``."""
    url = f"file://{path}"
    buf = tieredbuf.open(url)
    with buf.producer() as p:
        for records in entries:
            p.produce(records)
            p.flush()
    assert buf.snapshot().root.next_seq == len(entries)
    return url


def _head(url: str, lines: int, cwd: Path, *argv: str) -> tuple[int, str, bytes]:
    """``tieredbuf consume URL ARGV | head -LINES``, the reader reading 16 bytes at a time
    and closing its end right after the LINES-th newline.  Returns the exit code, stderr
    and every byte the reader took out of the pipe."""
    r, w = os.pipe()
    p = subprocess.Popen(
        [EXE, "consume", url, *argv],
        stdout=w,
        stderr=subprocess.PIPE,
        cwd=cwd,
        env=env_for(cwd),
    )
    os.close(w)
    got = b""
    while got.count(b"\n") < lines:
        chunk = os.read(r, 16)
        if not chunk:
            break
        got += chunk
    os.close(r)
    _, err = p.communicate(timeout=DEADLINE)
    return p.returncode, err.decode(), got


def _acked_through(url: str) -> int:
    """The default consumer's next sequence as the store has it (what was acked and
    flushed): the queue's first sequence once the acked entries are dequeued."""
    snap = tieredbuf.open(url).snapshot()
    return int(snap.root.head)


@pytest.mark.slow
def test_I10_consume_into_a_pipe_closed_early_is_quiet_and_acks_nothing_unwritten(
    tmp_path: Path,
) -> None:
    # 30 entries of ~100 KiB each (1,000 lines): more than a pipe holds (64 KiB), so
    # when the reader closes after two lines not even the first entry was all written
    line = b"x" * 99
    url = _buffer(tmp_path / "b", [[line] * 1000 for _ in range(30)])
    code, err, got = _head(url, 2, tmp_path)
    no_traceback(_Result(err))
    assert code in (0, 141), err
    assert got.startswith(b"x" * 99 + b"\n")
    assert _acked_through(url) == 0, "an entry that never reached the pipe was acked"
    assert err.strip().splitlines()[-1].endswith("nothing acked"), err


def test_I10_one_large_entry_cut_short_by_the_reader_is_not_acked(tmp_path: Path) -> None:
    # one entry of 200,000 lines; the reader takes one line and closes the pipe
    url = _buffer(tmp_path / "b", [[b"%d" % i for i in range(200_000)]])
    code, err, got = _head(url, 1, tmp_path)
    no_traceback(_Result(err))
    assert code in (0, 141), err
    assert got.startswith(b"0\n")
    assert _acked_through(url) == 0, "an entry most of which never reached the pipe was acked"


@pytest.mark.slow
def test_I10_consume_into_a_pipe_acks_what_was_written_and_no_more(tmp_path: Path) -> None:
    # small entries: each one written whole, then acked; the reader closes after two
    url = _buffer(tmp_path / "b", [[b"entry %d" % i] for i in range(30)])
    code, err, got = _head(url, 2, tmp_path)
    no_traceback(_Result(err))
    assert code in (0, 141), err
    assert got.startswith(b"entry 0\nentry 1\n")
    acked = _acked_through(url)
    assert 2 <= acked <= 30, "the two lines read came from acked entries"
    summary = err.strip().splitlines()[-1]
    assert summary.endswith(f"acked through sequence {acked - 1}"), err


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv",
    [["entries"], ["consume", "--json"], ["consume", "--no-ack"], ["inspect"]],
    ids=["entries", "consume-json", "consume-no-ack", "inspect"],
)
def test_every_printing_command_into_a_closed_pipe_exits_quietly(
    tmp_path: Path, argv: list[str]
) -> None:
    url = _buffer(tmp_path / "b", [[b"y" * 200] * 500 for _ in range(5)])
    r, w = os.pipe()
    os.close(r)  # the reader is gone before the first byte
    p = subprocess.run(
        [EXE, argv[0], url, *argv[1:]],
        stdout=w,
        stderr=subprocess.PIPE,
        cwd=tmp_path,
        env=env_for(tmp_path),
        timeout=DEADLINE,
        text=True,
    )
    os.close(w)
    no_traceback(_Result(p.stderr))
    assert p.returncode in (0, 141), p.stderr
    assert "Exception ignored" not in p.stderr, p.stderr
    if argv[0] == "consume" and "--no-ack" not in argv:
        assert _acked_through(url) == 0


class _Result:
    def __init__(self, stderr: str) -> None:
        self.stderr = stderr


def _no_bigger_files_than(limit: int) -> None:
    """In the child: files stop growing at ``limit`` bytes, as on a full disk."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def _run(
    argv: list[str], cwd: Path, *, stdout: object = subprocess.PIPE, fsize: int | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [EXE, *argv],
        stdout=stdout,  # type: ignore[arg-type]
        stderr=subprocess.PIPE,
        cwd=cwd,
        env=env_for(cwd),
        timeout=DEADLINE,
        text=True,
        preexec_fn=None if fsize is None else (lambda: _no_bigger_files_than(fsize)),
    )


@pytest.mark.parametrize("argv", [["consume"], ["entries"], ["inspect", "--json"]])
def test_stdout_on_a_full_disk_is_one_line_and_acks_nothing(
    tmp_path: Path, argv: list[str]
) -> None:
    url = _buffer(tmp_path / "b", [[b"z" * 100] * 200 for _ in range(3)])
    with open("/dev/full", "w") as full:
        r = _run([argv[0], url, *argv[1:]], tmp_path, stdout=full)
    no_traceback(r)
    assert r.returncode == 3, r.stderr
    lines = r.stderr.strip().splitlines()
    assert any("No space left on device" in x and "standard output" in x for x in lines), r.stderr
    assert _acked_through(url) == 0


@pytest.mark.slow
@pytest.mark.parametrize("out", ["x.parquet", "x.arrow", "dir"])
def test_consume_out_on_a_full_disk_is_one_line_acks_nothing_and_leaves_no_file(
    tmp_path: Path, out: str
) -> None:
    # records that do not compress: each data object is past the 64 KiB file size limit
    url = _buffer(tmp_path / "b", [[os.urandom(60) for _ in range(2000)] for _ in range(3)])
    target = tmp_path / "o" / out
    r = _run(["consume", url, "--out", str(target)], tmp_path, fsize=64 << 10)
    no_traceback(r)
    assert r.returncode == 3, r.stderr
    assert "File too large" in r.stderr and str(target) in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) <= 2, r.stderr
    assert _acked_through(url) == 0
    if out == "dir":  # no file cut short under a name a reader would open
        assert all(f.stat().st_size > 0 for f in target.iterdir())
        from tieredbuf.format.batch import decode_batch

        for f in target.iterdir():
            decode_batch(f.read_bytes())
    else:
        assert not target.exists()


def test_consume_out_where_no_file_can_be_made_is_one_line(tmp_path: Path) -> None:
    url = _buffer(tmp_path / "b", [[b"a"]])
    r = _run(["consume", url, "--out", "/proc/x.parquet"], tmp_path)
    no_traceback(r)
    assert r.returncode in (2, 3), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "/proc/x.parquet" in r.stderr, r.stderr
    assert _acked_through(url) == 0


def test_consume_out_with_an_unknown_suffix_is_refused_naming_the_choices(tmp_path: Path) -> None:
    url = _buffer(tmp_path / "b", [[b"a"]])
    r = _run(["consume", url, "--out", str(tmp_path / "x.csv")], tmp_path)
    assert r.returncode == 2, r.stderr
    assert ".parquet" in r.stderr and ".arrow" in r.stderr and "x.csv" in r.stderr
    assert not (tmp_path / "x.csv").exists()
    assert _acked_through(url) == 0
