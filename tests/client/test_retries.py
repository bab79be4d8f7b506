"""The service producer against a front that answers by itself (tests/client/front.py):
what it retries and what not, under which key, how long it waits, and that neither
``close(timeout)`` nor ``produce()`` under backpressure waits longer than it was told.
The service itself is in test_service_client.py."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta

import pytest

import tieredbuf
from tests.client.front import DROP, HANG, Front, Status
from tieredbuf.errors import (
    BackpressureError,
    ClosedError,
    FlushTimeoutError,
    ServiceRefusedError,
    ServiceUnavailableError,
)

MakeFront = Callable[..., Front]
QUICK = {
    "flush_interval": timedelta(milliseconds=5),
    "retry": tieredbuf.RetryConfig(
        initial_backoff=timedelta(milliseconds=5),
        max_backoff=timedelta(milliseconds=20),
        give_up_after=None,
    ),
}


def _closes_within(producer: tieredbuf.ServiceProducer, timeout: float) -> BaseException | None:
    """close(timeout) on a thread; what it raised.  The test fails, instead of hanging,
    if close() is still blocked well past its own timeout."""
    out: list[BaseException | None] = []

    def run() -> None:
        try:
            producer.close(timeout=timeout)
            out.append(None)
        except BaseException as e:
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout + 30)
    assert not t.is_alive(), f"close(timeout={timeout}) still blocked 30 s past its timeout"
    return out[0]


@pytest.mark.parametrize("status", [400, 413, 415, 422])
def test_a_refusal_is_not_retried_and_fails_its_calls_loudly(front: MakeFront, status: int) -> None:
    f = front(default=Status(status))
    p = tieredbuf.service_producer(f.url, **QUICK)
    h = p.produce([b"a", b"b"])
    with pytest.raises(ServiceRefusedError, match=f"{status} front answers") as e:
        h.wait(timeout=30)
    assert e.value.status == status and not e.value.may_have_landed
    assert len(f.attempts()) == 1
    with pytest.raises(ServiceRefusedError, match=r"1 request\(s\) failed since the last flush"):
        p.flush(timeout=30)
    p.close(timeout=30)  # the refusal was reported by flush(): close has nothing to raise


@pytest.mark.parametrize("status", [401, 403])
def test_a_rejected_token_stops_the_producer(front: MakeFront, status: int) -> None:
    f = front(default=Status(status))
    p = tieredbuf.service_producer(f.url, token="t" * 24, **QUICK)
    h = p.produce([b"a"])
    with pytest.raises(ServiceRefusedError) as e:
        h.wait(timeout=30)
    assert e.value.status == status
    with pytest.raises(ServiceRefusedError):
        p.produce([b"b"])
    with pytest.raises(ServiceRefusedError):
        p.close(timeout=30)
    assert f.attempts()[0].headers["authorization"] == "Bearer " + "t" * 24


def test_retries_carry_one_key_and_the_same_bytes_until_an_answer_decides(
    front: MakeFront,
) -> None:
    """503, 429, 408, 504, a dropped connection, 409 are retried under the request's own
    Idempotency-Key with the same body; from the 504 on (its outcome unknown) every
    attempt is marked as a retry; the 400 at the end decides (not retried), and the
    error says the request may have been stored."""
    f = front()
    f.script(
        Status(503, "0", "backpressure: the stage is at its cap"),
        Status(429),
        Status(408),
        Status(504),
        DROP,
        Status(409),
        Status(400),
    )
    p = tieredbuf.service_producer(f.url, **QUICK)
    h = p.produce([b"x" * 10, b"\x00\xff"], metadata=b"tag")
    with pytest.raises(ServiceRefusedError) as e:
        h.wait(timeout=60)
    assert e.value.may_have_landed
    seen = f.attempts()
    assert [s.action for s in seen] == [
        "status 503",
        "status 429",
        "status 408",
        "status 504",
        "drop",
        "status 409",
        "status 400",
    ]
    assert len({s.key for s in seen}) == 1 and len(seen[0].key or "") == 26  # a ULID
    assert [s.headers.get("x-tieredbuf-retry") for s in seen] == [None] * 4 + ["1"] * 3
    assert len({s.body_sha for s in seen}) == 1
    assert {s.headers["x-tieredbuf-metadata"] for s in seen} == {"tag"}
    assert {s.path for s in seen} == {"/v1/produce?durability=remote"}
    assert p.stats.get("retries") == 6
    with pytest.raises(ServiceRefusedError):
        p.close(timeout=30)


@pytest.mark.slow
def test_a_connection_the_service_closed_while_idle_is_not_used_again(
    front: MakeFront,
) -> None:
    """The front closes connections idle for 0.2 s; the retry 1 s later goes on a fresh
    one: no attempt fails on the closed one (which would make its outcome unknown)."""
    f = front(idle_timeout=0.2)
    f.script(Status(503, "1", "backpressure: the stage is at its cap"), Status(400))
    p = tieredbuf.service_producer(f.url, **QUICK)
    with pytest.raises(ServiceRefusedError) as e:
        p.produce([b"a"]).wait(timeout=30)
    assert not e.value.may_have_landed and p.stats.get("attempts_unanswered") == 0
    assert [s.headers.get("x-tieredbuf-retry") for s in f.attempts()] == [None, None]
    with pytest.raises(ServiceRefusedError):
        p.close(timeout=30)


def test_every_request_has_a_key_of_its_own(front: MakeFront) -> None:
    f = front(default=Status(400))
    p = tieredbuf.service_producer(f.url, **QUICK)
    handles = [p.produce([b"r"], metadata=f"m{i}".encode()) for i in range(3)]
    for h in handles:
        with pytest.raises(ServiceRefusedError):
            h.wait(timeout=30)
    assert len({s.key for s in f.attempts()}) == 3  # other metadata: a request each
    with pytest.raises(ServiceRefusedError, match=r"3 request\(s\) failed"):
        p.close(timeout=30)


def test_a_request_whose_outcome_stays_unknown_fails_saying_so(front: MakeFront) -> None:
    """After a lost answer the retries are marked; while the service answers 409 (no
    instance can tell) they go on for unknown_outcome_for, then the calls fail, saying
    they may have been stored -- never retried as new (that could store them twice)."""
    f = front()
    f.script(DROP)
    f.default = Status(409, "0", "a request with this Idempotency-Key may be in flight")
    p = tieredbuf.service_producer(f.url, unknown_outcome_for=timedelta(milliseconds=300), **QUICK)
    with pytest.raises(ServiceUnavailableError, match="may have been stored") as e:
        p.produce([b"a"]).wait(timeout=30)
    assert e.value.may_have_landed and e.value.status == 409
    seen = f.attempts()
    assert len(seen) > 2 and all(s.headers.get("x-tieredbuf-retry") == "1" for s in seen[1:])
    with pytest.raises(ServiceUnavailableError):
        p.close(timeout=30)


def test_a_user_key_is_refused(front: MakeFront) -> None:
    f = front(default=Status(400))
    refused = pytest.raises(ValueError, match="keys each request itself")
    with tieredbuf.service_producer(f.url, **QUICK) as p, refused:
        p.produce([b"a"], idempotency_key="mine")
    assert f.attempts() == []


@pytest.mark.slow
def test_retry_after_is_waited_out(front: MakeFront) -> None:
    f = front()
    f.script(Status(503, "1"), Status(400))
    p = tieredbuf.service_producer(f.url, **QUICK)
    with pytest.raises(ServiceRefusedError):
        p.produce([b"a"]).wait(timeout=30)
    first, second = f.attempts()
    assert second.at - first.at >= 1.0  # never sooner than the service asked
    with pytest.raises(ServiceRefusedError):
        p.close(timeout=30)


def test_give_up_after_fails_the_calls_saying_they_may_have_landed(front: MakeFront) -> None:
    f = front(default=Status(503, "0", "stage disk failing: DiskIOError: EIO"))
    retry = tieredbuf.RetryConfig(
        initial_backoff=timedelta(milliseconds=5),
        max_backoff=timedelta(milliseconds=20),
        give_up_after=timedelta(milliseconds=300),
    )
    p = tieredbuf.service_producer(f.url, flush_interval=timedelta(milliseconds=5), retry=retry)
    with pytest.raises(ServiceUnavailableError, match=r"gave up after .* may have been stored"):
        p.produce([b"a"]).wait(timeout=30)
    assert len(f.attempts()) > 1
    with pytest.raises(ServiceUnavailableError):
        p.close(timeout=30)


def test_close_timeout_against_a_stalled_service_drops_what_is_unanswered(
    front: MakeFront,
) -> None:
    f = front(default=HANG)
    p = tieredbuf.service_producer(f.url, **QUICK)
    handles = [p.produce([b"a"]) for _ in range(3)]
    err = _closes_within(p, 0.5)
    assert isinstance(err, FlushTimeoutError), err
    assert "3 produce() call(s)" in str(err) and "may still be stored" in str(err)
    for h in handles:  # sent whole and never answered: the service may have them
        with pytest.raises(ServiceUnavailableError, match=r"close\(\) ran out of time") as e:
            h.wait(timeout=10)
        assert e.value.may_have_landed
    with pytest.raises(ClosedError):
        p.produce([b"b"])


def test_flush_timeout_names_what_is_pending_and_keeps_retrying(front: MakeFront) -> None:
    f = front(default=Status(503, "0"))
    p = tieredbuf.service_producer(f.url, **QUICK)
    h = p.produce([b"a", b"b"])
    with pytest.raises(FlushTimeoutError, match=r"1 produce\(\) call\(s\) .* still retried"):
        p.flush(timeout=0.3)
    assert "503" in (p.commit_health() or "")
    assert h.watcher.level is None and h.result() is None  # not failed: still retried
    assert isinstance(_closes_within(p, 0.3), FlushTimeoutError)


def test_backpressure_bounds_what_waits_for_an_answer(front: MakeFront) -> None:
    f = front(default=HANG)
    p = tieredbuf.service_producer(f.url, max_buffered_inputs=2, **QUICK)
    p.produce([b"a"])
    p.produce([b"b"])
    with pytest.raises(BackpressureError, match="2 calls"):
        p.produce([b"c"], timeout=0.2)
    assert isinstance(_closes_within(p, 0.3), FlushTimeoutError)


def test_nothing_listening_is_retried_and_said(front: MakeFront) -> None:
    f = front()
    port = f.port
    f.close()  # the port is free again: connections are refused
    p = tieredbuf.service_producer(f"http://127.0.0.1:{port}", **QUICK)
    h = p.produce([b"a"])
    with pytest.raises(FlushTimeoutError, match="cannot connect"):
        p.flush(timeout=0.5)
    assert p.stats.get("attempts_unanswered") >= 1
    err = _closes_within(p, 0.2)
    assert isinstance(err, FlushTimeoutError) and "cannot connect" in str(err)
    with pytest.raises(FlushTimeoutError):
        h.wait(timeout=10)


@pytest.mark.parametrize(
    ("metadata", "error", "says"),
    [
        (b"\xff\xfe", ValueError, "not UTF-8"),
        (b"a\r\nX-Injected: 1", ValueError, "control character 0x0d"),
        (b"tab\there", ValueError, "control character 0x09"),
        (b" padded", ValueError, "space"),
        (b"x" * 4097, ValueError, "at most 4096"),
        ("text", TypeError, "must be bytes"),
    ],
)
def test_metadata_a_header_cannot_carry_unchanged_is_refused_at_produce(
    front: MakeFront, metadata: object, error: type[Exception], says: str
) -> None:
    f = front(default=Status(400))
    with tieredbuf.service_producer(f.url, **QUICK) as p, pytest.raises(error, match=says):
        p.produce([b"a"], metadata=metadata)  # type: ignore[arg-type]
    assert f.attempts() == []


def test_records_must_be_a_list_of_bytes(front: MakeFront) -> None:
    f = front(default=Status(400))
    with tieredbuf.service_producer(f.url, **QUICK) as p:
        with pytest.raises(TypeError, match="list of byte records"):
            p.produce(b"abc")
        with pytest.raises(TypeError, match="record 1 is str"):
            p.produce([b"a", "b"])
    assert f.attempts() == []
