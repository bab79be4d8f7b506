"""Classify a failed store request: permanent or transient, sent or not, in one line.

Every object-store client (obstore for S3 and Azure Blob, botocore for S3 in a forked
child: see :mod:`tieredbuf.runtime.forks`, google-cloud-storage for GCS) describes a
failure by the same few facts -- HTTP status, the service's error code, whether the
connection was ever made -- and
:func:`classify` turns those into the error tree of :mod:`tieredbuf.errors`:

* permanent: credentials rejected or missing, access denied, the bucket missing, a key
  the server refuses, any other 4xx the server would answer again;
* transient: nothing sent (connection refused, DNS), throttling (429, S3 SlowDown,
  Azure ServerBusy: refused, not applied), 5xx,
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
    ThrottledError,
    TransientStoreError,
)

Tag = Literal[
    "already_exists",
    "precondition",
    "not_found",
    "unauthenticated",
    "permission",
    "invalid_path",
    "unsupported",
    "bad_request",
]
"""What the client's own exception type says (obstore exception classes)."""

CREDENTIAL_CODES = frozenset(
    {
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "RequestTimeTooSkewed",
        "AuthorizationHeaderMalformed",
        "InvalidSecurity",
        "MissingSecurityHeader",
        "CredentialsNotSupported",
        # Azure Blob (a bad key or SAS is a 403 AuthenticationFailed there)
        "AuthenticationFailed",
        "InvalidAuthenticationInfo",
        "NoAuthenticationInformation",
    }
)
ACCESS_CODES = frozenset(
    {
        "AccessDenied",
        "AllAccessDisabled",
        "AccountProblem",
        "AuthorizationFailure",
        "AuthorizationPermissionMismatch",
        "InsufficientAccountPermissions",
        "AccountIsDisabled",
    }
)
THROTTLE_CODES = frozenset(
    {
        "SlowDown",
        "RequestLimitExceeded",
        "Throttling",
        "TooManyRequests",
        "ServerBusy",  # Azure: 503 over the account's or a blob's request target
    }
)
BUCKET_CODES = frozenset({"NoSuchBucket", "ContainerNotFound"})
"""The bucket (S3) or container (Azure) does not exist."""
CREDENTIAL_HINTS = {
    "s3": "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or the access_key_id / "
    "secret_access_key options)",
    "azure": "check AZURE_STORAGE_ACCOUNT_KEY / AZURE_STORAGE_SAS_TOKEN (or the "
    "account_key / sas_token options) and the account name",
    "gcs": "check GOOGLE_APPLICATION_CREDENTIALS (a service-account key file) or the "
    "Application Default Credentials (gcloud auth application-default login)",
}
_PERMISSIONS = {
    "s3": "docs/operations.md lists the IAM actions tieredbuf needs",
    "azure": "tieredbuf needs the Storage Blob Data Contributor role on the container, "
    "or an account key / SAS with read, write, delete and list",
    "gcs": "tieredbuf needs roles/storage.objectUser on the bucket, or storage.objects."
    "create, .get, .list and .delete",
}
_AUTHN_RE = re.compile(r"failed to authenticate", re.IGNORECASE)
"""Azure's text for a bad key or signature (Azurite sends it with AuthorizationFailure)."""
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


def unexplained_refusal(f: Facts) -> bool:
    """A 401 / 403 that does not say why: the answer to a HEAD, which has no body to
    carry the service's code.  It may be wrong credentials (InvalidAccessKeyId,
    SignatureDoesNotMatch, Azure's AuthenticationFailed) or a missing permission
    (AccessDenied), and the two need different fixes: the store asks again with a GET of
    the same key, whose answer names the cause, before :func:`classify` picks one."""
    return (
        f.status in (401, 403)
        and f.code is None
        and f.tag != "unauthenticated"
        and not _AUTHN_RE.search(f.message or "")
    )


def explains_refusal(err: Exception) -> bool:
    """The error of the GET asked after :func:`unexplained_refusal` names the cause: it
    is raised in place of the HEAD's (anything else -- the GET went through, the object
    is empty -- leaves the HEAD's own)."""
    return isinstance(err, CredentialsError | AccessDeniedError)


def is_metadata_uri(text: str) -> bool:
    return bool(_METADATA_RE.search(text))


def classify(
    f: Facts,
    key: str,
    *,
    write: bool,
    bucket: str | None = None,
    where: str | None = None,
    provider: str = "s3",
) -> Exception:
    """The tieredbuf error for a failed operation on ``key``.  ``bucket``, ``where``
    (the endpoint) and ``provider`` (``s3``, ``azure``, ``gcs``) only name things in the
    message."""
    op = f"{'writing' if write else 'reading'} {key}"
    at = f" at {where}" if where else ""
    container = "container" if provider == "azure" else "bucket"
    if f.tag == "already_exists":
        # also a 409 ConditionalRequestConflict on If-Match: another writer won
        return AlreadyExistsError(key, f"object already exists (or CAS conflict): {key}")
    if f.tag == "precondition" or f.status == 412:
        return PreconditionFailedError(key, f"precondition failed on {key}")
    if f.code in BUCKET_CODES:
        name = bucket or "?"
        how = f" (tieredbuf create-container az://{name}/)" if provider == "azure" else ""
        return BucketNotFoundError(
            name, f"{container} {name!r} does not exist{at} ({op}): create it{how}, or fix the URL"
        )
    if f.tag == "not_found" or f.code == "NoSuchKey":
        return ObjectNotFoundError(key, f"object not found: {key}")
    if f.metadata_service:
        return CredentialsError(
            f"could not get credentials from the cloud instance metadata service "
            f"({f.summary}); {CREDENTIAL_HINTS.get(provider, CREDENTIAL_HINTS['s3'])}"
        )
    if (
        f.tag == "unauthenticated"
        or f.status == 401
        or f.code in CREDENTIAL_CODES
        or _AUTHN_RE.search(f.message or "")
    ):
        hint = (
            "this machine's clock is off: fix its time (NTP)"
            if f.code == "RequestTimeTooSkewed"
            else CREDENTIAL_HINTS.get(provider, CREDENTIAL_HINTS["s3"])
        )
        return CredentialsError(
            f"the store rejected the credentials{at} ({op}; {f.summary}): {hint}"
        )
    if f.tag == "permission" or f.status == 403 or f.code in ACCESS_CODES:
        return AccessDeniedError(
            f"access denied{at} ({op}; {f.summary}): the credentials lack a permission "
            f"({_PERMISSIONS.get(provider, _PERMISSIONS['s3'])})"
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
        return ThrottledError(
            f"the store is throttling requests ({op}; {f.summary}); refused, not applied"
        )
    if f.status is not None and (f.status >= 500 or f.status == 408):
        if write:
            return OutcomeUnknownError(
                f"outcome unknown for {op} (it may have landed): {f.summary}"
            )
        return TransientStoreError(f"the store failed ({op}; {f.summary})")
    if f.status is not None and 400 <= f.status < 500:
        return PermanentStoreError(f"the store refused the request ({op}; {f.summary})")
    if write:
        return OutcomeUnknownError(f"outcome unknown for {op} (it may have landed): {f.summary}")
    return TransientStoreError(f"store request failed ({op}; {f.summary})")
