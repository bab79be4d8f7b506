"""No lost update under cross-process CAS: N processes x K read-increment-CAS loops on
one counter object end at exactly N*K (local directory: flock; S3: If-Match)."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import S3Endpoint
from tests.store import cas_worker
from tieredbuf.store import open_store

N = 4


def _run_counter(url: str, options: dict[str, Any], k: int) -> int:
    store = open_store(url, **options)
    store.put("queue/counter", b"0", mode="create")
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(N)
    out = ctx.Queue()
    procs = [
        ctx.Process(
            target=cas_worker.increment, args=(url, options, "queue/counter", k, barrier, out)
        )
        for _ in range(N)
    ]
    for p in procs:
        p.start()
    conflicts = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    final = int(store.get("queue/counter").data)
    store.close()
    assert final == N * k, f"lost or duplicated updates: {final} != {N * k} (conflicts {conflicts})"
    return sum(conflicts)


def test_localdir_cas_counter_across_processes_loses_no_update(tmp_path: Path) -> None:
    _run_counter((tmp_path / "store").as_uri(), {}, k=50)


@pytest.mark.s3
def test_moto_cas_counter_across_processes_loses_no_update(s3_endpoint: S3Endpoint) -> None:
    opts: dict[str, Any] = dict(s3_endpoint.options())
    opts.update(max_retries=2, retry_timeout=10)
    _run_counter(f"s3://{s3_endpoint.new_bucket()}/buf", opts, k=15)
