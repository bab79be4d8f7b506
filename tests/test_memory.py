"""Invariant I8 for readers: read-ahead holds at most ``read_ahead_bytes`` beside the object
being served (docs/operations.md, "Reader memory").

A reader process (tests/rss_reader.py) drains a buffer of large entries, dropping each
batch before it asks for the next, and reports its peak resident set size above what it
held when it was ready to read (Linux's VmHWM, reset at that moment).  The bound is
``read_ahead_bytes`` plus one object: objects fetched ahead fit in the budget, an object
larger than the budget is fetched only when asked for, and a large object's ranged parts
are read straight into one buffer of its size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ulid import ULID

import tieredbuf
from tests.endpoint import S3Endpoint
from tieredbuf import keys
from tieredbuf.format.batch import encode_batch
from tieredbuf.format.manifest import MetadataItem, NewEntry

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux VmHWM"),
]


def _fill(url: str, opts: dict[str, Any], n: int, size: int) -> None:
    """``n`` entries of one object of exactly ``size`` bytes each (the same bytes)."""
    buf = tieredbuf.open(url, **opts)
    body = encode_batch([os.urandom(size - 11)])
    assert len(body) == size
    for i in range(n):
        key = keys.data_key(ULID())
        buf.store.put(key, body, mode="create")
        now = time.time_ns() // 1_000_000
        buf.queue.append([NewEntry(key, (MetadataItem(0, now, b""),), size)], "fill", i + 1)
    buf.close()


@pytest.fixture(scope="module")
def local_buffers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, str]]:
    """12 x 64 MiB and 3 x 300 MiB entries in local directories (the issue's rows)."""
    base = tmp_path_factory.mktemp("rss")
    urls = {64: f"file://{base}/b64", 300: f"file://{base}/b300"}
    _fill(urls[64], {}, 12, 64 * MiB)
    _fill(urls[300], {}, 3, 300 * MiB)
    yield urls


def _read(url: str, opts: dict[str, Any], budget: int, role: str = "consumer") -> dict[str, int]:
    """Drain ``url`` in a reader process of its own; its counts and RSS figures."""
    code = (
        "import sys, tieredbuf, tests.rss_reader as r\n"
        f"opened = tieredbuf.open\n"
        f"tieredbuf.open = lambda url: opened(url, **{opts!r})\n"
        f"sys.argv = ['rss_reader', {url!r}, '{budget}', {role!r}]\n"
        "r.main()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env
    )
    assert p.returncode == 0, p.stderr[-3000:]
    got: dict[str, int] = json.loads(p.stdout.strip().splitlines()[-1])
    return got


ROWS = [
    pytest.param(64, 12, 128 * MiB, id="12x64MiB-budget128MiB"),
    pytest.param(64, 12, 16 * MiB, id="12x64MiB-budget16MiB"),
    pytest.param(300, 3, 128 * MiB, id="3x300MiB-budget128MiB"),
    pytest.param(300, 3, 16 * MiB, id="3x300MiB-budget16MiB"),
]


@pytest.mark.parametrize(("mib", "n", "budget"), ROWS)
def test_I8_a_consumers_read_ahead_stays_within_its_budget_plus_the_object_served(
    local_buffers: dict[int, str], mib: int, n: int, budget: int
) -> None:
    got = _read(local_buffers[mib], {}, budget)
    assert got["entries"] == n and got["bytes"] == n * mib * MiB
    growth = got["peak"] - got["base"]
    print(f"{n} x {mib} MiB, budget {budget // MiB} MiB: +{growth / MiB:.0f} MiB")
    assert growth <= budget + mib * MiB


def test_I8_a_workers_read_ahead_stays_within_its_budget_plus_the_object_served(
    local_buffers: dict[int, str],
) -> None:
    got = _read(local_buffers[64], {}, 16 * MiB, role="worker")
    assert got["entries"] == 12
    assert got["peak"] - got["base"] <= 16 * MiB + 64 * MiB


@pytest.mark.s3
@pytest.mark.parametrize(
    ("mib", "n", "budget"),
    [
        pytest.param(64, 4, 128 * MiB, id="4x64MiB-budget128MiB"),  # ranged parts
        pytest.param(64, 4, 16 * MiB, id="4x64MiB-budget16MiB"),
        pytest.param(24, 8, 128 * MiB, id="8x24MiB-budget128MiB"),  # whole GETs ahead
    ],
)
def test_I8_read_ahead_from_s3_stays_within_its_budget_plus_the_object_served(
    s3_endpoint: S3Endpoint, mib: int, n: int, budget: int
) -> None:
    """Over HTTP (moto, in this test's process: its memory is not the reader's): a
    response body is streamed into the object's buffer, never held whole on the way."""
    url = f"s3://{s3_endpoint.new_bucket()}/buf"
    opts = dict(s3_endpoint.options())
    _fill(url, opts, n, mib * MiB)
    got = _read(url, opts, budget)
    assert got["entries"] == n
    growth = got["peak"] - got["base"]
    print(f"S3 {n} x {mib} MiB, budget {budget // MiB} MiB: +{growth / MiB:.0f} MiB")
    assert growth <= budget + mib * MiB
