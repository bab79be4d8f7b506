"""Several producer *processes* append concurrently against a real object store over HTTP:
moto and SeaweedFS (S3), Azurite (Azure Blob), fake-gcs-server (GCS)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import tieredbuf
from tests.endpoint import AzureEndpoint, GCSEndpoint

WORKER = Path(__file__).with_name("producer_worker.py")


def _run_producers(url: str, opts: dict, names: list[str], n: int) -> list[subprocess.Popen[str]]:  # type: ignore[type-arg]
    return [
        subprocess.Popen(
            [sys.executable, str(WORKER), url, json.dumps(opts), name, str(n)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in names
    ]


def _check_exactly_once_in_order(
    batches: list[tuple[int, list[bytes]]], names: list[str], n: int
) -> None:
    seqs = [s for s, _ in batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "I3: contiguous, increasing"
    seen: dict[str, list[int]] = {name: [] for name in names}
    for _, records in batches:
        for r in records:
            name, i = r.decode().split(":")
            seen[name].append(int(i))
    for name in names:
        assert seen[name] == list(range(n)), f"{name}: every record exactly once, in order"


def _consume_until(buf: tieredbuf.Buffer, total: int, procs: list) -> list[tuple[int, list[bytes]]]:  # type: ignore[type-arg]
    buf.create()  # the producers may not have created it yet: a consumer never does
    c = buf.consumer()
    c.initialize()
    out: list[tuple[int, list[bytes]]] = []
    count = 0
    while count < total:
        b = c.next_batch()
        if b is None:
            if all(p.poll() is not None for p in procs):
                b = c.next_batch()  # everything is in the manifest now
                if b is None:
                    break
            else:
                continue
        out.append((b.sequence, b.entries))
        count += len(b.entries)
        c.ack(b.sequence)
    c.flush()
    c.close()
    return out


@pytest.mark.parametrize(
    "server",
    [
        pytest.param("s3_endpoint", marks=pytest.mark.s3),
        pytest.param("seaweedfs_endpoint", marks=pytest.mark.s3),
        pytest.param("azurite_endpoint", marks=pytest.mark.azure),
        pytest.param("gcs_endpoint", marks=pytest.mark.gcs),
    ],
)
@pytest.mark.slow
def test_I2_I3_four_producer_processes_one_consumer_exactly_once_in_order(
    server: str, request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]
) -> None:
    endpoint = request.getfixturevalue(server)
    if isinstance(endpoint, AzureEndpoint):
        url = f"az://{endpoint.new_container()}/buf"
    elif isinstance(endpoint, GCSEndpoint):
        url = f"gs://{endpoint.new_bucket()}/buf"
    else:
        url = f"s3://{endpoint.new_bucket()}/buf"
    opts = endpoint.options()
    names, n = ["p0", "p1", "p2", "p3"], 200
    procs = _run_producers(url, opts, names, n)
    buf = tieredbuf.open(url, **opts)
    batches = _consume_until(buf, len(names) * n, procs)
    stats = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        stats.append(json.loads(out.strip().splitlines()[-1]))
    _check_exactly_once_in_order(batches, names, n)
    assert buf.snapshot().footer.entry_count == 0  # all dequeued
    conflicts = sum(s.get("conflicts", 0) for s in stats)
    commits = sum(s.get("commits", 0) for s in stats)
    appended = sum(s.get("entries_appended", 0) for s in stats)
    with capsys.disabled():
        print(
            f"\n4 producer processes on {server}: {appended} entries in {commits} commits, "
            f"{conflicts} CAS conflicts retried"
        )
    assert appended == len(batches) == len(names) * n // 5  # one entry per awaited call
    assert commits < appended  # fan-in: a commit carries several writers' entries


@pytest.mark.slow
def test_I2_concurrent_producer_processes_on_a_local_directory(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/buf"
    names, n = ["a", "b", "c"], 60
    procs = _run_producers(url, {}, names, n)
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    buf = tieredbuf.open(url)
    batches = _consume_until(buf, len(names) * n, [])
    _check_exactly_once_in_order(batches, names, n)
