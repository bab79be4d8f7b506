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
from tieredbuf.store.obserrors import map_error

_DUMP = '\n\nDebug source:\nGeneric {\n    store: "S3",\n    source: ...\n}'


def _generic(status: int, code: str, method: str = "PUT") -> obx.GenericError:
    """An obstore error as obstore 0.12.1 words it (status and code only in the text)."""
    return obx.GenericError(
        f"Generic S3 error: Error performing {method} http://h:1/b/k in 3ms - Server "
        f'returned non-2xx status code: {status} X: <?xml version="1.0"?><Error><Code>'
        f"{code}</Code><Message>m</Message></Error>{_DUMP}"
    )


_REFUSED = obx.GenericError(
    "Generic S3 error: Error performing PUT http://h:1/b/k in 1ms - HTTP error: error "
    "sending request\n\nDebug source:\n  HttpError {\n  kind: Connect,\n  source: "
    'ConnectError("tcp connect error", Os { code: 111, kind: ConnectionRefused, '
    'message: "Connection refused" })'
)
_TIMEOUT = obx.GenericError(
    "Generic S3 error: Error performing PUT http://h:1/b/k in 1s - HTTP error: error "
    "sending request\n\nDebug source:\n  HttpError {\n  kind: Timeout,\n  source: TimedOut"
)
_RESET = obx.GenericError(
    "Generic S3 error: Error performing PUT http://h:1/b/k in 1ms - HTTP error: error "
    "sending request\n\nDebug source:\n  HttpError {\n  kind: Interrupted,\n  Os { code: "
    '104, kind: ConnectionReset, message: "Connection reset by peer" }'
)

_DELETE_DENIED = obx.GenericError(
    "Generic S3 error: DeleteObjects request failed for key p/x: Access Denied (code: "
    'AccessDenied)\n\nDebug source:\nGeneric {\n    store: "S3",\n    source: DeleteFailed {'
    '\n        path: "p/x",\n        code: "AccessDenied",\n        message: "Access '
    'Denied",\n    },\n}'
)


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
        # transient, never sent: a write that did not land is not "outcome unknown"
        (_REFUSED, True, errors.StoreUnreachableError),
        (_REFUSED, False, errors.StoreUnreachableError),
        # transient, sent: a write may have landed
        (_TIMEOUT, True, errors.OutcomeUnknownError),
        (_RESET, True, errors.OutcomeUnknownError),
        (_generic(500, "InternalError"), True, errors.OutcomeUnknownError),
        (_TIMEOUT, False, errors.TransientStoreError),
        (_generic(500, "InternalError", "GET"), False, errors.TransientStoreError),
        (_generic(503, "SlowDown"), True, errors.TransientStoreError),
        (_generic(429, "TooManyRequests"), True, errors.TransientStoreError),
        # Azure: 503 ServerBusy is throttling (refused, not applied), not "may have landed"
        (_generic(503, "ServerBusy"), True, errors.TransientStoreError),
        # GCS / R2: a second write to one key within a second
        (_generic(429, "SlowDown"), True, errors.TransientStoreError),
        # permanent
        (obx.PermissionDeniedError("403 AccessDenied"), True, errors.AccessDeniedError),
        (_generic(403, "AccessDenied", "GET"), False, errors.AccessDeniedError),
        (_generic(403, "SignatureDoesNotMatch"), True, errors.CredentialsError),
        (_generic(403, "InvalidAccessKeyId"), True, errors.CredentialsError),
        (_generic(400, "ExpiredToken"), True, errors.CredentialsError),
        (_generic(403, "RequestTimeTooSkewed"), True, errors.CredentialsError),
        (obx.UnauthenticatedError("401"), False, errors.CredentialsError),
        (FileNotFoundError("404 <Code>NoSuchBucket</Code>"), False, errors.BucketNotFoundError),
        (_generic(404, "NoSuchBucket", "GET"), False, errors.BucketNotFoundError),
        (_generic(404, "ContainerNotFound", "GET"), False, errors.BucketNotFoundError),
        (_generic(403, "AuthenticationFailed", "GET"), False, errors.CredentialsError),
        (_generic(403, "AuthorizationPermissionMismatch"), True, errors.AccessDeniedError),
        (_generic(400, "InvalidArgument"), True, errors.PermanentStoreError),
        # one key of a DeleteObjects refused (200 with a per-key error): as obstore words it
        (_DELETE_DENIED, True, errors.AccessDeniedError),
        (obx.InvalidPathError("bad path"), True, errors.InvalidKeyError),
        (
            obx.GenericError(
                "Error performing PUT http://169.254.169.254/latest/api/token in "
                "1ms - Server returned non-2xx status code: 403 Forbidden"
            ),
            False,
            errors.CredentialsError,
        ),
        (
            obx.GenericError(
                "Error performing GET http://h/b/k in 1ms - HTTP error: builder "
                "error" + _DUMP + " BadScheme"
            ),
            False,
            errors.PermanentStoreError,
        ),
    ],
)
def test_map_error(exc: Exception, write: bool, expected: type[Exception]) -> None:
    mapped = map_error(exc, "k", write=write, bucket="b", where="http://h:1")
    assert isinstance(mapped, expected)
    permanent = isinstance(mapped, errors.PermanentStoreError)
    transient = isinstance(mapped, errors.TransientStoreError)
    assert not (permanent and transient)
    if transient and not isinstance(mapped, errors.OutcomeUnknownError):
        assert "may have landed" not in str(mapped)
    assert "\n" not in str(mapped) and "Debug source" not in str(mapped)  # one line
    if isinstance(mapped, errors.TransientStoreError) and "429" in str(exc):
        assert "throttling" in str(mapped)


def test_an_azure_message_with_request_id_lines_stays_one_line() -> None:
    e = obx.GenericError(
        "Generic MicrosoftAzure error: Error performing GET http://h:1/acct/c/k in 3ms - "
        'Server returned non-2xx status code: 403 Forbidden: <?xml version="1.0"?><Error>'
        "<Code>AuthorizationFailure</Code><Message>Server failed to authenticate the request."
        "\nRequestId:8b35\nTime:2026-01-01T00:00:00Z</Message></Error>" + _DUMP
    )
    mapped = map_error(e, "k", write=False, bucket="c", where="http://h:1/acct", provider="azure")
    assert isinstance(mapped, errors.CredentialsError)  # Azurite's word for a bad key
    assert "\n" not in str(mapped) and "RequestId" not in str(mapped)
    assert "AZURE_STORAGE_ACCOUNT_KEY" in str(mapped)


def test_messages_say_what_was_done_not_reading_for_a_put() -> None:
    nb = map_error(_generic(404, "NoSuchBucket"), "_probe/X", write=True, bucket="b")
    assert isinstance(nb, errors.BucketNotFoundError)
    assert "writing _probe/X" in str(nb) and "reading" not in str(nb)
    assert nb.bucket == "b"
    refused = map_error(_REFUSED, "queue/manifest", write=True)
    assert "not sent" in str(refused) and "outcome unknown" not in str(refused)
    assert "connection refused" in str(refused)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_unreachable_endpoint_is_transient_and_not_sent() -> None:
    s = open_store(
        "s3://bucket/p",
        endpoint=f"http://127.0.0.1:{_free_port()}",
        region="us-east-1",
        access_key_id="x",
        secret_access_key="y",
        max_retries=0,
        probe=False,
    )
    with pytest.raises(errors.StoreUnreachableError) as ei:
        s.put("k", b"v")
    assert isinstance(ei.value.__cause__, obx.BaseError)
    assert "may have landed" not in str(ei.value) and "\n" not in str(ei.value)
    with pytest.raises(errors.StoreUnreachableError):
        s.get("k")


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
def test_missing_bucket_is_bucket_not_found_on_every_operation(s3_endpoint: S3Endpoint) -> None:
    s = open_store("s3://tb-no-such-bucket-here/p", max_retries=0, **s3_endpoint.options())
    for op in (
        lambda: s.get("k"),
        lambda: s.head("k"),
        lambda: list(s.list("data/")),
        lambda: s.put("k", b"v", mode="create"),
    ):
        with pytest.raises(errors.BucketNotFoundError, match="does not exist") as ei:
            op()
        assert not isinstance(ei.value, errors.ObjectNotFoundError)
        assert ei.value.bucket == "tb-no-such-bucket-here"
        assert "\n" not in str(ei.value)


@pytest.mark.s3
def test_a_missing_object_in_a_bucket_that_exists_is_still_object_not_found(
    s3_endpoint: S3Endpoint,
) -> None:
    s = open_store(f"s3://{s3_endpoint.new_bucket()}/p", max_retries=0, **s3_endpoint.options())
    for _ in range(2):  # the second HEAD knows the bucket exists: no extra LIST
        with pytest.raises(errors.ObjectNotFoundError):
            s.head("k")


@pytest.mark.s3
def test_an_http_endpoint_implies_plain_http_and_refuses_allow_http_false(
    s3_endpoint: S3Endpoint,
) -> None:
    opts = {k: v for k, v in s3_endpoint.options().items() if k != "allow_http"}
    s = open_store(f"s3://{s3_endpoint.new_bucket()}/p", **opts)  # no allow_http
    s.put("k", b"v", mode="create")  # no BadScheme
    assert s.get("k").data == b"v"
    with pytest.raises(errors.ConfigError, match="plain HTTP"):
        open_store("s3://b/p", allow_http=False, **opts)


@pytest.fixture
def no_aws_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        "AWS_SKIP_SIGNATURE",
        "TIEREDBUF_S3_INSTANCE_METADATA",
    ):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.usefixtures("no_aws_credentials")
def test_no_credentials_fail_at_open_with_one_line_saying_how_to_give_them() -> None:
    with pytest.raises(errors.MissingCredentialsError) as ei:
        open_store("s3://b/p", endpoint="http://127.0.0.1:9", region="us-east-1")
    msg = str(ei.value)
    assert "\n" not in msg
    assert "AWS_ACCESS_KEY_ID" in msg and "AWS_SECRET_ACCESS_KEY" in msg
    assert "instance_metadata=True" in msg
    assert isinstance(ei.value, errors.ConfigError)  # the CLI exits 2
    with pytest.raises(errors.MissingCredentialsError, match="secret_access_key is not"):
        open_store("s3://b/p", access_key_id="x")


@pytest.mark.usefixtures("no_aws_credentials")
def test_credentials_from_other_sources_are_accepted_without_any_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert open_store("s3://b/p", skip_signature=True) is not None
    assert open_store("s3://b/p", instance_metadata=True) is not None
    monkeypatch.setenv("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "/v2/credentials/x")
    assert open_store("s3://b/p") is not None
