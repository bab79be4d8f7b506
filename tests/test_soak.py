"""The soak (I8, bounded resources): bench/soak.py for 30 s -- staged producers, a
consumer, a continuous reader, retention and GC together -- must show no growth of RSS,
open files, threads or stage disk bytes after warm-up; and a twin with a leaking
subscriber (through the script's SUBSCRIBERS hook) must fail the same rule.

Each runs in its own process, so the figures are the soak's alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"

LEAKY = """
import os, sys, threading
sys.path.insert(0, {repo!r})
from bench import soak

def leaky(buf, stop, counters):  # a subscriber that never closes what it opens
    held = []
    while not stop.wait(0.25):
        held.append(open(os.devnull))
        counters["leaked_fds"] += 1

soak.SUBSCRIBERS.append(leaky)
sys.exit(soak.main(sys.argv[1:]))
"""


def _soak(args: list[str], script: str | None = None) -> tuple[int, dict, str]:
    name = args[args.index("--json") + 1]
    cmd = [sys.executable, "-c", script] if script else [sys.executable, "bench/soak.py"]
    r = subprocess.run([*cmd, *args], cwd=REPO, capture_output=True, text=True, timeout=600)
    result = json.loads((RESULTS / f"{name}.json").read_text())
    return r.returncode, result, r.stdout + r.stderr


@pytest.mark.slow
def test_I8_thirty_second_soak_shows_no_growth_after_warm_up() -> None:
    rc, result, out = _soak(["--duration", "30", "--warmup", "10", "--json", "soak-test"])
    print(out)
    assert rc == 0, out
    assert not result["failed"]
    assert {m: g["grew"] for m, g in result["growth"].items()} == {
        "threads": False,
        "open_fds": False,
        "rss_bytes": False,
        "stage_disk_bytes": False,
    }
    c = result["counters"]
    assert c["produced"] > 0 and c["consumed"] > 0 and c["read_entries"] > 0
    assert c["gc_passes"] >= 3


@pytest.mark.slow
def test_I8_the_soak_rule_catches_a_leak() -> None:
    """The broken twin: a subscriber leaks a file descriptor four times a second."""
    rc, result, out = _soak(
        ["--duration", "20", "--warmup", "5", "--json", "soak-leak"],
        script=LEAKY.format(repo=str(REPO)),
    )
    assert rc == 1, out
    assert result["growth"]["open_fds"]["grew"], result["growth"]
    assert any("open_fds grew" in f for f in result["failed"])
