"""MeteredStore: every request a buffer sends is counted, by operation and object kind,
exactly as the S3 server sees it (the cost goals are request counts)."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import pytest
from ulid import ULID

import tieredbuf
from tests.servers import recording_moto_server
from tieredbuf import errors, gc, keys
from tieredbuf.store import IfMatch, open_store
from tieredbuf.store.counting import MeteredStore, RequestCounts, diff


def test_key_kind_names_every_key_tieredbuf_writes() -> None:
    u = ULID()
    assert keys.key_kind(keys.data_key(u)) == "data"
    assert keys.key_kind(keys.data_key(u, ".qseg")) == "data"
    assert keys.key_kind(keys.MANIFEST_KEY) == "root"
    assert keys.key_kind(keys.group_key(0, u, "kgroup")) == "group"
    assert keys.key_kind(f"{keys.SUBSCRIBERS_PREFIX}etl.{u}") == "subscriber"
    assert keys.key_kind(keys.probe_key(u)) == "probe"
    assert keys.key_kind("queue/other") == "other"
    assert keys.key_kind("elsewhere") == "other"
    assert keys.key_kind(keys.DATA_PREFIX) == "data"  # a list prefix
    assert keys.key_kind("") == "other"
    assert set(keys.KINDS) == {
        "data",
        "root",
        "group",
        "subscriber",
        "announcement",
        "probe",
        "other",
    }


def test_each_call_counts_as_the_requests_it_sends(tmp_path: Path) -> None:
    s = MeteredStore(open_store(f"file://{tmp_path}/s"))
    e = s.put("queue/manifest", b"m" * 100, mode="create")
    s.put("queue/manifest", b"n" * 100, mode=IfMatch(e))
    s.put("data/x.batch", b"d")
    s.get("queue/manifest")
    s.get_suffix("queue/manifest", 22)
    s.get_range("data/x.batch", 0, 1)
    s.get_range("data/x.batch", 0, 0)  # an empty range is a HEAD
    s.head("data/x.batch")
    assert list(s.list("data/"))
    s.delete_many(["data/x.batch"])
    s.delete_many([])
    assert s.counts.snapshot() == {
        ("put_conditional", "root"): 2,
        ("put", "data"): 1,
        ("get", "root"): 1,
        ("get_range", "root"): 1,
        ("get_range", "data"): 1,
        ("head", "data"): 2,
        ("list", "data"): 1,
        ("delete", "data"): 1,
    }
    d = s.counts.as_dict()
    assert d["total"] == 10
    assert d["by_op"]["put_conditional"] == 2 and d["by_kind"]["root"] == 4


def test_a_hard_link_export_counts_as_one_conditional_put(tmp_path: Path) -> None:
    """The exporter's put_link (a sealed segment linked into a file:// store) is one
    create-if-absent PUT; a store that cannot link refuses it instead of forwarding."""
    import os

    from tieredbuf.store.base import LinkingStore

    src = tmp_path / "seg"
    src.write_bytes(b"segment")
    s = MeteredStore(open_store(f"file://{tmp_path}/s"))
    s.put_link("data/01.batch", lambda tmp: os.link(src, tmp))
    assert s.get("data/01.batch").data == b"segment"
    assert s.counts.snapshot() == {("put_conditional", "data"): 1, ("get", "data"): 1}
    with pytest.raises(errors.AlreadyExistsError):
        s.put_link("data/01.batch", lambda tmp: os.link(src, tmp))
    assert s.counts.conflicts == {"data": 1}
    m = MeteredStore(open_store("memory://"))
    assert not isinstance(m.inner, LinkingStore)
    with pytest.raises(TypeError):
        m.put_link("data/02.batch", lambda tmp: os.link(src, tmp))


def test_refused_conditional_puts_are_requests_and_conflicts(tmp_path: Path) -> None:
    s = MeteredStore(open_store(f"file://{tmp_path}/s"))
    s.put("queue/manifest", b"1", mode="create")
    with pytest.raises(errors.AlreadyExistsError):
        s.put("queue/manifest", b"2", mode="create")
    with pytest.raises(errors.PreconditionFailedError):
        s.put("queue/manifest", b"3", mode=IfMatch("0" * 32))
    with pytest.raises(errors.ObjectNotFoundError):
        s.get("queue/groups/missing")
    assert s.counts.total("put_conditional", "root") == 3
    assert s.counts.conflicts == {"root": 2}
    assert s.counts.total("get", "group") == 1  # a 404 is a request too


def test_lists_count_one_request_per_page_of_1000(tmp_path: Path) -> None:
    s = MeteredStore(open_store("memory://"))
    for i in range(2001):
        s.inner.put(f"data/{i:05d}", b"")
    assert len(list(s.list("data/"))) == 2001
    assert s.counts.total("list") == 3
    assert len(list(s.list("queue/"))) == 0
    assert s.counts.total("list") == 4  # an empty listing is still one request
    before = s.counts.snapshot()
    s.delete_many([f"data/{i:05d}" for i in range(2001)])
    assert diff(s.counts.snapshot(), before) == {("delete", "data"): 3}


def test_a_buffer_meters_every_role_through_one_counter() -> None:
    buf = tieredbuf.open(f"memory://count-{uuid.uuid4().hex}")
    assert isinstance(buf.store, MeteredStore) and buf.requests is buf.store.counts
    assert tieredbuf.buffer.Buffer(buf.store).store is buf.store  # never wrapped twice
    with buf.producer() as p:
        p.produce([b"a"]).wait(timeout=10)
    puts = buf.requests.snapshot()
    assert ("put", "data") not in puts
    assert puts[("put_conditional", "data")] == 1  # create-if-absent
    assert puts[("put_conditional", "root")] == 1  # the append CAS (first write: create)
    c = buf.consumer()
    c.initialize()
    assert c.next_batch() is not None
    c.close()
    assert buf.requests.total("get", "data") == 1


def test_a_conditional_get_counts_as_one_get_whether_unchanged_or_not(tmp_path: Path) -> None:
    s = MeteredStore(open_store(f"file://{tmp_path}/s"))
    e1 = s.inner.put("queue/manifest", b"root v1")
    assert s.get_if_changed("queue/manifest", e1) is None
    assert s.counts.snapshot() == {("get", "root"): 1}  # the 304 is billed as a GET
    s.inner.put("queue/manifest", b"root v2")
    r = s.get_if_changed("queue/manifest", e1)
    assert r is not None and r.data == b"root v2"
    assert s.counts.snapshot() == {("get", "root"): 2}
    with pytest.raises(errors.ObjectNotFoundError):
        s.get_if_changed("queue/groups/missing", e1)
    assert s.counts.snapshot() == {("get", "root"): 2, ("get", "group"): 1}


# --- exact against the server -----------------------------------------------------


@pytest.mark.slow
@pytest.mark.s3
def test_conditional_gets_count_as_the_gets_the_s3_server_received() -> None:
    """get_if_changed sends one GET, answered 304 (unchanged) or 200: the buffer's count
    and the server's tally agree, through obstore and through botocore (forked child)."""
    from tieredbuf.store.botostore import BotoS3Store
    from tieredbuf.store.objstore import ObjStore

    with recording_moto_server() as (ep, rec):
        bucket = ep.new_bucket()
        rec.bucket, rec.prefix = bucket, "buf/"
        obj = open_store(f"s3://{bucket}/buf", **ep.options())
        assert isinstance(obj, ObjStore) and obj.s3 is not None
        for inner in (obj, BotoS3Store(obj.s3, obj.url)):
            s = MeteredStore(inner)
            e1 = s.put("queue/manifest", b"root v1")
            assert s.get_if_changed("queue/manifest", e1) is None
            assert s.get_if_changed("queue/manifest", e1) is None
            s.put("queue/manifest", b"root v2")
            r = s.get_if_changed("queue/manifest", e1)
            assert r is not None and r.data == b"root v2"
            assert s.get_if_changed("queue/manifest", r.etag) is None
            mine = s.counts.snapshot()
            assert mine == {("put", "root"): 2, ("get", "root"): 4}
            assert dict(rec.seen) == mine
            rec.seen.clear()


@pytest.mark.s3
@pytest.mark.slow
def test_counts_equal_what_the_s3_server_received(tmp_path: Path) -> None:
    """A whole life -- probe, bucket check, staged and direct producers, group writes,
    a consumer, GC, inspect -- counted by the buffer and by the server: the same."""
    from datetime import timedelta

    from tieredbuf.cli import inspect_buffer
    from tieredbuf.config import TreeConfig

    with recording_moto_server() as (ep, rec):
        bucket = ep.new_bucket()
        rec.bucket, rec.prefix = bucket, "buf/"
        buf = tieredbuf.open(f"s3://{bucket}/buf", tree=TreeConfig(m=4), **ep.options())
        assert not buf.exists()  # a HEAD 404 before any success: plus one LIST (bucket check)
        with buf.producer(flush_interval=timedelta(milliseconds=5)) as p:
            for i in range(12):  # m=4: the root spills into group objects
                p.produce([b"r%d" % i]).wait(timeout=30)
        with buf.producer(staging_dir=tmp_path / "stage") as sp:
            sp.produce([b"staged"])
        c = buf.consumer(dequeue_every=5)
        c.initialize()
        while (b := c.next_batch()) is not None:
            c.ack(b.sequence)
        c.flush()
        c.close()
        gc.run_once(buf, grace=timedelta(0))
        inspect_buffer(buf)
        mine = {k: v for k, v in buf.requests.snapshot().items() if v}
        server = dict(rec.seen)
    assert ("put_conditional", "probe") in mine  # the probe was counted too
    assert ("list", "other") in mine  # the bucket check
    assert ("put_conditional", "group") in mine and ("get", "group") in mine
    assert mine == server


def test_request_counts_are_thread_safe() -> None:
    counts = RequestCounts()

    def work() -> None:
        for _ in range(10_000):
            counts.add("get", "data/x")

    ts = [threading.Thread(target=work) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert counts.total() == 40_000


def test_a_server_side_copy_is_one_request_of_the_new_keys_kind(tmp_path: Path) -> None:
    s = MeteredStore(open_store(f"file://{tmp_path}/s"))
    s.inner.put("data/a.batch", b"x")
    s.copy("data/a.batch", "data/b.batch")
    assert s.counts.snapshot() == {("copy", "data"): 1}
    assert s.get("data/b.batch").data == b"x"
