"""``tieredbuf work URL QUEUE -- CMD``: the real executable runs a real command per
entry of a work queue.  Exit 0 acks, a ``--reject-exit`` code rejects, anything else
hands the entry back; a lease that lapses (a runner killed with SIGKILL, or a command
that outlives its lease) redelivers the entry, which is then acked exactly once."""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tieredbuf
from tieredbuf.queue.subscribers import SubscriberInfo

EXE = shutil.which("tieredbuf") or str(Path(sys.executable).with_name("tieredbuf"))
DEADLINE = 90.0


def make_buffer(tmp_path: Path, entries: list[list[bytes]]) -> str:
    """A buffer holding one queue entry per item of ``entries``."""
    url = f"file://{tmp_path}/buf"
    p = tieredbuf.open(url).producer(manifest_writes_per_s=0)
    for records in entries:
        p.produce(records)
        p.flush(timeout=30)
    p.close(timeout=30)
    return url


def work(
    tmp_path: Path, url: str, *argv: str, timeout: float = DEADLINE
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [EXE, "work", url, "jobs", *argv],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def queue_state(url: str) -> SubscriberInfo:
    (sub,) = [s for s in tieredbuf.open(url).subscribers() if s.name == "jobs"]
    return sub


@pytest.mark.slow
def test_exit_0_acks_each_entry_with_its_records_on_stdin(tmp_path: Path) -> None:
    url = make_buffer(tmp_path, [[b"a1", b"a2"], [b"b1"], [b"c1"]])
    r = work(
        tmp_path,
        url,
        "--",
        "sh",
        "-c",
        'cat > "out.$TIEREDBUF_SEQUENCE"; echo "ran $TIEREDBUF_SEQUENCE"',
    )
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.split("\n")) == ["", "ran 0", "ran 1", "ran 2"]  # CMD's stdout
    assert (tmp_path / "out.0").read_text() == "a1\na2\n"
    assert (tmp_path / "out.1").read_text() == "b1\n"
    assert (tmp_path / "out.2").read_text() == "c1\n"
    assert "sequence 0: exit 0 -> acked" in r.stderr
    assert r.stderr.strip().splitlines()[-1] == "work: 3 acked"
    sub = queue_state(url)
    assert sub.next_sequence == 3 and sub.work is not None and sub.work["leased"] == 0
    again = work(tmp_path, url, "--", "sh", "-c", "exit 9")  # every entry is done
    assert again.returncode == 0 and "nothing to do" in again.stderr, again.stderr


@pytest.mark.slow
def test_a_chosen_exit_code_rejects_and_other_failures_are_handed_back(
    tmp_path: Path,
) -> None:
    url = make_buffer(tmp_path, [[b"good"], [b"bad"], [b"flaky"]])
    script = (
        'read x; case "$x" in good) exit 0;; bad) echo "no good: $x" >&2; exit 7;; '
        "flaky) if [ -e tried ]; then exit 0; fi; touch tried; exit 1;; esac"
    )
    r = work(tmp_path, url, "--reject-exit", "7", "--", "sh", "-c", script)
    assert r.returncode == 1, r.stderr  # something was rejected or handed back
    assert "sequence 1: exit 7: no good: bad -> rejected" in r.stderr, r.stderr
    assert "sequence 2: exit 1 -> handed back for redelivery" in r.stderr
    assert "sequence 2: exit 0 -> acked" in r.stderr  # redelivered, then acked
    assert "no good: bad" in r.stderr.splitlines(), "CMD's stderr passes through"
    sub = queue_state(url)
    assert sub.next_sequence == 3
    assert [(x.seq, x.reason) for x in sub.rejected] == [(1, b"exit 7: no good: bad")]
    listing = subprocess.run(
        [EXE, "subscribers", url], capture_output=True, text=True, timeout=DEADLINE
    )
    assert "rejected 1 after 1 deliveries: exit 7: no good: bad" in listing.stdout


@pytest.mark.slow
def test_an_entry_failing_every_time_is_rejected_after_max_deliveries(tmp_path: Path) -> None:
    url = make_buffer(tmp_path, [[b"x"]])
    r = work(tmp_path, url, "--max-deliveries", "2", "--", "sh", "-c", "exit 1")
    assert r.returncode == 1, r.stderr
    assert r.stderr.count("exit 1 -> handed back") == 2, r.stderr
    (rej,) = queue_state(url).rejected
    assert rej.seq == 0 and rej.deliveries == 2 and b"max_deliveries" in rej.reason


@pytest.mark.slow
def test_a_lapsed_lease_of_a_killed_runner_is_redelivered_and_acked_once(
    tmp_path: Path,
) -> None:
    url = make_buffer(tmp_path, [[b"only"]])
    started = tmp_path / "started"
    first = subprocess.Popen(
        [
            EXE,
            "work",
            url,
            "jobs",
            "--lease",
            "2s",
            "--",
            "sh",
            "-c",
            f'touch "{started}"; sleep 60',
        ],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + DEADLINE
        while not started.exists():  # the entry is leased and its command runs
            assert first.poll() is None and time.monotonic() < deadline, "never started"
            time.sleep(0.01)  # polling a condition against a deadline
        os.killpg(first.pid, signal.SIGKILL)  # the runner and its command die holding the lease
        first.wait(DEADLINE)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
        assert first.stderr is not None
        first.stderr.close()
    assert queue_state(url).work["leased"] == 1  # type: ignore[index]
    # a second runner waits (--follow) until the lease lapses, then takes the entry
    r = work(
        tmp_path,
        url,
        "--follow",
        "--limit",
        "1",
        "--poll-max",
        "200ms",
        "--",
        "sh",
        "-c",
        "cat > got.txt",
    )
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "got.txt").read_text() == "only\n"
    sub = queue_state(url)
    assert sub.next_sequence == 1 and sub.work["leased"] == 0  # type: ignore[index]


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie (a killed orphan may wait to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _wait_gone(pids: list[int], within: float = 30.0) -> list[int]:
    deadline = time.monotonic() + within
    while (left := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)  # polling a condition against a deadline
    return left


@pytest.mark.slow
def test_a_command_running_three_times_its_lease_keeps_it_and_is_acked_once(
    tmp_path: Path,
) -> None:
    """The lease is extended every third of it while CMD runs: a second runner waiting
    beside it never gets the entry, and it is acked once."""
    url = make_buffer(tmp_path, [[b"long"]])
    main = subprocess.Popen(
        [EXE, "work", url, "jobs", "--lease", "2s", "--",
         "sh", "-c", "touch started; sleep 6; cat > got.txt"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    other: subprocess.Popen[str] | None = None
    try:
        deadline = time.monotonic() + DEADLINE
        while not (tmp_path / "started").exists():  # main holds the entry: now the other
            assert main.poll() is None and time.monotonic() < deadline, "never started"
            time.sleep(0.01)  # polling a condition against a deadline
        other = subprocess.Popen(
            [EXE, "work", url, "jobs", "--lease", "2s", "--follow", "--poll-max", "200ms",
             "--", "sh", "-c", "cat > other.txt"],
            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        _, main_err = main.communicate(timeout=DEADLINE)
    finally:
        if main.poll() is None:
            main.kill()
            main.wait()
        err = ""
        if other is not None:
            other.send_signal(signal.SIGINT)
            _, err = other.communicate(timeout=DEADLINE)
    r = subprocess.CompletedProcess(main.args, main.returncode, "", main_err)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "got.txt").read_text() == "long\n"
    assert not (tmp_path / "other.txt").exists(), err
    line = next(x for x in r.stderr.splitlines() if "exit 0 -> acked" in x)
    extended = int(line.split("lease extended ")[1].split(" times")[0])
    assert extended >= 8, line  # 6 s at one extension per 2/3 s
    sub = queue_state(url)
    assert sub.next_sequence == 1 and sub.rejected == ()
    assert "acked" not in err  # the other runner acked nothing


@pytest.mark.slow
def test_a_command_ignoring_sigterm_past_max_run_is_stopped_with_its_children(
    tmp_path: Path,
) -> None:
    """Found: a CMD that ignored SIGTERM was "stopped", yet its child ran on after work
    exited.  Now SIGTERM and then SIGKILL go to the whole process group at --max-run."""
    url = make_buffer(tmp_path, [[b"stuck"]])
    script = (
        'trap "" TERM; (trap "" TERM; sleep 60) & echo $! > child.pid; echo $$ > sh.pid; '
        "sleep 60; wait"
    )
    r = work(
        tmp_path, url, "--lease", "4s", "--max-run", "1s", "--max-deliveries", "1",
        "--", "sh", "-c", script,
    )  # fmt: skip
    assert r.returncode == 1, r.stderr
    assert "ran past --max-run 1s: stopped -> handed back for redelivery" in r.stderr, r.stderr
    pids = [int((tmp_path / f).read_text()) for f in ("sh.pid", "child.pid")]
    assert _wait_gone(pids, within=0) == [], "a process of the command outlived work"
    (rej,) = queue_state(url).rejected  # its one delivery used up: not run again
    assert rej.seq == 0 and rej.deliveries == 1 and b"max_deliveries" in rej.reason


@pytest.mark.slow
def test_a_command_failing_three_times_then_succeeding_is_retried_with_backoff(
    tmp_path: Path,
) -> None:
    """Found: a failing command was retried at once, five times in 0.69 s, and the entry
    dead-lettered.  Now each redelivery waits a delay that doubles per delivery."""
    url = make_buffer(tmp_path, [[b"flaky"]])
    script = (
        "date +%s.%N >> tries; n=$(wc -l < tries); "
        '[ "$n" -gt 3 ] || { echo "try $n failed" >&2; exit 1; }'
    )
    r = work(
        tmp_path, url, "--redelivery-delay", "300ms", "--max-deliveries", "5",
        "--", "sh", "-c", script,
    )  # fmt: skip
    assert r.returncode == 1, r.stderr  # some entry was handed back on the way
    starts = [float(x) for x in (tmp_path / "tries").read_text().split()]
    assert len(starts) == 4
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    for gap, delay in zip(gaps, (0.3, 0.6, 1.2), strict=True):
        assert gap >= delay, gaps  # never redelivered before its delay
    assert r.stderr.count("-> handed back for redelivery in ") == 3, r.stderr
    assert r.stderr.count("exit 0 -> acked") == 1
    sub = queue_state(url)
    assert sub.next_sequence == 1 and sub.rejected == ()


@pytest.mark.slow
def test_nothing_of_a_command_outlives_a_runner_killed_with_sigkill(tmp_path: Path) -> None:
    url = make_buffer(tmp_path, [[b"x"]])
    script = "(sleep 60) & echo $! > child.pid; echo $$ > sh.pid; sleep 60"
    p = subprocess.Popen(
        [EXE, "work", url, "jobs", "--", "sh", "-c", script],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + DEADLINE
        while not (tmp_path / "sh.pid").exists() or not (tmp_path / "child.pid").exists():
            assert p.poll() is None and time.monotonic() < deadline, "never started"
            time.sleep(0.01)  # polling a condition against a deadline
        p.kill()
        p.wait(DEADLINE)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    pids = [int((tmp_path / f).read_text()) for f in ("sh.pid", "child.pid")]
    assert _wait_gone(pids) == [], "the command outlived its runner"


def test_concurrency_runs_commands_side_by_side_each_entry_once(tmp_path: Path) -> None:
    url = make_buffer(tmp_path, [[f"r{i}".encode()] for i in range(6)])
    r = work(
        tmp_path, url, "--concurrency", "3", "--", "sh", "-c", 'cat >> "out.$TIEREDBUF_SEQUENCE"'
    )
    assert r.returncode == 0, r.stderr
    for i in range(6):
        assert (tmp_path / f"out.{i}").read_text() == f"r{i}\n"
    assert r.stderr.strip().splitlines()[-1] == "work: 6 acked"
    assert queue_state(url).work["workers"] >= 1  # type: ignore[index]


@pytest.mark.slow
def test_work_needs_a_command_and_a_buffer(tmp_path: Path) -> None:
    url = make_buffer(tmp_path, [[b"x"]])
    r = work(tmp_path, url)
    assert r.returncode == 2 and "give the command to run after --" in r.stderr, r.stderr
    r = subprocess.run(
        [EXE, "work", f"file://{tmp_path}/typo", "jobs", "--", "true"],
        capture_output=True,
        text=True,
        timeout=DEADLINE,
    )
    assert r.returncode == 2 and "no tieredbuf buffer" in r.stderr, r.stderr
    assert not (tmp_path / "typo").exists()
    r = work(tmp_path, url, "--", "no-such-command-here")
    assert r.returncode == 2 and "cannot run 'no-such-command-here'" in r.stderr, r.stderr
    assert [s.name for s in tieredbuf.open(url).subscribers()] == []  # nothing was claimed


def test_ctrl_c_stops_a_following_runner_with_a_summary(tmp_path: Path) -> None:
    url = make_buffer(tmp_path, [[b"x"]])
    p = subprocess.Popen(
        [EXE, "work", url, "jobs", "--follow", "--", "sh", "-c", "cat > got.txt"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stderr is not None
        assert "sequence 0: exit 0 -> acked" in p.stderr.readline()  # then it waits
        p.send_signal(signal.SIGINT)
        p.wait(DEADLINE)
        err = p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130, err
    assert "Traceback" not in err and err.strip() == "work: 1 acked; interrupted", err
