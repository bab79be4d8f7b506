"""Idle costs nothing: over 10 s of idleness each role sends no store request (counted
exactly: by the buffer's request counter in this process, and by the S3 server for the
service)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

import tieredbuf
from tests.servers import recording_moto_server
from tests.service.server import start_server
from tieredbuf.exporter import Exporter
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


@pytest.mark.s3
def test_idle_roles_send_no_requests(tmp_path: Path) -> None:
    roles: dict[str, tuple[tieredbuf.Buffer, Callable[[], None]]] = {
        "direct producer": _direct(tmp_path),
        "staged producer": _staged(tmp_path),
        "exporter": _exporter(tmp_path),
    }
    with recording_moto_server() as (ep, rec):
        bucket = ep.new_bucket()
        rec.bucket, rec.prefix = bucket, "svc/"
        (tmp_path / "svc").mkdir()
        srv = start_server(f"s3://{bucket}/svc", tmp_path / "svc", "--max-open-duration",
                           "50ms", "--endpoint", ep.endpoint, "--region", ep.region,
                           "--allow-http", workers=1,
                           env={"AWS_ACCESS_KEY_ID": ep.access_key_id,
                                "AWS_SECRET_ACCESS_KEY": ep.secret_access_key})
        try:
            r = srv.post(b'{"warm": 1}\n', NDJSON, "remote")
            assert r.status == 200, r.body
            assert rec.seen, "the service's export reached the server"
            before = {name: buf.requests.snapshot() for name, (buf, _) in roles.items()}
            served = dict(rec.seen)
            time.sleep(IDLE_S)  # the measured idle period (not synchronisation)
            after = {name: buf.requests.snapshot() for name, (buf, _) in roles.items()}
            idle_service = {k: v - served.get(k, 0) for k, v in rec.seen.items()
                            if v != served.get(k, 0)}
        finally:
            assert srv.terminate() == 0
    for _, close in roles.values():
        close()
    sent = {name: diff(after[name], before[name]) for name in roles}
    sent["service"] = idle_service
    assert sent == {name: {} for name in sent}
