"""The service producer against real ``tieredbuf serve`` processes: REMOTE outcomes name
the entries that hold the records (I10), batching, metadata, durability=local, bearer
tokens and their rotation, TLS, retries through lost answers and 503s."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest

import tieredbuf
from tests.client.front import LOSE, PASS, Front, Status
from tests.service.server import Server
from tests.service.util import FAST, self_signed
from tieredbuf.errors import (
    RemoteNotRequestedError,
    ServiceRefusedError,
    ServiceUnavailableError,
)
from tieredbuf.produce.handles import RemoteOutcome, WriteHandle

Start = Callable[..., Server]
MakeFront = Callable[..., Front]
TOKEN = "client-test-token-0123456789"


def entries_by_sequence(url: str) -> dict[int, tieredbuf.ConsumedBatch]:
    buf = tieredbuf.open(url)
    c = buf.consumer()
    c.initialize()
    out = {}
    while (b := c.next_batch()) is not None:
        out[b.sequence] = b
    c.close()
    buf.close()
    return out


def check_remote(
    url: str, sent: list[tuple[WriteHandle, list[bytes]]], unknown_ok: bool = False
) -> tuple[dict[int, tieredbuf.ConsumedBatch], Counter[bytes]]:
    """I10: every handle is REMOTE, and the entry its outcome names -- by sequence, with
    that very data object -- holds its records.  With ``unknown_ok`` a handle may instead
    have failed saying its request may have been stored (an instance died with it
    unstaged: ServiceUnavailableError); its records are then stored once or not at all.
    Returns the entries and how often each record is in the queue."""
    queue = entries_by_sequence(url)
    stored: Counter[bytes] = Counter()
    for b in queue.values():
        stored.update(b.entries)
    for h, records in sent:
        if unknown_ok and h.watcher.level is None:
            with pytest.raises(ServiceUnavailableError) as e:
                h.wait(timeout=0)
            assert e.value.may_have_landed
            assert all(stored[r] <= 1 for r in records)
            continue
        out = h.wait(timeout=0)
        assert isinstance(out, RemoteOutcome)
        entry = queue.get(out.sequence)
        assert entry is not None, f"no entry {out.sequence} in the queue"
        assert entry.location == out.location
        held = Counter(entry.entries)
        assert all(held[r] for r in records), f"entry {out.sequence} lacks {records}"
    return queue, stored


@pytest.mark.slow
def test_I10_remote_outcomes_name_the_entries_holding_the_records(
    tmp_path: Path, instances: Start, front: MakeFront
) -> None:
    """Calls within a flush interval share one request; each call's handle is REMOTE
    with the entry holding its records, bytes as given (any byte, empty records too);
    a call with other metadata is a request of its own, one metadata item each."""
    url = f"file://{tmp_path}/buf"
    srv = instances(url, *FAST)
    f = front(srv)
    sent: list[tuple[WriteHandle, list[bytes]]] = []
    with tieredbuf.service_producer(f.url, flush_interval=timedelta(milliseconds=200)) as p:
        for i in range(40):
            recs = [f"r{i}".encode(), bytes(range(256)), b""]
            sent.append((p.produce(recs, metadata=b"first"), recs))
        tail = [b"\xff\x00tail"]
        sent.append((p.produce(tail, metadata="zweite Ära".encode()), tail))
        for h, _ in sent:
            h.wait(timeout=60)
    queue, stored = check_remote(url, sent)
    assert len(f.attempts()) < 10  # 41 calls: batched (one request per cut, not per call)
    assert stored == Counter(r for _, recs in sent for r in recs)  # each once: no retry here
    items = [(m.payload, b.entries[m.start_index]) for b in queue.values() for m in b.metadata]
    assert (b"first", b"r0") in items
    assert ("zweite Ära".encode(), b"\xff\x00tail") in items


@pytest.mark.slow
def test_retries_through_lost_answers_and_503s_carry_one_key_and_are_stored_once(
    tmp_path: Path, instances: Start, front: MakeFront
) -> None:
    """An answer lost after the service stored the request, and 503s, are retried under
    the same key and body, marked as retries once an answer was lost; the service answers
    them from the first request: every handle ends REMOTE at an entry holding its
    records, each stored once."""
    url = f"file://{tmp_path}/buf"
    srv = instances(url, *FAST)
    f = front(srv)
    busy = Status(503, "0", "backpressure: the stage is at its cap")
    f.script(LOSE, busy, PASS, busy, LOSE)
    sent = []
    with tieredbuf.service_producer(
        f.url, flush_interval=timedelta(milliseconds=1), max_in_flight=1
    ) as p:
        for i in range(4):
            recs = [f"call-{i}".encode()]
            sent.append((p.produce(recs), recs))
            sent[-1][0].wait(timeout=60)
    _, stored = check_remote(url, sent)
    assert stored == Counter(r for _, recs in sent for r in recs)  # each exactly once
    by_key: dict[str | None, set[str]] = {}
    for s in f.attempts():
        by_key.setdefault(s.key, set()).add(s.body_sha)
    assert len(by_key) == 4 and all(len(bodies) == 1 for bodies in by_key.values())
    seen = f.attempts()
    assert len(seen) == 4 + 4  # two lost answers, two 503s: each retried once
    for attempts in by_key:  # marked as retries after a lost answer, not after a 503
        mine = [s for s in seen if s.key == attempts]
        lost = next((i + 1 for i, s in enumerate(mine) if s.action == LOSE), len(mine))
        marks = [s.headers.get("x-tieredbuf-retry") for s in mine]
        assert marks == [None] * lost + ["1"] * (len(mine) - lost), marks
    assert sum(s.headers.get("x-tieredbuf-retry") == "1" for s in seen) >= 2


@pytest.mark.slow
def test_durability_local_reaches_local_and_says_remote_was_not_asked(
    tmp_path: Path, instances: Start
) -> None:
    url = f"file://{tmp_path}/buf"
    srv = instances(url, *FAST)
    with tieredbuf.service_producer(f"http://{srv.host}:{srv.port}", durability="local") as p:
        h = p.produce([b"a"])
        assert (
            h.wait(tieredbuf.Durability.LOCAL, timeout=60).durability == tieredbuf.Durability.LOCAL
        )
        with pytest.raises(RemoteNotRequestedError):
            h.wait(timeout=10)
    srv.terminate()  # drains: the record reaches the queue all the same
    assert [b.entries for b in entries_by_sequence(url).values()] == [[b"a"]]


@pytest.mark.slow
def test_bearer_token_from_a_file_rotated_without_a_restart(
    tmp_path: Path, instances: Start, front: MakeFront
) -> None:
    url = f"file://{tmp_path}/buf"
    srv = instances(
        url, *FAST, env={"TIEREDBUF_SERVICE_TOKENS": f"{TOKEN},{TOKEN}-new"}, token=TOKEN
    )
    f = front(srv)
    token_file = tmp_path / "token"
    token_file.write_text(f"# the client's token\n{TOKEN}\n")
    with tieredbuf.service_producer(f.url, token_file=str(token_file)) as p:
        p.produce([b"old"]).wait(timeout=60)
        token_file.write_text(f"{TOKEN}-new\n")
        p.produce([b"new"]).wait(timeout=60)
    assert [s.headers["authorization"] for s in f.attempts()] == [
        f"Bearer {TOKEN}",
        f"Bearer {TOKEN}-new",
    ]
    wrong = tieredbuf.service_producer(f.url, token="not-the-token-0123456789")
    with pytest.raises(ServiceRefusedError, match="403") as e:
        wrong.produce([b"x"]).wait(timeout=60)
    assert e.value.status == 403
    with pytest.raises(ServiceRefusedError):
        wrong.produce([b"y"])  # a rejected token stops the producer
    with pytest.raises(ServiceRefusedError):
        wrong.close(timeout=30)
    assert "not-the-token" not in str(e.value)


@pytest.mark.slow
def test_https_verifies_the_certificate_against_ca_file(tmp_path: Path, instances: Start) -> None:
    cert, key, client_ctx = self_signed(tmp_path / "cert.pem", tmp_path / "key.pem")
    url = f"file://{tmp_path}/buf"
    srv = instances(url, *FAST, "--tls-cert", str(cert), "--tls-key", str(key), tls=client_ctx)
    where = f"https://127.0.0.1:{srv.port}"
    with tieredbuf.service_producer(where, ca_file=str(cert)) as p:
        out = p.produce([b"over tls"]).wait(timeout=60)
    assert entries_by_sequence(url)[out.sequence].entries == [b"over tls"]
    untrusting = tieredbuf.service_producer(where)  # the system's authorities only
    with pytest.raises(ServiceRefusedError, match="certificate not trusted"):
        untrusting.produce([b"x"]).wait(timeout=60)
    assert untrusting.stats.get("attempts") == 1  # no retry makes it verify
    with pytest.raises(ServiceRefusedError):
        untrusting.close(timeout=30)
