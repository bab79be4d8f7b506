"""The S3 conditional-write probe (ConditionalWritesUnsupportedError).

No S3 server that silently ignores If-None-Match / If-Match is available here, so the
negative cases run the probe against Store stand-ins that ignore the modes exactly the
way such a server would (the probe only talks to the Store contract, so this is the
same code path); the positive cases run against moto and SeaweedFS over HTTP.
"""

from __future__ import annotations

import builtins
import uuid
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import S3Endpoint
from tests.faults import CountingStore
from tests.store.conftest import make_store
from tieredbuf import errors
from tieredbuf.store import GetResult, IfMatch, ObjectMeta, PutMode, Store, open_store
from tieredbuf.store.objstore import ObjStore
from tieredbuf.store.probe import PROBES, ProbeCache, probe_conditional_writes


class IgnoresModes:
    """A store that treats every put as "overwrite" (a non-conforming S3 server);
    with ``honour_create`` it enforces If-None-Match but still ignores If-Match."""

    def __init__(self, honour_create: bool = False) -> None:
        self._inner = open_store("memory://")
        self._honour_create = honour_create

    @property
    def url(self) -> str:
        return "s3://fake/ignores-modes"

    def get(self, key: str) -> GetResult:
        return self._inner.get(key)

    def get_if_changed(self, key: str, etag: str) -> GetResult | None:
        return self._inner.get_if_changed(key, etag)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        return self._inner.get_range(key, start, end)

    def get_suffix(self, key: str, length: int) -> bytes:
        return self._inner.get_suffix(key, length)

    def head(self, key: str) -> ObjectMeta:
        return self._inner.head(key)

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = "overwrite") -> str:
        if self._honour_create and mode == "create":
            return self._inner.put(key, data, mode="create")
        return self._inner.put(key, data, mode="overwrite")

    def put_multipart(
        self, key: str, chunks: Iterable[bytes | memoryview], *, mode: PutMode = "create"
    ) -> str:
        return self.put(key, b"".join(chunks), mode=mode)

    def copy(self, src: str, dst: str) -> None:
        self.put(dst, self.get(src).data)

    def list(self, prefix: str) -> Iterator[ObjectMeta]:
        return self._inner.list(prefix)

    def delete_many(self, keys: Sequence[str]) -> builtins.list[tuple[str, Exception]]:
        return self._inner.delete_many(keys)

    def close(self) -> None:
        pass


def test_probe_rejects_a_server_that_ignores_if_none_match() -> None:
    fake = IgnoresModes()
    with pytest.raises(
        errors.ConditionalWritesUnsupportedError, match=r"http://fake:9000.*If-None-Match"
    ):
        probe_conditional_writes(fake, "S3 endpoint http://fake:9000")
    assert list(fake.list("")) == []  # the probe object was deleted


def test_probe_rejects_a_server_that_ignores_if_match() -> None:
    fake = IgnoresModes(honour_create=True)
    with pytest.raises(errors.ConditionalWritesUnsupportedError, match=r"fake:9000.*If-Match"):
        probe_conditional_writes(fake, "S3 endpoint http://fake:9000")
    assert list(fake.list("")) == []


class LosesTheFirstReplaceAnswer(IgnoresModes):
    """A conforming store (memory) whose first replace-if-match lands and then reports a
    conflict: a client that retried it after its answer was lost and met its own write
    (invariant I2)."""

    def __init__(self) -> None:
        super().__init__()
        self.lost = 0

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = "overwrite") -> str:
        etag = self._inner.put(key, data, mode=mode)
        if isinstance(mode, IfMatch) and self.lost == 0:
            self.lost += 1
            raise errors.PreconditionFailedError(key)
        return etag


def test_I2_the_probe_takes_its_own_landed_replace_for_success_not_a_refusal() -> None:
    fake = LosesTheFirstReplaceAnswer()
    probe_conditional_writes(fake, "GCS endpoint http://fake (bucket 'b')")
    assert fake.lost == 1
    assert list(fake.list("")) == []


def test_probe_failures_are_not_cached_and_successes_are() -> None:
    cache = ProbeCache()
    with pytest.raises(errors.ConditionalWritesUnsupportedError):
        cache.ensure(("http://fake", "b"), IgnoresModes(), "fake")
    assert not cache.passed(("http://fake", "b"))
    good = CountingStore(open_store("memory://"))
    cache.ensure(("http://good", "b"), good, "good")
    cache.ensure(("http://good", "b"), good, "good")
    assert cache.passed(("http://good", "b"))
    assert good.counts["put"] == 4  # probed once: create, create, If-Match, stale If-Match


@pytest.mark.s3
@pytest.mark.parametrize("backend", ["moto", "seaweedfs"])
def test_probe_passes_on_real_s3_servers(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    s, _, _ = make_store(backend, request, tmp_path)
    assert isinstance(s, ObjStore)
    raw = ObjStore(s.obstore, s.url)  # no probe target: talk to the server directly
    probe_conditional_writes(raw, s.url)
    assert list(s.list("_probe/")) == []


@pytest.mark.s3
def test_first_conditional_write_probes_once_per_endpoint_and_bucket(
    s3_endpoint: S3Endpoint,
) -> None:
    bucket = s3_endpoint.new_bucket()
    target = (s3_endpoint.endpoint, bucket)
    opts: dict[str, Any] = dict(s3_endpoint.options())
    s = open_store(f"s3://{bucket}/p-{uuid.uuid4().hex[:8]}", **opts)
    s.put("plain", b"x")  # an unconditional write does not probe
    assert not PROBES.passed(target)
    s.put("c", b"x", mode="create")
    assert PROBES.passed(target)
    e = s.head("c").etag
    assert e is not None
    s.put("c", b"y", mode=IfMatch(e))
    assert list(s.list("_probe/")) == []


@pytest.mark.s3
def test_probe_false_skips_the_probe(s3_endpoint: S3Endpoint) -> None:
    bucket = s3_endpoint.new_bucket()
    s = open_store(f"s3://{bucket}/p", probe="false", **s3_endpoint.options())
    s.put("c", b"x", mode="create")
    assert not PROBES.passed((s3_endpoint.endpoint, bucket))


def test_store_protocol_is_satisfied_by_the_stand_in() -> None:
    assert isinstance(IgnoresModes(), Store)
