"""obstore errors land on the tieredbuf error tree; transport failures of writes are
OutcomeUnknownError (the write may have landed), of reads plain StoreError; retries and
timeouts are bounded."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
from obstore import exceptions as obx

from tests.conftest import S3Endpoint
from tieredbuf import errors
from tieredbuf.store import open_store
from tieredbuf.store.objstore import map_error


@pytest.mark.parametrize(
    ("exc", "write", "expected"),
    [
        (obx.AlreadyExistsError("412 Precondition Failed"), True, errors.AlreadyExistsError),
        # a 409 ConditionalRequestConflict on If-Match surfaces as AlreadyExistsError: a conflict
        (
            obx.AlreadyExistsError("409 Conflict ConditionalRequestConflict"),
            True,
            errors.ConflictError,
        ),
        (obx.PreconditionError("412"), True, errors.PreconditionFailedError),
        (FileNotFoundError("Object at location k not found"), False, errors.ObjectNotFoundError),
        (obx.GenericError("HTTP error: error sending request"), True, errors.OutcomeUnknownError),
        (obx.GenericError("operation timed out"), True, errors.OutcomeUnknownError),
        (obx.GenericError("connection reset by peer"), True, errors.OutcomeUnknownError),
        (
            obx.GenericError("Server returned non-2xx status code: 503 Slow Down"),
            True,
            errors.OutcomeUnknownError,
        ),
        (obx.GenericError("HTTP error: error sending request"), False, errors.StoreError),
        (obx.PermissionDeniedError("403 AccessDenied"), True, errors.StoreError),
        (FileNotFoundError("404 <Code>NoSuchBucket</Code>"), False, errors.StoreError),
    ],
)
def test_map_error(exc: Exception, write: bool, expected: type[Exception]) -> None:
    mapped = map_error(exc, "k", write=write)
    assert isinstance(mapped, expected)
    if expected is errors.StoreError:
        assert not isinstance(mapped, errors.OutcomeUnknownError | errors.ObjectNotFoundError)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_unreachable_endpoint_write_is_outcome_unknown_read_is_store_error() -> None:
    s = open_store(
        "s3://bucket/p",
        endpoint=f"http://127.0.0.1:{_free_port()}",
        region="us-east-1",
        access_key_id="x",
        secret_access_key="y",
        allow_http=True,
        max_retries=0,
        probe=False,
    )
    with pytest.raises(errors.OutcomeUnknownError) as ei:
        s.put("k", b"v")
    assert isinstance(ei.value.__cause__, obx.BaseError)
    with pytest.raises(errors.StoreError) as ri:
        s.get("k")
    assert not isinstance(ri.value, errors.OutcomeUnknownError)


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A TCP listener that never answers: requests to it can only time out."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    try:
        yield int(srv.getsockname()[1])
    finally:
        srv.close()


def test_a_hanging_put_times_out_as_outcome_unknown_within_the_bound(silent_server: int) -> None:
    s = open_store(
        "s3://bucket/p",
        endpoint=f"http://127.0.0.1:{silent_server}",
        region="us-east-1",
        access_key_id="x",
        secret_access_key="y",
        allow_http=True,
        timeout=0.3,
        max_retries=1,
        retry_timeout=2,
        probe=False,
    )
    t0 = time.monotonic()
    with pytest.raises(errors.OutcomeUnknownError):
        s.put("k", b"v", mode="overwrite")
    assert time.monotonic() - t0 < 5


@pytest.mark.s3
def test_missing_bucket_is_a_store_error_not_a_missing_object(s3_endpoint: S3Endpoint) -> None:
    s = open_store("s3://tb-no-such-bucket-here/p", max_retries=0, **s3_endpoint.options())
    with pytest.raises(errors.StoreError, match="bucket does not exist") as ei:
        s.get("k")
    assert not isinstance(ei.value, errors.ObjectNotFoundError)
