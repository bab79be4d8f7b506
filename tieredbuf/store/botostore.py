"""The Store contract over botocore, for S3 in a process forked after obstore started.

obstore's async runtime does not survive ``fork()`` (see :mod:`tieredbuf.runtime.forks`), so an
S3 :class:`~tieredbuf.store.objstore.ObjStore` in such a child sends its requests
through this class, built from the same settings (endpoint, region, credentials,
timeouts, retries).  Semantics match ObjStore's: create-if-absent is ``If-None-Match:
*``, replace-if-match is ``If-Match``, a conditional GET is ``If-None-Match: <etag>`` (its
304 means unchanged: None, not an error), ranges past the end read as ``b""``, and errors
go through the same :func:`~tieredbuf.store.errmap.classify`.  It is slower than
obstore (botocore signs and parses in Python); the fast path is to start child
processes with ``forkserver`` / ``spawn``, or to make the first S3 request only after
forking.  The contract suite runs against it (tests/store/test_contract.py).
"""

from __future__ import annotations

import builtins
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from tieredbuf import keys
from tieredbuf.errors import (
    AlreadyExistsError,
    ObjectNotFoundError,
    OutcomeUnknownError,
    StoreError,
)
from tieredbuf.runtime import forks
from tieredbuf.runtime.buffers import finish, fresh_bytes
from tieredbuf.runtime.redact import redacted_copy as redacted
from tieredbuf.runtime.redact import scrub
from tieredbuf.store._common import check_key, check_prefix, check_range
from tieredbuf.store.base import (
    GetResult,
    IfMatch,
    ObjectMeta,
    PutMode,
    Stored,
)
from tieredbuf.store.errmap import (
    Facts,
    classify,
    explains_refusal,
    is_metadata_uri,
    unexplained_refusal,
)


@dataclass(frozen=True)
class S3Settings:
    """What an S3 store was built from: enough to build it again, with either client."""

    bucket: str
    prefix: str
    config: dict[str, Any] = field(default_factory=dict)
    """obstore S3Config keys (endpoint, region, access_key_id, ...)."""
    client: dict[str, Any] = field(default_factory=dict)
    """obstore ClientConfig keys (allow_http, timeout, connect_timeout)."""
    retry: dict[str, Any] = field(default_factory=dict)
    """obstore RetryConfig keys (max_retries, retry_timeout, backoff)."""
    instance_metadata: bool = False
    """Asked to fetch credentials from the cloud instance metadata service."""

    @property
    def endpoint(self) -> str | None:
        value = self.config.get("endpoint")
        return str(value) if value is not None else None


def _seconds(value: Any, default: float) -> float:
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, int | float):
        return float(value)
    return default


def botocore_facts(e: BaseException) -> Facts:
    """The facts of a botocore error (status and code come as fields, not text)."""
    from botocore import exceptions as bx

    if isinstance(e, bx.ClientError):
        err = e.response.get("Error", {})
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code = err.get("Code")
        if code in ("404", "NotFound", "403", "Forbidden", "401", "Unauthorized"):
            code = None  # a HEAD's answer: botocore fills in the status, not a code
        return Facts(
            status=status, code=code, message=err.get("Message") or None, method=e.operation_name
        )
    if isinstance(e, bx.NoCredentialsError | bx.PartialCredentialsError):
        return Facts(tag="unauthenticated", transport=str(e))
    if isinstance(e, bx.EndpointConnectionError | bx.ConnectTimeoutError):
        return Facts(connect=True, transport=str(e), metadata_service=is_metadata_uri(str(e)))
    if isinstance(e, bx.ReadTimeoutError):
        return Facts(transport="timed out")
    if isinstance(e, bx.ConnectionClosedError | bx.ConnectionError | bx.HTTPClientError):
        return Facts(transport=f"connection failed: {e}")
    if isinstance(e, bx.ParamValidationError | bx.InvalidEndpointConfigurationError):
        return Facts(tag="bad_request", transport=str(e))
    return Facts(transport=f"{type(e).__name__}: {e}")


def _error_code(e: BaseException) -> str | None:
    resp = getattr(e, "response", None)
    code = resp.get("Error", {}).get("Code") if isinstance(resp, dict) else None
    return str(code) if code is not None else None


_READ_AT = 1 << 20


def _checksum(r: Any) -> int | None:
    """The CRC32 a data object's writer kept in its user metadata (KeepsChecksums)."""
    return keys.parse_crc32((r.get("Metadata") or {}).get(keys.CHECKSUM_METADATA))


def _body(r: Any) -> bytes:
    """A GET's whole body; a large one read straight into a ``bytes`` of its declared
    length (reading it whole first and copying would hold it twice)."""
    size = int(r.get("ContentLength") or 0)
    if size < _READ_AT:
        data: bytes = r["Body"].read()
        return data
    out, view = fresh_bytes(size)
    at = 0
    while at < size and (n := r["Body"].readinto(view[at:])):
        at += n
    if at != size or r["Body"].read(1):
        raise StoreError(f"the store declared {size} bytes and sent another length")
    return finish(out, view)


class BotoS3Store:
    """A Store over a botocore S3 client; one client per process (rebuilt after fork)."""

    def __init__(self, settings: S3Settings, url: str) -> None:
        self._s = settings
        self._url = url
        self._lock = threading.Lock()
        self._client: Any = None
        self._client_pid = -1

    @property
    def url(self) -> str:
        return self._url

    def __repr__(self) -> str:
        return f"BotoS3Store({self._url!r})"

    def _c(self) -> Any:
        if self._client is None or self._client_pid != forks.pid():
            if self._client_pid != forks.pid():
                self._lock = threading.Lock()
            with self._lock:
                if self._client is None or self._client_pid != forks.pid():
                    self._client = self._build()
                    self._client_pid = forks.pid()
        return self._client

    def _build(self) -> Any:
        import botocore.session
        from botocore import UNSIGNED
        from botocore.config import Config

        cfg, client, retry = self._s.config, self._s.client, self._s.retry
        session = botocore.session.get_session()
        if not self._s.instance_metadata:
            # never ask the instance metadata service for credentials unless told to
            session.get_component("credential_provider").remove("iam-role")
        endpoint = cfg.get("endpoint")
        options: dict[str, Any] = {
            "connect_timeout": _seconds(client.get("connect_timeout"), 5.0),
            "read_timeout": _seconds(client.get("timeout"), 60.0),
            "retries": {"max_attempts": int(retry.get("max_retries", 3)) + 1, "mode": "standard"},
            "s3": {"addressing_style": "path" if endpoint else "auto"},
        }
        if cfg.get("skip_signature"):
            options["signature_version"] = UNSIGNED
        return session.create_client(
            "s3",
            region_name=cfg.get("region") or "us-east-1",
            endpoint_url=endpoint,
            aws_access_key_id=cfg.get("access_key_id"),
            aws_secret_access_key=cfg.get("secret_access_key"),
            aws_session_token=cfg.get("session_token"),
            config=Config(**options),
        )

    def _key(self, key: str) -> str:
        return f"{self._s.prefix}/{key}" if self._s.prefix else key

    def _error(self, e: BaseException, key: str, *, write: bool) -> Exception:
        return scrub(
            classify(
                botocore_facts(e), key, write=write, bucket=self._s.bucket, where=self._s.endpoint
            )
        )

    @staticmethod
    def _status(e: BaseException) -> int | None:
        resp = getattr(e, "response", None)
        if not isinstance(resp, dict):
            return None
        status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return int(status) if status is not None else None

    # --- reads ------------------------------------------------------------------

    def get(self, key: str) -> GetResult:
        check_key(key)
        try:
            r = self._c().get_object(Bucket=self._s.bucket, Key=self._key(key))
            data = _body(r)
        except Exception as e:
            raise self._error(e, key, write=False) from redacted(e)
        etag = r.get("ETag")
        if etag is None:
            raise StoreError(f"the store returned no etag for {key}")
        return GetResult(data, etag, _checksum(r))

    def get_if_changed(self, key: str, etag: str) -> GetResult | None:
        check_key(key)
        try:
            r = self._c().get_object(Bucket=self._s.bucket, Key=self._key(key), IfNoneMatch=etag)
            data = r["Body"].read()
        except Exception as e:
            if self._status(e) == 304 or _error_code(e) in ("304", "NotModified"):
                # botocore raises the 304 as a ClientError (code "304" or "NotModified");
                # it is the answer "unchanged", never classify()'s transient error
                return None
            raise self._error(e, key, write=False) from redacted(e)
        now = r.get("ETag")
        if now is None:
            raise StoreError(f"the store returned no etag for {key}")
        # a server that ignores If-None-Match answers 200 with the unchanged object
        return None if now == etag else GetResult(data=data, etag=now)

    def _ranged(self, key: str, header: str) -> tuple[bytes, bool]:
        """(body, partial?) of a ranged GET; ``(b"", True)`` for 416."""
        try:
            r = self._c().get_object(Bucket=self._s.bucket, Key=self._key(key), Range=header)
            return r["Body"].read(), "ContentRange" in r
        except Exception as e:
            if self._status(e) == 416:
                return b"", True
            raise self._error(e, key, write=False) from redacted(e)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        check_key(key)
        check_range(start, end)
        if start == end:
            self.head(key)
            return b""
        data, partial = self._ranged(key, f"bytes={start}-{end - 1}")
        return data if partial else data[start:end]

    def read_into(self, key: str, start: int, out: memoryview) -> Stored | None:
        """One ranged GET read into ``out`` in chunks (see ReadsInto); the object's size
        from its Content-Range (a server that ignores the range sends it whole)."""
        check_key(key)
        if start < 0:
            raise ValueError(f"invalid range start {start}")
        if not len(out):
            return Stored(self.head(key).size)
        header = f"bytes={start}-{start + len(out) - 1}"
        try:
            r = self._c().get_object(Bucket=self._s.bucket, Key=self._key(key), Range=header)
            body = r["Body"]
            if "ContentRange" not in r:  # the whole object: keep the asked-for range
                data = body.read()
                got = data[start : start + len(out)]
                out[: len(got)] = got
                return Stored(len(data), _checksum(r))
            size = int(str(r["ContentRange"]).rsplit("/", 1)[1])
            at = 0
            while at < len(out) and (n := body.readinto(out[at:])) and n > 0:
                at += n
        except Exception as e:
            if self._status(e) == 416:
                return Stored(self.head(key).size)
            raise self._error(e, key, write=False) from redacted(e)
        if at < min(len(out), size - start):
            raise StoreError(f"{key}: the response ended before its range did")
        return Stored(size, _checksum(r))

    def get_suffix(self, key: str, length: int) -> bytes:
        check_key(key)
        if length < 0:
            raise ValueError(f"invalid suffix length {length}")
        if length == 0:
            self.head(key)
            return b""
        data, partial = self._ranged(key, f"bytes=-{length}")
        return data if partial else data[-length:]

    def _explain_refusal(self, key: str, e: BaseException) -> None:
        """As :meth:`tieredbuf.store.objstore.ObjStore.head` does: a bare 403 on a HEAD
        is asked again with a one-byte GET, whose answer names the cause."""
        if not unexplained_refusal(botocore_facts(e)):
            return
        try:
            self._c().get_object(Bucket=self._s.bucket, Key=self._key(key), Range="bytes=0-0")
        except Exception as ge:
            err = self._error(ge, key, write=False)
            if explains_refusal(err):
                raise err from redacted(ge)

    def head(self, key: str) -> ObjectMeta:
        check_key(key)
        try:
            r = self._c().head_object(Bucket=self._s.bucket, Key=self._key(key))
        except Exception as e:
            if self._status(e) == 404:
                raise ObjectNotFoundError(key) from redacted(e)
            self._explain_refusal(key, e)
            raise self._error(e, key, write=False) from redacted(e)
        return ObjectMeta(key, int(r["ContentLength"]), r.get("ETag"), r.get("LastModified"))

    def list(self, prefix: str) -> Iterator[ObjectMeta]:
        check_prefix(prefix)
        cut = len(self._s.prefix) + 1 if self._s.prefix else 0
        full = self._key(prefix) if prefix else (f"{self._s.prefix}/" if self._s.prefix else "")
        try:
            pages = (
                self._c()
                .get_paginator("list_objects_v2")
                .paginate(Bucket=self._s.bucket, Prefix=full)
            )
            for page in pages:
                for o in page.get("Contents", ()):
                    yield ObjectMeta(
                        o["Key"][cut:], int(o["Size"]), o.get("ETag"), o.get("LastModified")
                    )
        except Exception as e:
            raise self._error(e, prefix, write=False) from redacted(e)

    # --- writes -----------------------------------------------------------------

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = "overwrite") -> str:
        return self._put_one(key, data, mode, None)

    def put_checksummed(
        self, key: str, data: bytes | memoryview, crc32: int, *, mode: PutMode = "create"
    ) -> str:
        """:meth:`put` with ``crc32`` in the object's user metadata (KeepsChecksums)."""
        return self._put_one(key, data, mode, crc32)

    def _put_one(self, key: str, data: bytes | memoryview, mode: PutMode, crc32: int | None) -> str:
        check_key(key)
        kw: dict[str, Any] = {}
        if crc32 is not None:
            kw["Metadata"] = {keys.CHECKSUM_METADATA: keys.format_crc32(crc32)}
        if isinstance(mode, IfMatch):
            kw["IfMatch"] = mode.etag
        elif mode == "create":
            kw["IfNoneMatch"] = "*"
        elif mode != "overwrite":
            raise ValueError(f"unknown put mode {mode!r}")
        try:
            r = self._c().put_object(
                Bucket=self._s.bucket, Key=self._key(key), Body=bytes(data), **kw
            )
        except Exception as e:
            status = self._status(e)
            if status == 409 or (status == 412 and mode == "create"):
                # as obstore reports them: create-if-absent found the key, or a 409
                # ConditionalRequestConflict on If-Match (another writer won)
                raise AlreadyExistsError(
                    key, f"object already exists (or CAS conflict): {key}"
                ) from redacted(e)
            raise self._error(e, key, write=True) from redacted(e)
        etag = r.get("ETag")
        if etag is None:
            raise OutcomeUnknownError(f"the store acknowledged {key} without an etag")
        return str(etag)

    def put_multipart(
        self, key: str, chunks: Iterable[bytes | memoryview], *, mode: PutMode = "create"
    ) -> str:
        # One PUT (S3 takes up to 5 GiB): this client serves forked children only.
        return self.put(key, b"".join(chunks), mode=mode)

    def copy(self, src: str, dst: str) -> None:
        check_key(src)
        check_key(dst)
        try:  # server-side CopyObject; dst is a fresh key (S3 has no conditional copy)
            self._c().copy_object(
                Bucket=self._s.bucket,
                Key=self._key(dst),
                CopySource={"Bucket": self._s.bucket, "Key": self._key(src)},
            )
        except Exception as e:
            raise self._error(e, src, write=True) from e

    def delete_many(self, keys: Sequence[str]) -> builtins.list[tuple[str, Exception]]:
        keys = [check_key(k) for k in keys]
        failures: builtins.list[tuple[str, Exception]] = []
        for i in range(0, len(keys), 1000):
            part = keys[i : i + 1000]
            try:
                r = self._c().delete_objects(
                    Bucket=self._s.bucket,
                    Delete={"Objects": [{"Key": self._key(k)} for k in part], "Quiet": True},
                )
            except Exception as e:
                failures += [(k, self._error(e, k, write=True)) for k in part]
                continue
            cut = len(self._s.prefix) + 1 if self._s.prefix else 0
            for err in r.get("Errors", ()):
                if err.get("Code") == "NoSuchKey":
                    continue
                k = err.get("Key", "")[cut:]
                facts = Facts(
                    status=None,
                    code=err.get("Code"),
                    message=err.get("Message"),
                    method="DeleteObjects",
                )
                failures.append((k, scrub(classify(facts, k, write=True, bucket=self._s.bucket))))
        return failures

    def close(self) -> None:
        """botocore clients hold a connection pool; it is closed with the process."""
