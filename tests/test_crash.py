"""Crash harness (I1, I2, I3): a staged producer process is killed with SIGKILL at
random moments and restarted; in the end every LOCAL-acked record is consumed
exactly once, and the producer's records keep their order."""

from __future__ import annotations

import os
import random
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import tieredbuf
from tieredbuf.cli import main as cli_main

WORKER = Path(__file__).with_name("staged_worker.py")


def _start(url: str, stage: Path, run: int, limit: int | None = None) -> subprocess.Popen[str]:
    args = [sys.executable, str(WORKER), url, str(stage), str(run)]
    if limit is not None:
        args.append(str(limit))
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _run_and_kill(url: str, stage: Path, run: int, acks_before_kill: int) -> list[str]:
    """Start a producer, wait for ``acks_before_kill`` LOCAL acks, kill -9 it."""
    proc = _start(url, stage, run)
    acked: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("ACK "):
            acked.append(line[4:].strip())
            if len(acked) >= acks_before_kill:
                break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read() if proc.stderr else ""
    if proc.stdout:
        proc.stdout.close()
    if proc.stderr:
        proc.stderr.close()
    return acked


def _crash_loop(tmp_path: Path, kills: int, seed: int) -> None:
    rng = random.Random(seed)
    url = f"file://{tmp_path}/buf"
    stage = tmp_path / "stage"
    acked: list[str] = []
    for run in range(kills):
        acked += _run_and_kill(url, stage, run, rng.randint(1, 25))
    # a last, clean run recovers what the last kill left and exports everything
    final = _start(url, stage, kills, limit=3)
    out, err = final.communicate(timeout=120)
    assert final.returncode == 0, err
    acked += [ln[4:] for ln in out.splitlines() if ln.startswith("ACK ")]

    buf = tieredbuf.open(url)
    c = buf.consumer()
    c.initialize()
    seen: list[str] = []
    while (b := c.next_batch()) is not None:
        seen.extend(r.decode() for r in b.entries)
        c.ack(b.sequence)
    c.flush()
    assert len(seen) == len(set(seen)), "a record was delivered twice"
    missing = set(acked) - set(seen)
    assert not missing, f"I1: acknowledged records lost: {sorted(missing)[:10]}"
    order = [tuple(int(x) for x in r.split(":")) for r in seen]
    assert order == sorted(order), "I3: the producer's records are out of order"
    # the store is on the stage's disk: its data objects are the sealed segment files
    # themselves (hard links, read-only and owner-only 0400 like every stage file), not
    # uploaded copies (0644) -- so the kills also landed between the link, the store's
    # commit and the release
    modes = {stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "buf" / "data").iterdir()}
    assert modes == {0o400}, modes


@pytest.mark.slow
def test_I1_I2_kill_minus_9_a_few_times_loses_and_doubles_nothing(tmp_path: Path) -> None:
    _crash_loop(tmp_path, kills=4, seed=7)


@pytest.mark.slow
def test_I1_I2_kill_minus_9_fifty_times_loses_and_doubles_nothing(tmp_path: Path) -> None:
    _crash_loop(tmp_path, kills=50, seed=2026)


@pytest.mark.slow
def test_I1_drain_takes_over_the_stage_of_a_killed_producer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"file://{tmp_path}/buf"
    stage = tmp_path / "stage"
    acked = _run_and_kill(url, stage, run=0, acks_before_kill=20)
    (pid,) = [d.name for d in stage.iterdir() if d.is_dir()]
    assert cli_main(["drain", str(stage), url]) == 0  # e.g. on another machine
    out = capsys.readouterr().out
    assert f"{pid}: drained" in out and "replayed" in out, out
    assert not list((stage / pid / "segments").glob("*.batch")), "the stage is empty"
    buf = tieredbuf.open(url)
    c = buf.consumer()
    c.initialize()
    seen = []
    while (b := c.next_batch()) is not None:
        seen.extend(r.decode() for r in b.entries)
    assert set(acked) <= set(seen) and len(seen) == len(set(seen))
