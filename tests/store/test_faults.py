"""FaultInjectingStore, KeyRateLimitedStore and CountingStore: the tools the I2
(exactly-once append), rate-limit and GET-bound tests are built on."""

from __future__ import annotations

import threading

import pytest

from tests.faults import CountingStore, FaultInjectingStore, KeyRateLimitedStore
from tieredbuf import errors
from tieredbuf.store import IfMatch, open_store
from tieredbuf.store.base import manifest_writes_per_s
from tieredbuf.store.counting import MeteredStore


def test_after_fault_lands_the_write_then_reports_a_conflict() -> None:
    """I2: obstore retrying a PUT whose response was lost meets its own write."""
    s = FaultInjectingStore(open_store("memory://"))
    e1 = s.put("queue/manifest", b"v1", mode="create")
    fault = s.arm("put", key="queue/manifest", when="after", error=errors.PreconditionFailedError)
    with pytest.raises(errors.PreconditionFailedError) as ei:
        s.put("queue/manifest", b"v2", mode=IfMatch(e1))
    assert ei.value.key == "queue/manifest"
    assert s.get("queue/manifest").data == b"v2"  # it landed anyway
    assert fault.fired == 1 and fault.times == 0
    s.put("queue/manifest", b"v3")  # disarmed after one shot
    assert s.get("queue/manifest").data == b"v3"


@pytest.mark.parametrize("error", [errors.OutcomeUnknownError, errors.AlreadyExistsError])
def test_after_fault_on_create(error: type[Exception]) -> None:
    s = FaultInjectingStore(open_store("memory://"))
    s.arm("put", when="after", error=error)
    with pytest.raises(error):
        s.put("data/x", b"payload", mode="create")
    assert s.get("data/x").data == b"payload"


def test_before_fault_does_not_write() -> None:
    s = FaultInjectingStore(open_store("memory://"))
    s.arm("put", key="k", when="before", error=errors.OutcomeUnknownError, times=2)
    for _ in range(2):
        with pytest.raises(errors.OutcomeUnknownError):
            s.put("k", b"x")
    with pytest.raises(errors.ObjectNotFoundError):
        s.get("k")
    s.put("k", b"x")
    assert s.get("k").data == b"x"


def test_faults_filter_by_key_op_and_mode() -> None:
    s = FaultInjectingStore(open_store("memory://"))
    f = s.arm("put", key="a", error=errors.OutcomeUnknownError, mode="overwrite", times=None)
    s.put("b", b"1", mode="overwrite")  # other key
    s.put("a", b"1", mode="create")  # other mode
    assert s.get("a").data == b"1"  # other op
    with pytest.raises(errors.OutcomeUnknownError):
        s.put("a", b"2", mode="overwrite")
    assert f.fired == 1
    # an "after" fault whose real operation fails lets the real error through, unspent
    with pytest.raises(errors.AlreadyExistsError):
        s.put("a", b"3", mode="create")
    s.disarm()
    g = s.arm("put", key="a", error=errors.OutcomeUnknownError)
    with pytest.raises(errors.AlreadyExistsError):
        s.put("a", b"3", mode="create")
    assert (g.fired, g.times) == (0, 1)
    s.disarm()
    s.arm("get", error=errors.StoreError("boom"), when="before")
    with pytest.raises(errors.StoreError, match="boom"):
        s.get("a")
    s.arm("delete_many", key="b", error=errors.OutcomeUnknownError)
    with pytest.raises(errors.OutcomeUnknownError):
        s.delete_many(["a", "b"])
    assert list(s.list("")) == []  # the delete happened
    s.arm("list", error=errors.StoreError, when="before")
    with pytest.raises(errors.StoreError):
        s.list("")
    with pytest.raises(ValueError):
        s.arm("nope", error=errors.StoreError)  # type: ignore[arg-type]


def test_fault_fires_exactly_times_under_threads() -> None:
    s = FaultInjectingStore(open_store("memory://"))
    s.arm("put", error=errors.OutcomeUnknownError, times=3)
    raised: list[int] = []
    lock = threading.Lock()

    def work(i: int) -> None:
        for j in range(25):
            try:
                s.put(f"k/{i}/{j}", b"x")
            except errors.OutcomeUnknownError:
                with lock:
                    raised.append(1)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(raised) == 3
    assert len(list(s.list("k/"))) == 200  # "after" faults still wrote


def test_counting_store_counts_calls_and_bytes() -> None:
    c = CountingStore(open_store("memory://"))
    c.put("a", b"12345")
    c.put_multipart("b", [b"12", b"345"], mode="create")
    c.get("a")
    c.get_range("a", 0, 2)
    c.get_suffix("b", 1)
    c.head("a")
    list(c.list(""))
    c.delete_many(["a"])
    counts = c.counts
    assert counts == {
        "put": 1,
        "put_multipart": 1,
        "get": 1,
        "get_range": 1,
        "get_suffix": 1,
        "head": 1,
        "list": 1,
        "delete_many": 1,
    }
    assert c.reads == 3
    assert (c.bytes_written, c.bytes_read) == (10, 5 + 2 + 1)
    c.reset()
    assert c.counts == {} and c.bytes_read == 0
    assert c.url == "memory://"


def test_key_rate_limited_store_refuses_a_second_write_to_a_key_within_the_window() -> None:
    now = [100.0]
    s = KeyRateLimitedStore(open_store("memory://"), 1.0, clock=lambda: now[0])
    etag = s.put("root", b"1", mode="create")
    s.put("other", b"x")  # the limit is per key
    now[0] += 0.99
    with pytest.raises(errors.ThrottledError, match="HTTP 429 SlowDown") as ei:
        s.put("root", b"2", mode=IfMatch(etag))
    assert isinstance(ei.value, errors.TransientStoreError)  # retried, never permanent
    assert "may have landed" not in str(ei.value)  # refused: not applied
    assert s.get("root").data == b"1"
    now[0] += 0.5  # a refusal does not restart the window
    s.put("root", b"3", mode=IfMatch(etag))
    with pytest.raises(errors.ThrottledError):
        s.copy("other", "root")
    assert s.refused["root"] == 2 and s.writes["root"] == [100.0, 101.49]
    assert [ok for _, _, ok in s.attempts["root"]] == [True, False, True, False]


def test_key_rate_limited_store_carries_the_one_per_second_budget_through_wrappers() -> None:
    s = KeyRateLimitedStore(open_store("memory://"))
    assert manifest_writes_per_s(s) == 1.0
    assert manifest_writes_per_s(MeteredStore(s)) == 1.0
    assert manifest_writes_per_s(open_store("memory://")) == 5.0


def test_a_fault_armed_on_get_fires_on_a_conditional_get_too() -> None:
    """get_if_changed is a GET (with If-None-Match): "get" faults cover it, so a test
    that fails the root's reads fails the watcher's polls as well."""
    s = FaultInjectingStore(open_store("memory://"))
    e1 = s.put("queue/manifest", b"v1")
    fault = s.arm("get", key="queue/manifest", when="before", error=errors.TransientStoreError)
    with pytest.raises(errors.TransientStoreError):
        s.get_if_changed("queue/manifest", e1)
    assert fault.fired == 1
    assert s.get_if_changed("queue/manifest", e1) is None  # one shot
    s.arm("get", key="queue/manifest", when="after", error=errors.TransientStoreError)
    s.put("queue/manifest", b"v2")
    with pytest.raises(errors.TransientStoreError):
        s.get_if_changed("queue/manifest", e1)  # the answer was lost
    r = s.get_if_changed("queue/manifest", e1)
    assert r is not None and r.data == b"v2"


def test_wrappers_forward_a_conditional_get_and_count_it_as_a_get() -> None:
    c = CountingStore(KeyRateLimitedStore(open_store("memory://"), window_s=0.0))
    e1 = c.put("queue/manifest", b"12345")
    assert c.get_if_changed("queue/manifest", e1) is None
    c.put("queue/manifest", b"678")
    r = c.get_if_changed("queue/manifest", e1)
    assert r is not None and r.data == b"678"
    assert c.counts == {"put": 2, "get": 2}
    assert c.of("root") == {"put": 2, "get": 2}
    assert c.reads == 2 and c.bytes_read == 3  # a 304 carries no bytes
