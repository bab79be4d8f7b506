"""The client's decisions (tieredbuf/client/policy.py): what is retried, how long after,
where to.  Pure: no I/O, time passed in."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import pytest

from tieredbuf.client.policy import (
    EndpointPicker,
    Verdict,
    may_have_landed,
    retry_after_s,
    retry_delay,
    verdict,
)
from tieredbuf.config import RetryConfig


@pytest.mark.parametrize("status", [408, 409, 429, 500, 502, 503, 504, 599])
def test_retried(status: int) -> None:
    assert verdict(status) is Verdict.RETRY


@pytest.mark.parametrize("status", [301, 400, 401, 403, 404, 413, 415, 422])
def test_never_retried(status: int) -> None:
    assert verdict(status) is Verdict.REFUSED
    assert not may_have_landed(status)


def test_what_may_have_landed() -> None:
    assert verdict(200) is Verdict.DONE
    assert [s for s in (408, 409, 429, 500, 502, 503, 504) if may_have_landed(s)] == [
        409,
        500,
        502,
        503,
        504,
    ]
    # a 503 that says it staged nothing, in the service's own words
    for said in (
        "backpressure: stage full",
        "draining",
        "not accepting writes (starting or draining)",
        "too many connections: retry",
    ):
        assert not may_have_landed(503, said)
    assert may_have_landed(503, "stage disk failing: DiskFullError: ...")


def test_retry_after_in_seconds_or_as_a_date_and_nothing_else() -> None:
    now = 1_800_000_000.0
    assert retry_after_s("3", now) == 3.0
    when = format_datetime(datetime.fromtimestamp(now + 7, UTC), usegmt=True)
    assert retry_after_s(when, now) == pytest.approx(7.0)
    past = format_datetime(datetime.fromtimestamp(now - 7, UTC), usegmt=True)
    assert retry_after_s(past, now) == 0.0
    assert retry_after_s(None, now) is None
    assert retry_after_s("soon", now) is None
    assert retry_after_s("-1", now) is None


def test_a_retry_after_is_waited_in_full_plus_jitter_and_capped() -> None:
    retry = RetryConfig(initial_backoff=timedelta(milliseconds=50))
    rng = random.Random(7)
    waits = [retry_delay(retry, 0, 2.0, 30.0, rng) for _ in range(200)]
    assert min(waits) >= 2.0 and max(waits) <= 2.4 and len(set(waits)) > 100
    assert 30.0 <= retry_delay(retry, 0, 3600.0, 30.0, rng) <= 36.0


def test_without_retry_after_the_backoff_grows_jittered_to_its_cap() -> None:
    retry = RetryConfig(
        initial_backoff=timedelta(milliseconds=50), max_backoff=timedelta(seconds=2)
    )
    rng = random.Random(1)
    first = [retry_delay(retry, 0, None, 30.0, rng) for _ in range(100)]
    late = [retry_delay(retry, 12, None, 30.0, rng) for _ in range(100)]
    assert max(first) <= 0.05 and min(late) >= 1.0 and max(late) <= 2.0
    assert len(set(late)) > 50


def test_requests_start_at_each_endpoint_in_turn() -> None:
    p = EndpointPicker(3, start=1)
    assert [p.first() for _ in range(6)] == [1, 2, 0, 1, 2, 0]


def test_a_failed_endpoint_rests_and_the_retry_fails_over() -> None:
    p = EndpointPicker(3)
    assert p.pick(0, now=100.0) == (0, 0.0)
    p.failed(0, now=100.0, delay=1.0)
    assert p.pick(0, now=100.1) == (1, 0.0)  # failover: the next one
    p.failed(1, now=100.1, delay=5.0)
    p.failed(2, now=100.1, delay=3.0)
    i, wait = p.pick(0, now=100.2)  # all resting: the first back
    assert i == 0 and wait == pytest.approx(0.8)
    assert p.pick(1, now=101.0) == (0, 0.0)  # 1 rests till 105.1, 2 till 103.1, 0 is back
    p.succeeded(1)
    assert p.pick(1, now=100.3) == (1, 0.0)


def test_one_load_balanced_endpoint_waits_out_its_rest() -> None:
    p = EndpointPicker(1)
    p.failed(0, now=10.0, delay=2.0)
    assert p.pick(0, now=10.5) == (0, pytest.approx(1.5))
    assert p.pick(0, now=12.0) == (0, 0.0)
