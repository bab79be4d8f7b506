"""``tieredbuf serve`` as a real process: ingest, bad input, SIGTERM drain (I1), S3."""

from __future__ import annotations

import http.client
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pytest

import tieredbuf
from tests.endpoint import AzureEndpoint, S3Endpoint
from tests.service.server import Server
from tests.service.util import (
    FAST,
    arrow_stream,
    consume_all,
    ndjson,
    octets,
    samples,
    settled_stage_files,
    stage_files,
)
from tieredbuf.service.bodies import ARROW_STREAM, NDJSON, OCTET_STREAM
from tieredbuf.store import open_store

Serve = Callable[..., Server]


@pytest.mark.slow
def test_I1_records_and_arrow_at_both_durabilities_end_up_consumable(
    tmp_path: Path, serve: Serve
) -> None:
    url = f"file://{tmp_path}/buf"
    srv = serve(url, *FAST, workers=2)
    expect: set[bytes] = set()
    remote_objects: dict[int, str] = {}
    for dur in ("local", "remote"):
        recs = [{"k": f"{dur}-nd-{i}"} for i in range(5)]
        r = srv.post(ndjson(recs), NDJSON, dur)
        assert r.status == 200, r.body
        assert r.json()["records"] == 5 and r.json()["durability"] == dur
        expect |= {f'{{"k":"{dur}-nd-{i}"}}'.encode() for i in range(5)}
        raw = [f"{dur}-bin-{i}".encode() + b"\x00\xff" for i in range(3)]
        r = srv.post(octets(raw), OCTET_STREAM, dur)
        assert r.status == 200 and r.json()["records"] == 3, r.body
        expect |= set(raw)
        if dur == "remote":
            remote_objects[r.json()["sequence"]] = r.json()["object"]
    schema = pa.schema([("id", pa.int64()), ("name", pa.string())])
    sent_rows: list[int] = []
    for dur, base in (("local", 0), ("remote", 100)):
        batches = [
            pa.record_batch(
                [pa.array([base + i, base + i + 1]), pa.array(["a", "b"])], schema=schema
            )
            for i in (0, 10)
        ]
        r = srv.post(arrow_stream(batches), ARROW_STREAM, dur)
        assert r.status == 200, r.body
        assert r.json() == {**r.json(), "bundles": 1, "rows": 4, "batches": 2}
        if dur == "remote":
            remote_objects[r.json()["sequence"]] = r.json()["object"]
            assert r.json()["object"].endswith(".qseg")
        sent_rows += [base, base + 1, base + 10, base + 11]
    assert srv.terminate() == 0, srv.logs()  # drains: LOCAL-acked data is exported too

    records, bundles, seen = consume_all(url)
    assert sorted(records) == sorted(expect), "every record once"
    assert sorted(v for b in bundles for v in b.column("id").to_pylist()) == sorted(sent_rows)
    assert all(b.schema.equals(schema) for b in bundles)
    by_seq = {b.sequence: b.location for b in seen}
    for seq, obj in remote_objects.items():
        assert by_seq[seq] == obj, "the response names the sequence and object"
    for w in (srv.stage / "worker-0", srv.stage / "worker-1"):
        assert not [p for p in w.rglob("segments/*") if p.suffix in (".batch", ".qseg")]


@pytest.mark.slow
def test_bad_input_gets_its_4xx_and_leaves_nothing_behind(tmp_path: Path, serve: Serve) -> None:
    url = f"file://{tmp_path}/buf"
    srv = serve(url, *FAST, "--max-body", "4k")
    assert srv.post(ndjson([{"warm": 1}]), NDJSON, "remote").status == 200
    buf = tieredbuf.open(url)
    before_seq = buf.snapshot().footer.next_sequence
    before_stage = settled_stage_files(srv.stage)  # the warm-up segment released
    good_arrow = arrow_stream([pa.record_batch([pa.array([1, 2, 3])], names=["x"])])
    cases: list[tuple[str, bytes, str | None, str | None, int]] = [
        ("wrong content type", b'{"a":1}\n', "text/plain", "local", 415),
        ("no content type", b'{"a":1}\n', None, "local", 415),
        ("oversized body", ndjson([{"pad": "x" * 100}] * 50), NDJSON, "local", 413),
        ("oversized octets", octets([b"y" * 5000]), OCTET_STREAM, "remote", 413),
        (
            "corrupt arrow",
            good_arrow[: len(good_arrow) // 2] + b"\x00" * 9,
            ARROW_STREAM,
            "local",
            400,
        ),
        ("not arrow at all", b"hello world, not IPC", ARROW_STREAM, "remote", 400),
        ("unknown durability", b'{"a":1}\n', NDJSON, "everywhere", 400),
        ("bad json after good lines", b'{"a":1}\n{"b":2}\n{oops\n', NDJSON, "local", 400),
        ("truncated length prefix", octets([b"abc"]) + b"\x01\x00", OCTET_STREAM, "local", 400),
        ("length past the end", b"\xff\x00\x00\x00abc", OCTET_STREAM, "local", 400),
        ("empty body", b"", NDJSON, "local", 400),
        ("empty arrow stream", b"", ARROW_STREAM, "local", 400),
    ]
    for name, body, ctype, dur, status in cases:
        r = srv.post(body, ctype, dur)
        assert r.status == status, (name, r.status, r.body)
        assert r.json()["status"] == status and r.json()["error"], name
    assert stage_files(srv.stage) == before_stage, "nothing staged"
    ok = srv.post(ndjson([{"after": 1}]), NDJSON, "remote")
    assert ok.status == 200, "the server still works"
    assert ok.json()["sequence"] == before_seq, "no manifest entry was added by a bad request"
    assert srv.terminate() == 0
    records, _, _ = consume_all(url)
    assert records == [b'{"warm":1}', b'{"after":1}']


@pytest.mark.slow
def test_backpressure_answers_503_with_retry_after(tmp_path: Path, serve: Serve) -> None:
    # An object store nobody listens on: nothing is exported, so the stage fills up.
    srv = serve(
        "s3://nowhere/buf",
        "--endpoint",
        "http://127.0.0.1:9",
        "--allow-http",
        "--region",
        "us-east-1",
        "--size-cap",
        "64k",
        "--backpressure-wait",
        "50ms",
        "--drain-timeout",
        "1s",
        "--shutdown-timeout",
        "1s",
        env={"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y"},
    )
    body = octets([b"z" * 1000] * 10)
    codes = [srv.post(body, OCTET_STREAM, "local").status for _ in range(12)]
    assert 200 in codes and codes[-1] == 503, codes
    r = srv.post(body, OCTET_STREAM, "local")
    assert r.status == 503 and r.headers["retry-after"] == "1"
    assert "backpressure" in r.json()["error"]
    assert samples(srv.metrics())["tieredbuf_service_backpressure_rejections_total"] >= 2
    # the drain times out (store unreachable): exit 1, and the data stays staged (LOCAL)
    assert srv.terminate() == 1
    assert any(p.suffix == ".batch" for p in srv.stage.rglob("segments/*"))


class Acks:
    """Records acknowledged (2xx) to the load threads; wait_for() blocks on a condition."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.records: list[bytes] = []

    def add(self, recs: list[bytes]) -> None:
        with self.cond:
            self.records.extend(recs)
            self.cond.notify_all()

    def wait_for(self, n: int, timeout: float) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.records) >= n, timeout), len(self.records)


def _load(srv: Server, thread: int, acks: Acks, stop: threading.Event) -> None:
    i = 0
    while not stop.is_set():
        recs = [f"t{thread}-r{i}-{j}".encode() for j in range(5)]
        dur = "remote" if i % 3 == 0 else "local"
        try:
            conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
            conn.request(
                "POST",
                f"/v1/produce?durability={dur}",
                octets(recs),
                {"Content-Type": OCTET_STREAM},
            )
            resp = conn.getresponse()
            resp.read()
            conn.close()
        except OSError:
            return  # the server went away: this request was not acknowledged
        if resp.status == 200:
            acks.add(recs)
        i += 1


@pytest.mark.slow
def test_I1_sigterm_under_load_loses_no_acknowledged_record(tmp_path: Path, serve: Serve) -> None:
    url = f"file://{tmp_path}/buf"
    srv = serve(url, "--max-open-duration", "100ms", workers=2)
    acks = Acks()
    stop = threading.Event()
    threads = [threading.Thread(target=_load, args=(srv, i, acks, stop)) for i in range(6)]
    for t in threads:
        t.start()
    try:
        acks.wait_for(600, timeout=60)
        srv.proc.send_signal(signal.SIGTERM)  # while the clients keep sending
        rc = srv.proc.wait(120)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert rc == 0, srv.logs()
    with acks.cond:
        got = list(acks.records)
    records, _, _ = consume_all(url)
    assert len(records) == len(set(records)), "a record was delivered twice"
    missing = set(got) - set(records)
    assert not missing, f"I1: {len(missing)} acknowledged records lost, e.g. {sorted(missing)[:5]}"
    assert not [p for p in srv.stage.rglob("segments/*") if p.suffix in (".batch", ".qseg")]


@pytest.mark.slow
@pytest.mark.s3
def test_service_on_s3_remote_acks_name_the_object(
    tmp_path: Path, serve: Serve, s3_endpoint: S3Endpoint
) -> None:
    bucket = s3_endpoint.new_bucket()
    url = f"s3://{bucket}/svc"
    srv = serve(
        url,
        *FAST,
        "--endpoint",
        s3_endpoint.endpoint,
        "--region",
        s3_endpoint.region,
        "--allow-http",
        env={
            "AWS_ACCESS_KEY_ID": s3_endpoint.access_key_id,
            "AWS_SECRET_ACCESS_KEY": s3_endpoint.secret_access_key,
        },
    )
    r = srv.post(ndjson([{"i": i} for i in range(20)]), NDJSON, "remote")
    assert r.status == 200, r.body
    head = s3_endpoint.boto3_client().head_object(Bucket=bucket, Key=f"svc/{r.json()['object']}")
    assert head["ContentLength"] > 0
    assert srv.terminate() == 0
    records, _, _ = consume_all(url, **s3_endpoint.options())
    assert records == [f'{{"i":{i}}}'.encode() for i in range(20)]


@pytest.mark.slow
@pytest.mark.azure
def test_service_on_azure_remote_acks_name_the_object(
    tmp_path: Path, serve: Serve, azurite_endpoint: AzureEndpoint
) -> None:
    container = azurite_endpoint.new_container()
    url = f"az://{container}/svc"
    srv = serve(
        url,
        *FAST,
        "--endpoint",
        azurite_endpoint.endpoint,
        env={
            "AZURE_STORAGE_ACCOUNT_NAME": azurite_endpoint.account_name,
            "AZURE_STORAGE_ACCOUNT_KEY": azurite_endpoint.account_key,
        },
    )
    r = srv.post(ndjson([{"i": i} for i in range(20)]), NDJSON, "remote")
    assert r.status == 200, r.body
    store = open_store(f"az://{container}/svc", **azurite_endpoint.options())
    assert store.head(r.json()["object"]).size > 0
    assert srv.terminate() == 0
    records, _, _ = consume_all(url, **azurite_endpoint.options())
    assert records == [f'{{"i":{i}}}'.encode() for i in range(20)]


@pytest.mark.slow
def test_I1_a_killed_worker_is_restarted_and_recovers_its_stage(
    tmp_path: Path, serve: Serve
) -> None:
    url = f"file://{tmp_path}/buf"
    # seal rarely, so the acked records are only in the WAL when the worker dies
    srv = serve(url, "--max-open-duration", "1h")
    first = srv.request("GET", "/healthz").json()["pid"]
    acked = []
    for i in range(5):
        r = srv.post(octets([f"before-kill-{i}".encode()]), OCTET_STREAM, "local")
        assert r.status == 200
        acked.append(f"before-kill-{i}".encode())
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while True:  # poll health against a deadline until the restarted worker answers
        try:
            h = srv.request("GET", "/healthz", timeout=2)
            if h.status == 200 and h.json()["pid"] != first:
                break
        except OSError:
            pass
        assert time.monotonic() < deadline, srv.logs()
        time.sleep(0.05)
    assert "exited with -9: restarting" in srv.logs()
    assert srv.post(octets([b"after"]), OCTET_STREAM, "local").status == 200
    assert srv.terminate() == 0
    records, _, _ = consume_all(url)
    assert sorted(records) == sorted([*acked, b"after"]), "replayed from the WAL, once"
