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

from tests.conftest import AzureEndpoint, S3Endpoint
from tests.faults import CountingStore
from tests.store.conftest import make_store
from tieredbuf import errors
from tieredbuf.store import GetResult, IfMatch, ObjectMeta, PutMode, Store, open_store
from tieredbuf.store.objstore import ObjStore
from tieredbuf.store.probe import ATTEMPTS, PROBES, ProbeCache, probe_conditional_writes


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


# --- lost responses: the probe must recognise its own landed writes (I2) ---------------

_ZERO_ETAG = '"00000000000000000000000000000000"'
PROBE_WRITES = {
    # which of the probe's requests has its response lost after the server applied it
    "create": ("PUT", 1),  # probe-1, If-None-Match: * (lands)
    "create-again": ("PUT", 2),  # probe-2, If-None-Match: * (refused 412)
    "if-match": ("PUT", 3),  # probe-3, If-Match: the current token (lands)
    "stale-if-match": ("PUT", 4),  # probe-4, If-Match: the now stale token (refused 412)
    "delete": ("POST", 1),  # the DeleteObjects that removes the probe object
}


class LoseOne:
    """Picks the ``nth`` ``method`` request to a ``_probe/`` key (or, for POST, S3's
    DeleteObjects) for the proxy to lose, and only that one: the
    client's retry then meets the write the server applied."""

    def __init__(self, method: str, nth: int) -> None:
        self.method, self.nth = method, nth
        self.seen = 0
        self.picked: list[str] = []

    def __call__(self, method: str, path: str, headers: Any) -> bool:
        if method != self.method:
            return False
        if method == "PUT" and "/_probe/" not in path:
            return False
        if method == "POST" and "delete" not in path and "comp=batch" not in path:
            return False  # neither S3's DeleteObjects nor an Azure Blob Batch
        self.seen += 1
        if self.seen != self.nth:
            return False
        self.picked.append(f"{method} {path} If-Match={headers.get('If-Match')}")
        return True


@pytest.mark.slow
@pytest.mark.s3
@pytest.mark.parametrize("client", ["obstore", "botocore"])
@pytest.mark.parametrize("lost", list(PROBE_WRITES))
def test_I2_probe_recognises_its_own_write_whose_response_was_lost(
    s3_endpoint: S3Endpoint, lost: str, client: str
) -> None:
    """Invariant I2 for the probe itself: through a proxy that lets the server apply one
    probe write and then drops its response, the client retries; a retried create meets
    its own object (AlreadyExistsError), a retried If-Match meets the etag it made
    (PreconditionFailedError).  The probe reads the object back, finds its own body and
    passes: one lost response never makes a working store look broken (on real S3 it
    would refuse, fatally, every producer of the process).  obstore and botocore (the
    client of a forked child) both retry a write whose response was lost."""
    from tests.latency_proxy import LatencyProxy
    from tieredbuf.store.botostore import BotoS3Store

    bucket = s3_endpoint.new_bucket()
    pick = LoseOne(*PROBE_WRITES[lost])
    with LatencyProxy(s3_endpoint.endpoint, {}, lose_if=pick) as proxy:
        opts: dict[str, Any] = {
            **s3_endpoint.options(),
            "endpoint": proxy.endpoint,
            "max_retries": 2,
            "retry_timeout": 10,
        }
        s = open_store(f"s3://{bucket}/p", **opts)
        assert isinstance(s, ObjStore) and s.s3 is not None
        store: Store = (
            ObjStore(s.obstore, s.url) if client == "obstore" else BotoS3Store(s.s3, s.url)
        )
        probe_conditional_writes(store, f"S3 endpoint {proxy.endpoint}")
        assert proxy.counts["lost"] == 1, pick.picked  # the fault fired, exactly once
        assert list(store.list("_probe/")) == []  # and the probe object is gone


@pytest.mark.azure
@pytest.mark.parametrize(
    "lost", [("create", "PUT", 1), ("if-match", "PUT", 3), ("delete", "POST", 1)], ids=str
)
def test_I2_probe_recognises_its_own_write_whose_response_was_lost_on_azure(
    azurite_endpoint: AzureEndpoint, lost: tuple[str, str, int]
) -> None:
    """The same on Azure Blob (Azurite): a create retried onto its own blob answers 409
    BlobAlreadyExists, an If-Match retried onto its own write 412 ConditionNotMet."""
    from tests.latency_proxy import LatencyProxy

    container = azurite_endpoint.new_container()
    pick = LoseOne(lost[1], lost[2])
    with LatencyProxy(azurite_endpoint.endpoint, {}, lose_if=pick) as proxy:
        opts: dict[str, Any] = {
            **azurite_endpoint.options(),
            "endpoint": f"{proxy.endpoint}/{azurite_endpoint.account_name}",
            "retry_timeout": 10,
        }
        s = open_store(f"az://{container}/p", **opts)
        assert isinstance(s, ObjStore)
        store = ObjStore(s.obstore, s.url)
        probe_conditional_writes(store, f"Azure Blob endpoint {proxy.endpoint}")
        assert proxy.counts["lost"] == 1, (pick.picked, proxy.counts)
        assert list(store.list("_probe/")) == []


class RefusesIfMatch(IgnoresModes):
    """A store that enforces create-if-absent and answers every If-Match with ``error``;
    with ``apply`` it writes first (a refusal that nevertheless landed)."""

    def __init__(self, error: type[errors.ConflictError], apply: bool = False) -> None:
        super().__init__(honour_create=True)
        self.error, self.apply = error, apply
        self.if_match = 0

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = "overwrite") -> str:
        if not isinstance(mode, IfMatch):
            return super().put(key, data, mode=mode)
        self.if_match += 1
        if self.apply:
            self._inner.put(key, data)
        raise self.error(key)


def test_probe_concludes_from_a_refusal_no_lost_response_explains() -> None:
    """A 412 on If-Match with the etag the store itself gave out, the object read back
    unchanged (probe-1 under that etag): the write did not land, so the store is judged
    unable -- once, without retrying a verdict."""
    fake = RefusesIfMatch(errors.PreconditionFailedError)
    with pytest.raises(
        errors.ConditionalWritesUnsupportedError, match=r"no lost response explains"
    ):
        probe_conditional_writes(fake, "S3 endpoint http://fake:9000")
    assert fake.if_match == 1  # the right token (step 3), refused once: the verdict
    assert list(fake.list("")) == []


def test_probe_takes_a_conflict_with_the_object_unchanged_for_no_verdict() -> None:
    """A 409 (S3's ConditionalRequestConflict: another conditional write in flight, e.g.
    the probe's own first attempt) proves nothing about the store: the probe tries
    again and then fails as transient, never as ConditionalWritesUnsupportedError."""
    fake = RefusesIfMatch(errors.AlreadyExistsError)
    with pytest.raises(errors.TransientStoreError, match=r"conflict") as info:
        probe_conditional_writes(fake, "S3 endpoint http://fake:9000")
    assert not isinstance(info.value, errors.PermanentStoreError)
    assert fake.if_match == ATTEMPTS


def test_probe_recognises_a_landed_if_match_reported_as_refused() -> None:
    """The Store-level picture of a lost response: the If-Match with the right token
    (step 3) lands and the caller sees PreconditionFailedError.  The probe reads probe-3
    back and goes on; the stale token (step 4) is then refused, and it passes."""

    class LandsThenRefuses(RefusesIfMatch):
        def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = "overwrite") -> str:
            if isinstance(mode, IfMatch) and self.if_match:
                self.if_match += 1
                raise errors.PreconditionFailedError(key)  # step 4: a plain refusal
            return super().put(key, data, mode=mode)

    landed = LandsThenRefuses(errors.PreconditionFailedError, apply=True)
    probe_conditional_writes(landed, "S3 endpoint http://fake:9000")
    assert landed.if_match == 2 and list(landed.list("")) == []


def test_probe_rejects_a_store_that_applies_a_write_it_refused() -> None:
    """A store that answers the second create (step 2) AlreadyExists but writes it, so
    the right token is refused afterwards (step 3: it moved): the object read back
    holds probe-2."""

    class AppliesRefusedCreate(RefusesIfMatch):
        def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = "overwrite") -> str:
            if mode == "create" and key in {m.key for m in self._inner.list("")}:
                self._inner.put(key, data)
                raise errors.AlreadyExistsError(key)
            return super().put(key, data, mode=mode)

    fake = AppliesRefusedCreate(errors.PreconditionFailedError)
    with pytest.raises(
        errors.ConditionalWritesUnsupportedError, match=r"applied a conditional write it refused"
    ):
        probe_conditional_writes(fake, "S3 endpoint http://fake:9000")
