"""obstore's errors read: the HTTP status, the S3 / Azure error code and message, and the
transport failure, which obstore 0.12.1 exposes only in its message text, turned into
:class:`~tieredbuf.store.errmap.Facts` and from there into tieredbuf's errors (one line,
redacted)."""

from __future__ import annotations

import re

from obstore import exceptions as obx

from tieredbuf.runtime.redact import scrub
from tieredbuf.store.errmap import Facts, Tag, classify, is_metadata_uri

_STATUS_RE = re.compile(r"status code: (\d{3})")
_CODE_RE = re.compile(r"<Code>([^<]{1,100})</Code>")
_DELETE_CODE_RE = re.compile(r"DeleteObjects request failed for key .{0,1024}\(code: (\w{1,100})\)")
"""A DeleteObjects answers 200 with a per-key error (AccessDenied on a key the policy
does not cover): obstore words its code so, not as XML."""
_MESSAGE_RE = re.compile(r"<Message>([^<]{1,300})</Message>")
_KIND_RE = re.compile(r"HttpError \{\s*kind: (\w+)")
_OS_MESSAGE_RE = re.compile(r'message: "([^"]{1,200})"')
_REQUEST_RE = re.compile(r"Error performing (\w+) (\S+)")
_DNS_RE = re.compile(r"dns error|failed to lookup address", re.IGNORECASE)
_UNSATISFIABLE_RE = re.compile(r"status code: 416|StartTooLarge|Range Not Satisfiable")
_NOT_PARTIAL_RE = re.compile(r"NotPartial|non-partial response")

_TAGS: tuple[tuple[type[BaseException], Tag], ...] = (
    (obx.AlreadyExistsError, "already_exists"),
    (obx.PreconditionError, "precondition"),
    (FileNotFoundError, "not_found"),
    (obx.NotFoundError, "not_found"),
    (obx.UnauthenticatedError, "unauthenticated"),
    (obx.PermissionDeniedError, "permission"),
    (obx.InvalidPathError, "invalid_path"),
    (obx.NotSupportedError, "unsupported"),
    (obx.UnknownConfigurationKeyError, "bad_request"),
    (ValueError, "bad_request"),
)


def obstore_facts(e: BaseException) -> Facts:
    """The facts of an obstore error.  obstore 0.12.1 exposes the HTTP status, the S3
    error code and the transport error kind only in its message text."""
    text = str(e)
    status = _STATUS_RE.search(text)
    code = _CODE_RE.search(text) or _DELETE_CODE_RE.search(text)
    message = _MESSAGE_RE.search(text)
    kind = _KIND_RE.search(text)
    os_message = _OS_MESSAGE_RE.search(text)
    request = _REQUEST_RE.search(text)
    if _DNS_RE.search(text):
        transport: str | None = "the host name does not resolve (DNS)"
    elif os_message is not None:
        transport = os_message.group(1).lower()
    elif kind is not None:
        transport = {"Timeout": "timed out"}.get(kind.group(1), f"{kind.group(1).lower()} error")
    else:
        transport = None
    tag = next((t for cls, t in _TAGS if isinstance(e, cls)), None)
    return Facts(
        tag=tag,
        status=int(status.group(1)) if status else None,
        code=code.group(1) if code else None,
        # Azure appends "RequestId:..." and "Time:..." lines to its messages
        message=(message.group(1).strip().splitlines() or [None])[0] if message else None,
        connect=kind is not None and kind.group(1) == "Connect",
        transport=transport,
        method=request.group(1) if request else None,
        uri=request.group(2) if request else None,
        metadata_service=is_metadata_uri(text),
        bad_scheme="BadScheme" in text or "builder error" in text,
    )


def short(e: BaseException) -> str:
    """One line for an obstore (or any) error: never the library's debug dump."""
    if isinstance(e, obx.BaseError | FileNotFoundError):
        return obstore_facts(e).summary
    text = str(e).split("\n\nDebug source:", 1)[0].strip()
    return text.splitlines()[0] if text else type(e).__name__


def unsatisfiable(e: Exception) -> bool:
    """A range past the end (S3 416, MemoryStore StartTooLarge): the slice is empty."""
    return isinstance(e, obx.GenericError) and bool(_UNSATISFIABLE_RE.search(str(e)))


def not_partial(e: Exception) -> bool:
    """The server answered a range request with the whole object (moto does for an empty
    object): obstore refuses the body, so the caller falls back to a full GET."""
    return isinstance(e, obx.GenericError) and bool(_NOT_PARTIAL_RE.search(str(e)))


def map_error(
    e: BaseException,
    key: str,
    *,
    write: bool,
    bucket: str | None = None,
    where: str | None = None,
    provider: str = "s3",
) -> Exception:
    """The tieredbuf error for an obstore / builtin error raised by an operation on ``key``
    (see :func:`tieredbuf.store.errmap.classify`), its message redacted (a server's
    answer may quote the request's credentials: :mod:`tieredbuf.runtime.redact`).  Callers
    chain it to :func:`redacted` (``e``), never to ``e``."""
    return scrub(
        classify(obstore_facts(e), key, write=write, bucket=bucket, where=where, provider=provider)
    )
