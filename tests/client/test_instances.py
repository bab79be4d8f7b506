"""Several ``tieredbuf serve`` instances on one buffer, as an operator runs them behind a
load balancer (each with its own stage): clients spread their requests over them,
fail over when one is SIGKILLed, and every acknowledged request is in the queue at the
entry its REMOTE outcome names (I10).

Exactly once: a request retried after its answer was lost, or after the instance that
staged it died, is stored once -- the service recognises the retry by its
``Idempotency-Key`` across instances.  A request sent whole to an instance that died
before staging it is one no instance can find: its retries are answered 409, and after
``unknown_outcome_for`` its calls fail saying they may have been stored
(ServiceUnavailableError); they are never stored twice, and never silently dropped.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest

import tieredbuf
from tests.client.front import LOSE, PASS, Action, Front, Status
from tests.client.test_service_client import check_remote, entries_by_sequence
from tests.service.server import Server
from tests.service.util import FAST, worker_pids
from tieredbuf.errors import ServiceUnavailableError
from tieredbuf.produce.handles import WriteHandle

Start = Callable[..., Server]
MakeFront = Callable[..., Front]
Sent = list[tuple[WriteHandle, list[bytes]]]


def sigkill(srv: Server) -> None:
    """kill -9 an instance: its workers and its supervisor (a node lost at once: nothing
    drains; what its stage holds is LOCAL and exported when it is back)."""
    for pid in worker_pids(srv.proc.pid):
        os.kill(pid, signal.SIGKILL)
    srv.proc.kill()
    srv.proc.wait()


@pytest.mark.slow
def test_a_client_spreads_its_requests_over_the_instances(
    tmp_path: Path, instances: Start, front: MakeFront
) -> None:
    url = f"file://{tmp_path}/buf"
    fronts = [front(instances(url, *FAST)) for _ in range(3)]
    sent: Sent = []
    with tieredbuf.service_producer(
        ",".join(f"127.0.0.1:{f.port}" for f in fronts).join(("http://", "")),
        flush_interval=timedelta(milliseconds=1),
    ) as p:
        for i in range(12):
            recs = [f"spread-{i}".encode()]
            sent.append((p.produce(recs), recs))
            sent[-1][0].wait(timeout=60)
    _, stored = check_remote(url, sent)
    assert stored == Counter(r for _, recs in sent for r in recs)
    assert [len(f.attempts()) for f in fronts] == [4, 4, 4]  # in turn, no failure


def _produce_until(
    p: tieredbuf.ServiceProducer, name: str, calls: int, sent: Sent, lock: threading.Lock
) -> None:
    for i in range(calls):
        recs = [f"{name}-{i}".encode(), f"{name}-{i}-b".encode()]
        h = p.produce(recs, timeout=120)
        with lock:
            sent.append((h, recs))
        time.sleep(0.005)  # an open loop: a call every 5 ms, not a synchronisation


def _wait_acked(sent: Sent, lock: threading.Lock, count: int, deadline: float) -> None:
    """Until ``count`` handles are REMOTE (a progress point to act at, not a sleep)."""
    while True:
        with lock:
            done = sum(1 for h, _ in sent if h.watcher.level == tieredbuf.Durability.REMOTE)
        if done >= count:
            return
        assert time.monotonic() < deadline, f"only {done} of {count} acknowledged"
        time.sleep(0.02)  # polling the handles against a deadline


UNKNOWN_FOR = timedelta(seconds=30)
"""How long a request no instance can find is asked after (the default is 5 minutes)."""


def _close_all(producers: list[tieredbuf.ServiceProducer]) -> None:
    """Close; the only failure allowed is a request whose outcome stayed unknown."""
    for p in producers:
        try:
            p.close(timeout=180)
        except ServiceUnavailableError as e:
            assert e.may_have_landed, e


@pytest.mark.slow
def test_failover_when_an_instance_is_sigkilled_every_acknowledged_write_is_stored_once(
    tmp_path: Path, instances: Start
) -> None:
    """Three instances, one client listing all three; one is SIGKILLed half-way and
    started again on its stage, as a StatefulSet does.  Every call acknowledged REMOTE
    names an entry that holds its records, each stored once; a call whose request died
    unstaged with the instance fails saying so (ServiceUnavailableError)."""
    url = f"file://{tmp_path}/buf"
    srvs = [instances(url, *FAST) for _ in range(3)]
    urls = [f"http://127.0.0.1:{s.port}" for s in srvs]
    sent: Sent = []
    lock = threading.Lock()
    p = tieredbuf.service_producer(
        urls,
        flush_interval=timedelta(milliseconds=10),
        max_in_flight=4,  # requests at every instance when it is killed
        unknown_outcome_for=UNKNOWN_FOR,
    )
    t = threading.Thread(target=_produce_until, args=(p, "kill", 600, sent, lock))
    t.start()
    _wait_acked(sent, lock, 60, time.monotonic() + 120)
    sigkill(srvs[1])
    restarted = instances(url, *FAST, where=srvs[1].stage.parent)
    t.join(timeout=300)
    assert not t.is_alive()
    _close_all([p])
    assert p.stats.get("attempts_unanswered") >= 1  # it met the killed instance
    for s in (srvs[0], srvs[2], restarted):
        assert s.terminate() == 0  # drained: every stage empty
    _, stored = check_remote(url, sent, unknown_ok=True)
    acked = [r for h, recs in sent if h.watcher.level for r in recs]
    assert len(acked) >= 1000 and all(stored[r] == 1 for r in acked)  # exactly once


def _chaos_script(seed: int, n: int) -> list[Action]:
    """Lost answers and 503s among passes: about one request in eight each."""
    rng = random.Random(seed)
    out: list[Action] = []
    for _ in range(n):
        x = rng.random()
        out.append(LOSE if x < 0.12 else Status(503, "0") if x < 0.24 else PASS)
    return out


def run_chaos(tmp_path: Path, instances: Start, front: MakeFront) -> tuple[Sent, Counter[bytes]]:
    """Two instances on one buffer, each behind a front that loses answers and says 503;
    four clients (threads) list both; one instance is SIGKILLed half-way and started
    again on its stage.  Returns every call with its handle, and how often each record
    is in the queue afterwards (I10 checked on the way)."""
    url = f"file://{tmp_path}/buf"
    srvs = [instances(url, *FAST) for _ in range(2)]
    fronts = [front(s) for s in srvs]
    for i, f in enumerate(fronts):
        f.script(*_chaos_script(i, 400))
    urls = ",".join(f"127.0.0.1:{f.port}" for f in fronts)
    sent: Sent = []
    lock = threading.Lock()
    producers = [
        tieredbuf.service_producer(
            f"http://{urls}",
            flush_interval=timedelta(milliseconds=20),
            unknown_outcome_for=UNKNOWN_FOR,
        )
        for _ in range(4)
    ]
    threads = [
        threading.Thread(target=_produce_until, args=(p, f"c{k}", 60, sent, lock))
        for k, p in enumerate(producers)
    ]
    for t in threads:
        t.start()
    _wait_acked(sent, lock, 60, time.monotonic() + 120)
    sigkill(srvs[1])
    restarted = instances(url, *FAST, where=srvs[1].stage.parent)
    fronts[1].upstream = (restarted.host, restarted.port)
    for t in threads:
        t.join(timeout=300)
        assert not t.is_alive()
    _close_all(producers)
    for s in (srvs[0], restarted):
        assert s.terminate() == 0
    assert any(s.action == LOSE for f in fronts for s in f.attempts())
    _, stored = check_remote(url, sent, unknown_ok=True)
    return sent, stored


@pytest.mark.slow
def test_chaos_every_acknowledged_request_is_stored_exactly_once(
    tmp_path: Path, instances: Start, front: MakeFront
) -> None:
    """Lost answers, 503s and a SIGKILLed instance among two instances and four clients:
    every acknowledged request is stored exactly once, at the entry its answer named
    (check_remote); nothing is stored twice."""
    sent, stored = run_chaos(tmp_path, instances, front)
    assert len(sent) == 240
    acked = [r for h, recs in sent if h.watcher.level for r in recs]
    assert len(acked) >= 400
    assert {r: n for r, n in stored.items() if n != 1} == {}
    assert set(acked) <= set(stored)


@pytest.mark.slow
def test_I3_a_producers_calls_land_in_the_order_they_were_made_across_instances(
    tmp_path: Path, instances: Start
) -> None:
    """max_in_flight=1 (the default) with durability=remote: each request is in the
    queue before the next is sent, so two instances committing independently cannot
    swap a producer's calls."""
    url = f"file://{tmp_path}/buf"
    srvs = [instances(url, *FAST) for _ in range(2)]
    made = []
    with tieredbuf.service_producer(
        [f"http://127.0.0.1:{s.port}" for s in srvs], flush_interval=timedelta(milliseconds=2)
    ) as p:
        for i in range(60):
            made.append(f"ordered-{i}".encode())
            p.produce([made[-1]], metadata=b"even" if i % 7 < 4 else b"odd")
            time.sleep(0.003)  # an open loop: calls spread over many requests
        p.flush(timeout=120)
        assert p.stats.get("requests") > 10
    got = [r for b in sorted(entries_by_sequence(url).items()) for r in b[1].entries]
    assert got == made
