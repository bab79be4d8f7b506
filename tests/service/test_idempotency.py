"""Idempotent produce over HTTP (service/idempotency.py): the ``Idempotency-Key`` header.

A request sent again with the same key and body is stored once and answered with the
first request's result -- by the same instance, by a second instance of the service on
the same buffer (as a load balancer retries), and by the first instance after it was
SIGKILLed and restarted; the same key with another body is 422.  Real ``tieredbuf serve``
processes on a ``file://`` buffer.
"""

from __future__ import annotations

import http.client
import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from ulid import ULID

import tieredbuf
from tests.service.server import Response, Server, start_server

NDJSON = "application/x-ndjson"


def _post(
    srv: Server, body: bytes, key: str | None, durability: str = "remote", retry: bool = False
) -> Response:
    headers = {"Content-Type": NDJSON}
    if key is not None:
        headers["Idempotency-Key"] = key
    if retry:
        headers["X-Tieredbuf-Retry"] = "1"
    return srv.request("POST", f"/v1/produce?durability={durability}", body, headers)


def _stored(url: str) -> list[dict[str, Any]]:
    """Every record in the buffer (each a JSON object), in order."""
    buf = tieredbuf.open(url)
    out = []
    for e in buf.entries():
        batch = tieredbuf.ConsumedBatch(e.sequence, e.location, e.metadata, buf.read_object(e))
        out += [json.loads(r) for r in batch.entries]
    return out


def _until(cond: Any, timeout: float = 60, what: Any = lambda: "") -> Any:
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        assert time.monotonic() < deadline, f"timed out {what()}"
        time.sleep(0.1)  # polling an outcome against a deadline
    return got


@pytest.mark.slow
def test_a_request_sent_again_to_the_same_instance_is_stored_once(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/b"
    srv = start_server(url, tmp_path)
    try:
        key = str(ULID())
        first = _post(srv, b'{"n": 1}\n', key)
        assert first.status == 200, first.body
        for _ in range(3):
            again = _post(srv, b'{"n": 1}\n', key)
            assert again.status == 200, again.body
            assert (again.json()["sequence"], again.json()["object"]) == (
                first.json()["sequence"],
                first.json()["object"],
            )
        other = _post(srv, b'{"n": 2}\n', key)
        assert other.status == 422, other.body
    finally:
        srv.terminate()
    assert _stored(url) == [{"n": 1}]


@pytest.mark.slow
def test_requests_with_one_key_sent_at_once_are_stored_once(tmp_path: Path) -> None:
    """A retry while the first is still in flight waits for it and gets its result."""
    url = f"file://{tmp_path}/b"
    srv = start_server(url, tmp_path)
    key = str(ULID())
    got: list[Response] = []
    try:
        threads = [
            threading.Thread(target=lambda: got.append(_post(srv, b'{"n": 1}\n', key)))
            for _ in range(6)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        srv.terminate()
    assert [r.status for r in got] == [200] * 6
    assert len({(r.json()["sequence"], r.json()["object"]) for r in got}) == 1
    assert _stored(url) == [{"n": 1}]


@pytest.mark.slow
def test_a_retry_to_a_second_instance_on_the_buffer_is_stored_once(tmp_path: Path) -> None:
    """As a load balancer retries: the second instance finds the first request's entry
    in the queue (the client marks the request as a retry) and answers with it; the same
    key with another body is 422 there too."""
    url = f"file://{tmp_path}/b"
    (tmp_path / "a").mkdir()
    (tmp_path / "b2").mkdir()
    a = start_server(url, tmp_path / "a")
    b = start_server(url, tmp_path / "b2")
    try:
        key = str(ULID())
        first = _post(a, b'{"n": 1}\n', key)
        assert first.status == 200, first.body
        again = _post(b, b'{"n": 1}\n', key, retry=True)
        assert again.status == 200, again.body
        assert (again.json()["sequence"], again.json()["object"]) == (
            first.json()["sequence"],
            first.json()["object"],
        )
        assert _post(b, b'{"n": 2}\n', key, retry=True).status == 422
    finally:
        a.terminate()
        b.terminate()
    assert _stored(url) == [{"n": 1}]


@pytest.mark.slow
def test_a_retry_to_the_first_instance_after_a_sigkill_and_restart_is_stored_once(
    tmp_path: Path,
) -> None:
    """The first instance staged the request (LOCAL), its answer was lost, and it was
    SIGKILLed.  Restarted on its stage, it exports the request; the retry is answered
    409 while it may still be in flight, then with the first request's entry."""
    url = f"file://{tmp_path}/b"
    srv = start_server(url, tmp_path, "--max-open-duration", "60s")
    key = str(ULID())
    first = _post(srv, b'{"n": 1}\n', key, durability="local")
    assert first.status == 200, first.body
    srv.proc.send_signal(signal.SIGKILL)
    srv.proc.wait(30)
    srv = start_server(url, tmp_path)
    try:
        statuses: list[int] = []

        def answered() -> Response | None:
            r = _post(srv, b'{"n": 1}\n', key, retry=True)
            statuses.append(r.status)
            assert r.status in (200, 409), r.body
            return r if r.status == 200 else None

        again = _until(answered)
        assert again.json()["sequence"] is not None
    finally:
        srv.terminate()
    assert _stored(url) == [{"n": 1}]


@pytest.mark.slow
def test_a_malformed_key_is_refused(tmp_path: Path) -> None:
    srv = start_server(f"file://{tmp_path}/b", tmp_path)
    try:
        r = _post(srv, b'{"n": 1}\n', "has a space")
        assert r.status == 400 and b"Idempotency-Key" in r.body
    finally:
        srv.terminate()


@pytest.mark.slow
@pytest.mark.parametrize("durability", ["local", "remote"])
def test_requests_without_a_key_are_each_stored(tmp_path: Path, durability: str) -> None:
    url = f"file://{tmp_path}/b"
    srv = start_server(url, tmp_path)
    try:
        for _ in range(2):
            assert _post(srv, b'{"n": 1}\n', None, durability=durability).status == 200
    finally:
        srv.terminate()
    assert _stored(url) == [{"n": 1}, {"n": 1}]


class Client:
    """A client as tieredbuf's own retries: a fresh key per request, kept for its
    retries; an answer it did not read (here: it hung up before reading, as a lost
    response) marks every later attempt as a retry; 409, 503 and a refused connection
    are asked again after a pause, at the other instance as often as not."""

    def __init__(self, servers: list[Server], lose: float, rng: Any) -> None:
        self.servers = servers
        self.lose = lose
        self.rng = rng
        self.hung_up = 0

    def send(self, body: bytes) -> dict[str, Any]:
        key, unknown = str(ULID()), False
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            srv = self.rng.choice(self.servers)
            headers = {"Content-Type": NDJSON, "Idempotency-Key": key}
            if unknown:
                headers["X-Tieredbuf-Retry"] = "1"
            conn = http.client.HTTPConnection(srv.host, srv.port, timeout=30)
            try:
                conn.request("POST", "/v1/produce?durability=remote", body, headers)
                if self.rng.random() < self.lose:
                    self.hung_up += 1
                    unknown = True  # sent: it may be stored
                    continue
                r = conn.getresponse()
                status, data = r.status, r.read()
            except ConnectionRefusedError:  # not sent
                threading.Event().wait(0.05)  # the client's back-off, not synchronisation
                continue
            except OSError:  # reset or timed out: maybe sent
                unknown = True
                threading.Event().wait(0.05)  # the client's back-off, not synchronisation
                continue
            finally:
                conn.close()
            if status == 200:
                return dict(json.loads(data))
            assert status in (409, 503, 504), (status, data)
            unknown = unknown or status == 504
            threading.Event().wait(0.05)  # the client's back-off, not synchronisation
        raise AssertionError(f"{body!r} never acknowledged")


@pytest.mark.slow
def test_every_acknowledged_request_is_stored_once_through_lost_answers_and_a_sigkill(
    tmp_path: Path,
) -> None:
    """Two instances on one buffer; eight clients retry through answers they hang up on
    (lost responses), 409s and 503s, while one instance is SIGKILLed and started again
    on its stage.  Every acknowledged request is stored exactly once, at the sequence
    and object its answer named."""
    import random

    url = f"file://{tmp_path}/b"
    for d in ("a", "b2"):
        (tmp_path / d).mkdir()
    servers = [start_server(url, tmp_path / "a"), start_server(url, tmp_path / "b2")]
    acked: dict[str, dict[str, Any]] = {}
    rng = random.Random(36)
    clients = [Client(servers, 0.2, random.Random(rng.random())) for _ in range(8)]
    stop = threading.Event()

    def run(i: int, c: Client) -> None:
        j = 0
        while not stop.is_set():
            rec = f"c{i}:{j}"
            acked[rec] = c.send(json.dumps({"r": rec}).encode() + b"\n")
            j += 1

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(clients)]
    for t in threads:
        t.start()
    try:
        progress = lambda: f"at {len(acked)} acknowledged"  # noqa: E731
        _until(lambda: len(acked) >= 100, 120, progress)
        victim = servers[0]
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(30)
        threading.Event().wait(3)  # down a while, as before an orchestrator restarts it
        servers[0] = start_server(url, tmp_path / "a")
        _until(lambda: len(acked) >= 400, 120, progress)
    finally:
        stop.set()
        for t in threads:
            t.join(180)
        for s in servers:
            s.terminate()
    stored: dict[str, list[int]] = {}
    buf = tieredbuf.open(url)
    for e in buf.entries():
        batch = tieredbuf.ConsumedBatch(e.sequence, e.location, e.metadata, buf.read_object(e))
        for r in batch.entries:
            stored.setdefault(json.loads(r)["r"], []).append(e.sequence)
    assert sum(c.hung_up for c in clients) > 20  # the answers lost
    twice = {r: s for r, s in stored.items() if len(s) > 1}
    assert not twice, f"stored more than once: {list(twice.items())[:5]}"
    for rec, answer in acked.items():
        assert stored.get(rec) == [answer["sequence"]], (rec, answer, stored.get(rec))
