"""The one fenced-CAS primitive (tieredbuf.queue.cas): every overwritten object goes
through it.  A counter object on a real (in-memory obstore) store, with faults injected
as a lost response looks to the client (I2)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from tests.faults import FaultInjectingStore
from tieredbuf.config import RetryConfig
from tieredbuf.errors import (
    AccessDeniedError,
    FencedError,
    ObjectNotFoundError,
    OutcomeUnknownError,
    PreconditionFailedError,
    TieredBufError,
    TransientStoreError,
)
from tieredbuf.queue import cas
from tieredbuf.runtime.stats import Stats
from tieredbuf.store import open_store
from tieredbuf.store.base import IfMatch

KEY = "obj"


@dataclass(frozen=True)
class Counter:
    value: int
    epoch: int
    last_by: str


def _encode(c: Counter) -> bytes:
    return f"{c.value},{c.epoch},{c.last_by}".encode()


class CounterObject:
    def __init__(self, store: FaultInjectingStore) -> None:
        self.store = store
        self.reads = 0

    def read(self) -> cas.Read[Counter]:
        self.reads += 1
        try:
            got = self.store.get(KEY)
        except ObjectNotFoundError:
            return cas.Read(Counter(0, 1, ""), None)
        v, e, by = got.data.decode().split(",")
        return cas.Read(Counter(int(v), int(e), by), got.etag)

    def write(self, data: bytes, etag: str | None) -> str:
        return self.store.put(KEY, data, mode="create" if etag is None else IfMatch(etag))


def _retries(limit: int | None = None) -> cas.Retries:
    return cas.Retries(RetryConfig(), sleep=lambda s: None, limit=limit)


def _increment(obj: CounterObject, stats: Stats, me: str, epoch: int = 1) -> int:
    """Add one; returns the value this call wrote (its decision)."""

    def decide(read: cas.Read[Counter], attempt: int) -> cas.Write[int]:
        new = read.state.value + 1
        return cas.Write(_encode(Counter(new, read.state.epoch, f"{me}@{new}")), new)

    def landed(read: cas.Read[Counter], tried: Sequence[int]) -> int | None:
        c = read.state
        return c.value if any(c.last_by == f"{me}@{t}" for t in tried) else None

    def fence(c: Counter) -> None:
        if c.epoch != epoch:
            raise FencedError(epoch, c.epoch)

    return cas.run(
        obj, decide, lambda d, _etag: d, retries=_retries(), stats=stats, landed=landed, fence=fence
    )


def test_I2_a_write_whose_response_was_lost_is_recognised_not_repeated() -> None:
    store = FaultInjectingStore(open_store("memory://"))
    obj, stats = CounterObject(store), Stats()
    assert _increment(obj, stats, "a") == 1
    for err in (OutcomeUnknownError, PreconditionFailedError):
        fault = store.arm("put", key=KEY, when="after", error=err, times=1)
        got = _increment(obj, stats, "a")
        assert fault.fired == 1
        assert got == obj.read().state.value  # landed once, and the call says which value
    assert obj.read().state.value == 3
    assert stats.get("found_landed") == 2


def test_I2_a_retry_returns_the_decision_of_the_attempt_that_landed() -> None:
    """The lost attempt decided "3"; a rival wrote meanwhile; the retry must report 3,
    the value its own landed write carries, not one rebuilt from the fresh state."""
    store = FaultInjectingStore(open_store("memory://"))
    obj, stats = CounterObject(store), Stats()
    _increment(obj, stats, "a")
    _increment(obj, stats, "a")
    decided: list[int] = []

    def decide(read: cas.Read[Counter], attempt: int) -> cas.Write[int]:
        new = read.state.value + 1
        decided.append(new)
        return cas.Write(_encode(Counter(new, 1, f"a@{new}")), new)

    def landed(read: cas.Read[Counter], tried: Sequence[int]) -> int | None:
        # the state shows a landed attempt of ours by its mark, even under a rival's value
        return next((t for t in tried if f"a@{t}" in read.state.last_by), None)

    fault = store.arm("put", key=KEY, when="after", error=OutcomeUnknownError, times=1)
    got = cas.run(obj, decide, lambda d, _e: d, retries=_retries(), stats=stats, landed=landed)
    assert fault.fired == 1 and decided == [3] and got == 3


def test_a_lost_race_rereads_and_decides_again_from_the_fresh_state() -> None:
    store = FaultInjectingStore(open_store("memory://"))
    obj, stats = CounterObject(store), Stats()
    _increment(obj, stats, "a")
    stale = obj.read()
    _increment(obj, stats, "b")  # a rival moves it on
    got = cas.run(
        obj,
        lambda r, a: cas.Write(_encode(Counter(r.state.value + 1, 1, "c")), r.state.value + 1),
        lambda d, _e: d,
        retries=_retries(),
        stats=stats,
        first=stale,
    )
    assert got == 3 and obj.read().state.value == 3
    assert stats.get("conflicts") == 1 and stats.get("retries") == 1


def test_I4_a_fenced_writer_lands_nothing() -> None:
    store = FaultInjectingStore(open_store("memory://"))
    obj, stats = CounterObject(store), Stats()
    _increment(obj, stats, "a")
    store.put(KEY, _encode(Counter(5, 2, "newer")), mode="overwrite")  # a newer epoch
    with pytest.raises(FencedError):
        _increment(obj, stats, "a", epoch=1)
    assert obj.read().state == Counter(5, 2, "newer")


def test_permanent_errors_stop_at_once_and_transient_ones_are_retried() -> None:
    store = FaultInjectingStore(open_store("memory://"))
    obj, stats = CounterObject(store), Stats()
    store.arm("get", key=KEY, when="before", error=TransientStoreError, times=2)
    store.arm("put", key=KEY, when="before", error=TransientStoreError, times=1)
    assert _increment(obj, stats, "a") == 1
    assert stats.get("transient_errors") == 3
    store.arm("put", key=KEY, when="before", error=AccessDeniedError, times=1)
    with pytest.raises(AccessDeniedError):
        _increment(obj, stats, "a")
    assert stats.get("permanent_errors") == 1 and obj.read().state.value == 1


def test_the_retry_limit_names_what_gave_up() -> None:
    store = FaultInjectingStore(open_store("memory://"))
    obj, stats = CounterObject(store), Stats()
    store.arm("put", key=KEY, when="before", error=TransientStoreError, times=None)
    with pytest.raises(TieredBufError, match="counter gave up after 2 retries"):
        cas.run(
            obj,
            lambda r, a: cas.Write(b"x", None),
            lambda d, e: None,
            retries=_retries(limit=2),
            stats=stats,
            what="counter",
        )


def test_skip_unchanged_and_replan() -> None:
    store = FaultInjectingStore(open_store("memory://"))
    obj, stats = CounterObject(store), Stats()
    assert (
        cas.run(
            obj,
            lambda r, a: cas.Skip("done"),
            lambda d, e: "wrote",
            retries=_retries(),
            stats=stats,
        )
        == "done"
    )

    def unchanged() -> bytes:
        raise cas.Unchanged("nothing")

    assert (
        cas.run(
            obj,
            lambda r, a: cas.Write(unchanged, None),
            lambda d, e: "wrote",
            retries=_retries(),
            stats=stats,
        )
        == "nothing"
    )
    plans: list[int] = []

    def decide(read: cas.Read[Counter], attempt: int) -> cas.Write[None]:
        plans.append(attempt)
        if attempt == 0:
            raise cas.Replan("late_links")
        return cas.Write(b"1,1,x", None)

    assert cas.run(obj, decide, lambda d, e: "wrote", retries=_retries(), stats=stats) == "wrote"
    assert plans == [0, 1] and stats.get("late_links") == 1
