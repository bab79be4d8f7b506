"""A stage on a disk that fills up: ``produce --staging`` waits for the exporter to free
space, up to ``--timeout``, as at the stage's size cap (I8: backpressure, not a failure),
and ``drain`` on a full disk says how to drain the stage elsewhere (nothing is lost).

The small disk is a real tmpfs (mounting needs root, as CI has; skipped elsewhere)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

import tieredbuf
from tests.endpoint import S3Endpoint
from tests.test_cli_first_hour import closed_port, env_for, no_traceback, tb


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _lines(n: int, width: int = 100) -> str:
    return "".join(f"{i:0{width - 1}d}\n" for i in range(n))


@pytest.mark.slow
def test_I8_produce_through_a_stage_on_a_full_disk_waits_for_the_exporter(
    tmp_path: Path, small_disk: Path
) -> None:
    # 20 MB through an 8 MiB stage: the exporter must free space as it goes
    url = f"file://{tmp_path}/buf"
    n = 200_000
    r = tb(
        ["produce", url, "--staging", str(small_disk / "stage"), "--timeout", "60s"],
        tmp_path,
        stdin=_lines(n),
        timeout=180,
    )
    no_traceback(r)
    assert r.returncode == 0, r.stderr
    assert f"produced {n} records" in r.stdout, r.stdout
    from tieredbuf.format.batch import decode_batch

    buf = tieredbuf.open(url)
    assert sum(len(decode_batch(buf.read_object(e))) for e in buf.entries()) == n


@pytest.mark.s3
@pytest.mark.slow
def test_drain_on_a_full_disk_says_how_to_drain_the_stage_elsewhere(
    tmp_path: Path, small_disk: Path, s3_endpoint: S3Endpoint
) -> None:
    # records staged while the store is down, then the disk fills up
    ep = s3_endpoint
    bucket = ep.new_bucket()
    url = f"s3://{bucket}/p"
    stage = small_disk / "stage"
    keys = {"AWS_ACCESS_KEY_ID": ep.access_key_id, "AWS_SECRET_ACCESS_KEY": ep.secret_access_key}
    down = ["--endpoint", f"http://127.0.0.1:{closed_port()}", "--region", ep.region]
    n = 20_000
    r = tb(
        ["produce", url, "--staging", str(stage), "--timeout", "1s", *down],
        tmp_path,
        env=env_for(tmp_path, **keys),
        stdin=_lines(n),
    )
    assert r.returncode == 3 and "staged" in r.stderr, r.stderr
    with open(small_disk / "filler", "wb") as f, contextlib.suppress(OSError):
        while True:
            f.write(bytes(64 << 10))
            f.flush()
    up = ["--endpoint", ep.endpoint, "--region", ep.region]
    r = tb(["drain", str(stage), url, *up], tmp_path, env=env_for(tmp_path, **keys))
    no_traceback(r)
    assert r.returncode == 3, r.stderr
    assert "draining" not in r.stdout, "a refused drain says so, not 'draining' first"
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "full" in err[0] and "cp -a" in err[0], r.stderr
    # the hint, followed: copy the stage to a disk with room and drain it there
    copy = tmp_path / "elsewhere"
    shutil.copytree(stage, copy)
    r = tb(["drain", str(copy), url, *up], tmp_path, env=env_for(tmp_path, **keys))
    assert r.returncode == 0, r.stderr
    buf = tieredbuf.open(url, **ep.options())
    got = sum(len(b.split(b"\n")) for b in _records(buf))
    assert got == n


def _records(buf: tieredbuf.Buffer) -> list[bytes]:
    from tieredbuf.format.batch import decode_batch

    return [b"\n".join(decode_batch(buf.read_object(e))) for e in buf.entries()]
