"""Classify a failed store request: permanent or transient, sent or not, in one line.

Both S3 clients (obstore, and botocore in a forked child: see :mod:`tieredbuf.store.fork`)
describe a failure by the same few facts -- HTTP status, S3 error code, whether the
connection was ever made -- and :func:`classify` turns those into the error tree of
:mod:`tieredbuf.errors`:

* permanent: credentials rejected or missing, access denied, the bucket missing, a key
  the server refuses, any other 4xx the server would answer again;
* transient: nothing sent (connection refused, DNS), throttling (429, SlowDown), 5xx,
  timeouts and resets.  A write that may have reached the server is
  OutcomeUnknownError; one that was never sent is StoreUnreachableError.

Messages are one line: the library's debug dump stays in ``__cause__`` (a copy with
credentials masked: :mod:`tieredbuf.runtime.redact`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from tieredbuf.errors import (
    AccessDeniedError,
    AlreadyExistsError,
    BucketNotFoundError,
    CredentialsError,
    InvalidKeyError,
    ObjectNotFoundError,
    OutcomeUnknownError,
    PermanentStoreError,
    PreconditionFailedError,
    StoreUnreachableError,
    TransientStoreError,
)

Tag = Literal[
    "already_exists", "precondition", "not_found", "unauthenticated", "permission",
    "invalid_path", "unsupported", "bad_request",
]
"""What the client's own exception type says (obstore exception classes)."""

CREDENTIAL_CODES = frozenset({
    "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
    "TokenRefreshRequired", "RequestTimeTooSkewed", "AuthorizationHeaderMalformed",
    "InvalidSecurity", "MissingSecurityHeader", "CredentialsNotSupported",
})
ACCESS_CODES = frozenset({"AccessDenied", "AllAccessDisabled", "AccountProblem"})
THROTTLE_CODES = frozenset({"SlowDown", "RequestLimitExceeded", "Throttling", "TooManyRequests"})
_METADATA_RE = re.compile(r"169\.254\.169\.254|169\.254\.170\.2|fd00:ec2::254|/latest/api/token")


@dataclass(frozen=True, slots=True)
class Facts:
    """What a failed request says about itself."""

    tag: Tag | None = None
    status: int | None = None
    code: str | None = None
    """The S3 error code (``NoSuchBucket``, ``AccessDenied``, ``SlowDown`` ...)."""
    message: str | None = None
    connect: bool = False
    """The connection was never made: nothing was sent."""
    transport: str | None = None
    """A transport failure after connecting (timeout, reset), lower case."""
    method: str | None = None
    uri: str | None = None
    metadata_service: bool = False
    """The failure came from fetching credentials from a cloud metadata endpoint."""
    bad_scheme: bool = False

    @property
    def summary(self) -> str:
        what = f"{self.method} {self.uri}" if self.method and self.uri else "request"
        if self.status is not None:
            why = f"HTTP {self.status}"
            if self.code:
                why += f" {self.code}"
            if self.message:
                why += f": {self.message}"
        elif self.transport:
            why = self.transport
        else:
            why = "failed"
        return f"{what}: {why}"


def is_metadata_uri(text: str) -> bool:
    return bool(_METADATA_RE.search(text))


def classify(
    f: Facts, key: str, *, write: bool, bucket: str | None = None, where: str | None = None,
) -> Exception:
    """The tieredbuf error for a failed operation on ``key``.  ``bucket`` and ``where``
    (the endpoint) only name things in the message."""
    op = f"{'writing' if write else 'reading'} {key}"
    at = f" at {where}" if where else ""
    if f.tag == "already_exists":
        # also a 409 ConditionalRequestConflict on If-Match: another writer won
        return AlreadyExistsError(key, f"object already exists (or CAS conflict): {key}")
    if f.tag == "precondition" or f.status == 412:
        return PreconditionFailedError(key, f"precondition failed on {key}")
    if f.code == "NoSuchBucket":
        name = bucket or "?"
        return BucketNotFoundError(
            name, f"bucket {name!r} does not exist{at} ({op}): create it, or fix the URL"
        )
    if f.tag == "not_found" or f.code == "NoSuchKey":
        return ObjectNotFoundError(key, f"object not found: {key}")
    if f.metadata_service:
        return CredentialsError(
            f"could not get S3 credentials from the cloud instance metadata service "
            f"({f.summary}); set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or pass "
            f"access_key_id / secret_access_key)"
        )
    if f.tag == "unauthenticated" or f.status == 401 or f.code in CREDENTIAL_CODES:
        hint = (
            "this machine's clock is off: fix its time (NTP)"
            if f.code == "RequestTimeTooSkewed"
            else "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or the access_key_id / "
            "secret_access_key options)"
        )
        return CredentialsError(
            f"the store rejected the credentials{at} ({op}; {f.summary}): {hint}"
        )
    if f.tag == "permission" or f.status == 403 or f.code in ACCESS_CODES:
        return AccessDeniedError(
            f"access denied{at} ({op}; {f.summary}): the credentials lack a permission "
            f"(docs/operations.md lists the IAM actions tieredbuf needs)"
        )
    if f.tag == "invalid_path":
        return InvalidKeyError(f"the store refused the key {key!r}: {f.summary}")
    if f.bad_scheme:
        return PermanentStoreError(
            f"the S3 client cannot build the request{at} ({op}; {f.summary}): check the "
            f"endpoint URL"
        )
    if f.tag in ("unsupported", "bad_request"):
        return PermanentStoreError(f"the store cannot do this ({op}; {f.summary})")
    if f.connect:
        return StoreUnreachableError(
            f"cannot reach the store{at} ({op}; {f.summary}); the request was not sent"
        )
    if f.status == 429 or f.code in THROTTLE_CODES:
        return TransientStoreError(
            f"the store is throttling requests ({op}; {f.summary}); refused, not applied"
        )
    if f.status is not None and (f.status >= 500 or f.status == 408):
        if write:
            return OutcomeUnknownError(f"outcome unknown for {op} (it may have landed): "
                                       f"{f.summary}")
        return TransientStoreError(f"the store failed ({op}; {f.summary})")
    if f.status is not None and 400 <= f.status < 500:
        return PermanentStoreError(f"the store refused the request ({op}; {f.summary})")
    if write:
        return OutcomeUnknownError(f"outcome unknown for {op} (it may have landed): {f.summary}")
    return TransientStoreError(f"store request failed ({op}; {f.summary})")
