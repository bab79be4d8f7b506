"""The store contract (tieredbuf/store/base.py), run unchanged against every backend:
memory, local directory, moto server over HTTP and SeaweedFS (fixture ``store``), and
get_if_changed against a server that ignores If-None-Match (moto behind a proxy)."""

from __future__ import annotations

import os
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler

import pytest

from tests.endpoint import S3Endpoint
from tests.latency_proxy import LatencyProxy
from tieredbuf import errors
from tieredbuf.store import IfMatch, ObjStore, Store, open_store
from tieredbuf.store.base import KeepsChecksums, ReadsInto, Stored
from tieredbuf.store.botostore import BotoS3Store


def test_get_returns_data_and_the_etag_put_returned(store: Store) -> None:
    etag = store.put("a/obj", b"hello world")
    r = store.get("a/obj")
    assert r.data == b"hello world"
    assert r.etag == etag
    assert isinstance(etag, str) and etag


def test_empty_object_round_trips(store: Store) -> None:
    store.put("empty", b"")
    assert store.get("empty").data == b""
    assert store.head("empty").size == 0
    assert store.get_suffix("empty", 4) == b""
    assert store.get_range("empty", 0, 4) == b""


def test_put_accepts_memoryview(store: Store) -> None:
    buf = bytearray(b"xxhello")
    store.put("mv", memoryview(buf)[2:])
    assert store.get("mv").data == b"hello"


def test_ranged_get_is_half_open_and_clipped(store: Store) -> None:
    store.put("r", b"0123456789")
    assert store.get_range("r", 2, 5) == b"234"
    assert store.get_range("r", 0, 10) == b"0123456789"
    assert store.get_range("r", 8, 50) == b"89"
    assert store.get_range("r", 3, 3) == b""
    assert store.get_range("r", 10, 20) == b""
    assert store.get_range("r", 25, 30) == b""
    with pytest.raises(ValueError):
        store.get_range("r", 5, 2)


GCS_READS = (
    "google-cloud-storage's downloads give neither the object's size nor its custom "
    "metadata with the bytes: a ranged read is get_range plus the HEAD a large object's "
    "reader sends anyway, and the checksum is GCS's own CRC32C, which the client checks on "
    "every download (docs/format.md, Checksums)"
)


def _reads_into(store: Store, backend: str) -> None:
    if backend.startswith("fake-gcs"):
        if backend == "fake-gcs":  # (a metered store forwards to what it wraps)
            assert not isinstance(store, ReadsInto) and not isinstance(store, KeepsChecksums)
        pytest.skip(GCS_READS)
    assert isinstance(store, ReadsInto)


def test_read_into_fills_the_callers_buffer_and_says_the_objects_size(
    store: Store, backend: str
) -> None:
    """ReadsInto (every backend has it but GCS): a range read straight into a buffer, and
    the object's size from that one response -- clipped like get_range where the object
    ends early, so a reader of parts can tell an object of another size without a HEAD."""
    _reads_into(store, backend)
    store.put("ri", b"0123456789")
    out = bytearray(b"." * 6)
    view = memoryview(out)
    assert store.read_into("ri", 2, view[1:4]) == Stored(10)
    assert out == b".234.."
    assert store.read_into("ri", 7, view) == Stored(10)  # the object ends: 3 bytes written
    assert out == b"7894.."
    assert store.read_into("ri", 10, view) == Stored(10)  # nothing there, the size known
    assert store.read_into("ri", 25, view[:2]) == Stored(10)
    assert store.read_into("ri", 0, view[:0]) == Stored(10)
    store.put("ri-empty", b"")
    assert store.read_into("ri-empty", 0, view) == Stored(0)
    with pytest.raises(errors.ObjectNotFoundError):
        store.read_into("ri-missing", 0, view)


def test_read_into_a_large_range_is_whole(store: Store, backend: str) -> None:
    _reads_into(store, backend)
    body = os.urandom(3 << 20)
    store.put_multipart("ri-big", [body[: 1 << 20], body[1 << 20 :]], mode="create")
    out = bytearray(len(body) - 100)
    assert store.read_into("ri-big", 100, memoryview(out)) == Stored(len(body))
    assert bytes(out) == body[100:]


def test_a_checksum_kept_beside_an_object_comes_back_with_every_read(
    store: Store, backend: str
) -> None:
    """KeepsChecksums (every backend but GCS; a local directory without user xattrs keeps
    none): the CRC32 a writer gave comes back with a GET, a ranged read and after a copy;
    a plain PUT over the object (``aws s3 cp``) leaves none; the bytes are the bytes."""
    _reads_into(store, backend)
    assert isinstance(store, KeepsChecksums)
    kept = backend != "localdir-noxattr"
    body = b"0123456789"
    store.put_checksummed("ck/a", body, 0x89ABCDEF, mode="create")
    got = store.get("ck/a")
    assert got.data == body and got.crc32 == (0x89ABCDEF if kept else None)
    assert store.head("ck/a").size == len(body)
    out = bytearray(4)
    said = store.read_into("ck/a", 3, memoryview(out))  # type: ignore[attr-defined]
    assert out == b"3456" and said == Stored(10, 0x89ABCDEF if kept else None)
    store.copy("ck/a", "ck/b")
    assert store.get("ck/b").crc32 == (0x89ABCDEF if kept else None)
    store.put("ck/a", b"other bytes", mode="overwrite")
    assert store.get("ck/a").crc32 is None
    store.put("ck/c", body, mode="create")
    assert store.get("ck/c").crc32 is None
    with pytest.raises(errors.AlreadyExistsError):
        store.put_checksummed("ck/c", body, 1, mode="create")


def test_suffix_get(store: Store) -> None:
    store.put("s", b"0123456789")
    assert store.get_suffix("s", 3) == b"789"
    assert store.get_suffix("s", 10) == b"0123456789"
    assert store.get_suffix("s", 1000) == b"0123456789"
    assert store.get_suffix("s", 0) == b""


def test_head(store: Store) -> None:
    etag = store.put("h/x", b"12345")
    meta = store.head("h/x")
    assert meta.key == "h/x"
    assert meta.size == 5
    assert meta.etag == etag
    assert meta.last_modified is not None


@pytest.mark.parametrize("op", ["get", "head", "get_range", "get_suffix", "get_if_changed"])
def test_missing_key_is_object_not_found_and_file_not_found(store: Store, op: str) -> None:
    calls: dict[str, Callable[[], object]] = {
        "get": lambda: store.get("no/such"),
        "head": lambda: store.head("no/such"),
        "get_range": lambda: store.get_range("no/such", 0, 4),
        "get_suffix": lambda: store.get_suffix("no/such", 4),
        "get_if_changed": lambda: store.get_if_changed("no/such", '"0"'),
    }
    with pytest.raises(errors.ObjectNotFoundError) as ei:
        calls[op]()
    assert isinstance(ei.value, FileNotFoundError)
    assert ei.value.key == "no/such"


# --- get_if_changed: a GET with If-None-Match ----------------------------------------
# Probed over HTTP (a proxy noting the status, through obstore and botocore): moto 5.2.5,
# SeaweedFS 4.48 and Azurite 3.37 all answer 304 (no body) while the object is unchanged
# and 200 with the object once it changed; obstore's memory store raises NotModified
# itself.  A server answering 200 to an unchanged object would still pass these tests:
# each store compares the etag it got with the one it sent.


def test_get_if_changed_is_none_while_the_object_is_unchanged(store: Store) -> None:
    etag = store.put("queue/manifest", b"root v1", mode="create")
    assert store.get_if_changed("queue/manifest", etag) is None
    assert store.get_if_changed("queue/manifest", store.get("queue/manifest").etag) is None
    assert store.get("queue/manifest").data == b"root v1"  # and it is still there


def test_get_if_changed_after_an_overwrite_returns_the_new_object(store: Store) -> None:
    e1 = store.put("queue/manifest", b"root v1")
    e2 = store.put("queue/manifest", b"root v2, longer", mode="overwrite")
    r = store.get_if_changed("queue/manifest", e1)
    assert r is not None
    assert (r.data, r.etag) == (b"root v2, longer", e2)
    assert store.get_if_changed("queue/manifest", r.etag) is None  # the new one, unchanged


def test_get_if_changed_after_a_cas_replacement_returns_the_new_object(store: Store) -> None:
    e1 = store.put("queue/manifest", b"root v1", mode="create")
    e2 = store.put("queue/manifest", b"root v2", mode=IfMatch(e1))
    r = store.get_if_changed("queue/manifest", e1)
    assert r is not None
    assert (r.data, r.etag) == (b"root v2", e2)
    assert r == store.get("queue/manifest")


def test_get_if_changed_with_another_objects_etag_returns_the_object(store: Store) -> None:
    other = store.put("queue/other", b"another object")
    etag = store.put("queue/manifest", b"the root")
    assert other != etag
    r = store.get_if_changed("queue/manifest", other)
    assert r is not None
    assert (r.data, r.etag) == (b"the root", etag)


def test_get_if_changed_of_a_deleted_object_is_object_not_found(store: Store) -> None:
    etag = store.put("queue/manifest", b"root")
    assert store.delete_many(["queue/manifest"]) == []
    with pytest.raises(errors.ObjectNotFoundError):
        store.get_if_changed("queue/manifest", etag)


class _DropsIfNoneMatch(LatencyProxy):
    """A proxy in front of moto that strips If-None-Match from GETs: a server that
    ignores the header, as some S3-compatible ones may (it answers 200, never 304)."""

    dropped = 0

    def forward(self, h: BaseHTTPRequestHandler) -> None:
        if h.command == "GET" and h.headers.get("If-None-Match") is not None:
            del h.headers["If-None-Match"]
            self.dropped += 1
        super().forward(h)


@pytest.mark.s3
@pytest.mark.parametrize("client", ["obstore", "botocore"])
def test_get_if_changed_compares_etags_where_the_server_ignores_if_none_match(
    s3_endpoint: S3Endpoint, client: str
) -> None:
    bucket = s3_endpoint.new_bucket()
    with _DropsIfNoneMatch(s3_endpoint.endpoint, delays={}) as proxy:
        opts = dict(s3_endpoint.options(), endpoint=proxy.endpoint)
        obj = open_store(f"s3://{bucket}/buf", **opts)
        assert isinstance(obj, ObjStore) and obj.s3 is not None
        store: Store = obj if client == "obstore" else BotoS3Store(obj.s3, obj.url)
        e1 = store.put("queue/manifest", b"root v1")
        assert store.get_if_changed("queue/manifest", e1) is None  # 200, the same etag
        e2 = store.put("queue/manifest", b"root v2")
        r = store.get_if_changed("queue/manifest", e1)
        assert r is not None and (r.data, r.etag) == (b"root v2", e2)
        assert proxy.dropped == 2  # both answered 200: the comparison decided


def test_create_if_absent(store: Store) -> None:
    etag = store.put("c", b"first", mode="create")
    with pytest.raises(errors.AlreadyExistsError) as ei:
        store.put("c", b"second", mode="create")
    assert isinstance(ei.value, errors.ConflictError)
    r = store.get("c")
    assert (r.data, r.etag) == (b"first", etag)


def test_replace_if_match(store: Store) -> None:
    e1 = store.put("m", b"v1", mode="create")
    e2 = store.put("m", b"v2", mode=IfMatch(e1))
    assert e2 != e1
    assert store.get("m") == type(store.get("m"))(data=b"v2", etag=e2)
    with pytest.raises(errors.PreconditionFailedError):
        store.put("m", b"v3", mode=IfMatch(e1))  # stale
    assert store.get("m").data == b"v2"
    e3 = store.put("m", b"v3", mode=IfMatch(e2))
    assert store.get("m").etag == e3


def test_replace_if_match_on_missing_key_fails(store: Store) -> None:
    e = store.put("other", b"x")
    # S3 servers differ: moto 404 -> ObjectNotFound, SeaweedFS 412 -> PreconditionFailed
    with pytest.raises((errors.ObjectNotFoundError, errors.PreconditionFailedError)):
        store.put("missing", b"v", mode=IfMatch(e))
    with pytest.raises(errors.ObjectNotFoundError):
        store.get("missing")


def test_overwrite(store: Store) -> None:
    e1 = store.put("o", b"one")
    e2 = store.put("o", b"two", mode="overwrite")
    assert e1 != e2
    assert store.get("o").data == b"two"


def test_list_prefix_returns_only_that_prefix(store: Store) -> None:
    for k in ["data/a.batch", "data/b.batch", "data/sub/c.batch", "datax/d", "queue/manifest"]:
        store.put(k, k.encode())
    assert sorted(m.key for m in store.list("data/")) == [
        "data/a.batch",
        "data/b.batch",
        "data/sub/c.batch",
    ]
    assert sorted(m.key for m in store.list("data")) == [
        "data/a.batch",
        "data/b.batch",
        "data/sub/c.batch",
        "datax/d",
    ]
    assert sorted(m.key for m in store.list("data/a")) == ["data/a.batch"]
    assert [m.key for m in store.list("queue/")] == ["queue/manifest"]
    assert list(store.list("nothing/")) == []
    sizes = {m.key: m.size for m in store.list("")}
    assert sizes == {k: len(k) for k in sizes} and len(sizes) == 5


def test_copy_to_a_fresh_key_inside_the_store(store: Store) -> None:
    body = bytes(range(256)) * 40
    store.put("data/src", body, mode="create")
    store.copy("data/src", "data/dst")
    assert store.get("data/dst").data == body
    assert store.delete_many(["data/src"]) == []  # the copy does not depend on the source
    assert store.get("data/dst").data == body
    with pytest.raises(errors.ObjectNotFoundError):
        store.copy("data/src", "data/other")


def test_delete_many_is_idempotent(store: Store) -> None:
    for k in ["d/1", "d/2", "d/3"]:
        store.put(k, b"x")
    assert store.delete_many(["d/1", "d/2", "d/never"]) == []
    assert [m.key for m in store.list("d/")] == ["d/3"]
    assert store.delete_many(["d/1", "d/2"]) == []
    assert store.delete_many([]) == []
    with pytest.raises(errors.ObjectNotFoundError):
        store.get("d/1")
    store.put("d/1", b"again", mode="create")  # a deleted key can be created again
    assert store.get("d/1").data == b"again"


def test_put_multipart_round_trips_a_multi_megabyte_object(store: Store) -> None:
    chunks = [os.urandom(1 << 20) for _ in range(3)] + [os.urandom(3 << 20), b"tail"]
    whole = b"".join(chunks)
    etag = store.put_multipart("big/obj", iter(chunks), mode="create")
    r = store.get("big/obj")
    assert r.data == whole and r.etag == etag
    assert store.get_range("big/obj", (5 << 20) - 3, (5 << 20) + 3) == whole[(5 << 20) - 3 :][:6]
    with pytest.raises(errors.AlreadyExistsError):
        store.put_multipart("big/obj", [b"x"], mode="create")
    e2 = store.put_multipart("big/obj", [b"small", b"er"], mode=IfMatch(etag))
    assert store.get("big/obj") == type(r)(data=b"smaller", etag=e2)


def test_put_multipart_overwrite_streams_many_parts(store: Store) -> None:
    part = os.urandom(1 << 20)
    chunks = [part] * 12  # 12 MiB: more than one S3 part at the 8 MiB chunk size
    etag = store.put_multipart("big/ow", iter(chunks), mode="overwrite")
    assert store.head("big/ow").size == 12 << 20
    r = store.get("big/ow")
    assert r.data == part * 12 and r.etag == etag


@pytest.mark.parametrize("key", ["", "/abs", "a/../b", "..", "a//b", "a/./b", "trailing/"])
def test_malformed_keys_are_rejected(store: Store, key: str) -> None:
    with pytest.raises(errors.InvalidKeyError):
        store.put(key, b"x")
    with pytest.raises(errors.InvalidKeyError):
        store.get(key)


def test_url_names_the_store(store: Store) -> None:
    assert "://" in store.url
