"""Idle costs nothing: over 10 s of idleness each role sends no store request (counted
exactly: by the buffer's request counter in this process, and by the S3 server for the
service); a consumer waiting in ``next_batch(timeout=...)`` (default and named
subscriber) sends at most 0.5 a second, each a 22-byte footer read.

Idleness starts once every producer's commit lease has lapsed: a holder takes its turns,
a LIST an interval, while its lease lives, so that a writer elsewhere that announced is
committed instead of racing for a lapsed lease (tieredbuf/produce/fanin.py) -- two to
seven LISTs after the last write (a lease of two periods, 1.4 s at most), then none."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import tieredbuf
from tests.servers import recording_moto_server
from tests.service.server import start_server
from tieredbuf.produce.exporter import Exporter
from tieredbuf.service.bodies import NDJSON
from tieredbuf.stage.stage import Stage
from tieredbuf.store.counting import diff

IDLE_S = 10.0


def _direct(tmp_path: Path) -> tuple[tieredbuf.Buffer, Callable[[], None]]:
    buf = tieredbuf.open(f"file://{tmp_path}/direct")
    p = buf.producer()
    p.produce([b"warm"]).wait(timeout=30)  # it has worked; now it idles
    return buf, p.close


def _staged(tmp_path: Path) -> tuple[tieredbuf.Buffer, Callable[[], None]]:
    buf = tieredbuf.open(f"file://{tmp_path}/staged")
    p = buf.producer(staging_dir=tmp_path / "stage")
    p.produce([b"warm"])
    p.flush()  # sealed, exported, released
    return buf, p.close


def _exporter(tmp_path: Path) -> tuple[tieredbuf.Buffer, Callable[[], None]]:
    buf = tieredbuf.open(f"file://{tmp_path}/exporter")
    stage = Stage(tmp_path / "bare-stage")
    ex = Exporter(stage, buf.store, buf.queue)

    def close() -> None:
        ex.stop()
        stage.close()

    return buf, close


def _consumer(tmp_path: Path, subscriber: str) -> tuple[tieredbuf.Buffer, Callable[[], None]]:
    """A consumer at the tail calling next_batch(timeout=1) in a loop, as an application
    waiting for records would; returned once its backoff has reached its cap."""
    buf = tieredbuf.open(f"file://{tmp_path}/consumer-{subscriber}")
    with buf.producer() as p:
        p.produce([b"warm"]).wait(timeout=30)
    c = buf.consumer(subscriber=subscriber)
    c.initialize()
    stop = threading.Event()
    got: list[object] = []

    def loop() -> None:
        while not stop.is_set():
            b = c.next_batch(timeout=1.0)
            if b is not None:
                got.append(b)
                c.ack(b.sequence)

    t = threading.Thread(target=loop)
    t.start()
    deadline = time.monotonic() + 60
    while c._poll.footer_reads < 5:
        assert time.monotonic() < deadline and t.is_alive()
        time.sleep(0.05)
    assert len(got) == 1

    def close() -> None:
        stop.set()
        t.join(timeout=30)
        c.close()

    return buf, close


POLLERS = ("consumer (default)", "consumer (named subscriber)")


def _until_leases_lapsed(bufs: list[tieredbuf.Buffer]) -> None:
    """Wait out the last commit lease of these buffers and a commit interval after it (a
    turn that started before the lapse ends with one more LIST)."""
    ends = [lease.expires_ms for b in bufs if (lease := b.snapshot().root.lease) is not None]
    if ends:
        time.sleep(max(0.0, max(ends) / 1000 + 0.5 - time.time()))  # a known deadline


@pytest.mark.s3
@pytest.mark.slow
def test_idle_roles_send_no_requests(tmp_path: Path) -> None:
    roles: dict[str, tuple[tieredbuf.Buffer, Callable[[], None]]] = {
        "direct producer": _direct(tmp_path),
        "staged producer": _staged(tmp_path),
        "exporter": _exporter(tmp_path),
        "consumer (default)": _consumer(tmp_path, "default"),
        "consumer (named subscriber)": _consumer(tmp_path, "etl"),
    }
    with recording_moto_server() as (ep, rec):
        bucket = ep.new_bucket()
        rec.bucket, rec.prefix = bucket, "svc/"
        (tmp_path / "svc").mkdir()
        srv = start_server(
            f"s3://{bucket}/svc",
            tmp_path / "svc",
            "--max-open-duration",
            "50ms",
            "--endpoint",
            ep.endpoint,
            "--region",
            ep.region,
            "--allow-http",
            workers=1,
            env={
                "AWS_ACCESS_KEY_ID": ep.access_key_id,
                "AWS_SECRET_ACCESS_KEY": ep.secret_access_key,
            },
        )
        try:
            r = srv.post(b'{"warm": 1}\n', NDJSON, "remote")
            assert r.status == 200, r.body
            svc = tieredbuf.open(f"s3://{bucket}/svc", **ep.options())
            _until_leases_lapsed([buf for buf, _ in roles.values()] + [svc])
            assert rec.seen, "the service's export reached the server"
            before = {name: buf.requests.snapshot() for name, (buf, _) in roles.items()}
            served = dict(rec.seen)
            time.sleep(IDLE_S)  # the measured idle period (not synchronisation)
            after = {name: buf.requests.snapshot() for name, (buf, _) in roles.items()}
            idle_service = {
                k: v - served.get(k, 0) for k, v in rec.seen.items() if v != served.get(k, 0)
            }
        finally:
            assert srv.terminate() == 0
    for _, close in roles.values():
        close()
    sent = {name: diff(after[name], before[name]) for name in roles}
    sent["service"] = idle_service
    for name in POLLERS:  # at most 0.5/s, each a footer read (a ranged GET of the root)
        polls = sent.pop(name)
        assert set(polls) <= {("get_range", "root")}, (name, polls)
        assert sum(polls.values()) <= 0.5 * IDLE_S, (name, polls)
    assert sent == {name: {} for name in sent}
