"""The stage keeps freed heap memory for the next segment's WAL bodies (glibc).

Each case runs in a fresh interpreter: the setting is process-wide and made once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_PROBE = r"""
import json, os, sys
from pathlib import Path
import tieredbuf.stage.malloc as m
from tieredbuf.config import StageConfig
from tieredbuf.stage.stage import Stage

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

mode, stage_dir = sys.argv[1], sys.argv[2]
if mode != "none":
    Stage(stage_dir, "p", StageConfig(keep_freed_memory=(mode == "on"))).close()
blocks = [b"x" * 100_000 for _ in range(320)]  # a segment's worth of 100 KB bodies
before = rss()
del blocks
print(json.dumps({"applied": m.heap_kept(), "returned": before - rss()}))
"""


def _probe(mode: str, tmp_path: Path, **env: str) -> dict[str, object]:
    full = {
        k: v
        for k, v in os.environ.items()
        if k not in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")
    }
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, mode, str(tmp_path / mode)],
        capture_output=True,
        text=True,
        check=True,
        env={**full, **env},
    )
    result: dict[str, object] = json.loads(out.stdout)
    return result


@pytest.mark.slow
def test_a_stage_keeps_a_segments_freed_bodies_for_reuse(tmp_path: Path) -> None:
    kept = _probe("on", tmp_path)
    if not kept["applied"]:
        pytest.skip("no glibc mallopt here")
    assert isinstance(kept["returned"], int) and kept["returned"] < 4 << 20
    default = _probe("none", tmp_path)  # glibc's own thresholds: the top is trimmed
    assert default["applied"] is None
    assert isinstance(default["returned"], int) and default["returned"] > 24 << 20


def test_the_setting_can_be_switched_off_and_the_environment_wins(tmp_path: Path) -> None:
    assert _probe("off", tmp_path)["applied"] is None  # keep_freed_memory=False
    env = _probe("on", tmp_path, MALLOC_TRIM_THRESHOLD_="131072")
    assert env["applied"] is False
    assert isinstance(env["returned"], int) and env["returned"] > 24 << 20
