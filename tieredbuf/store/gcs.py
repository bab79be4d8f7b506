"""Google Cloud Storage (``gs://bucket/prefix``) through its JSON API, with the official
``google-cloud-storage`` client (the ``gcs`` extra).

The contract in GCS terms (checked against fake-gcs-server 1.54, tests/store/):

* the version token (``etag``) is the object's **generation**, as a decimal string;
* ``mode="create"`` is ``ifGenerationMatch=0``: a taken name answers 412, raised as
  AlreadyExistsError; ``IfMatch(generation)`` is ``ifGenerationMatch=<generation>``: any
  other generation (or no object) answers 412, PreconditionFailedError.  A token that is
  not a generation can match nothing: PreconditionFailedError without a request;
* ``get_if_changed`` is ``ifGenerationNotMatch`` (304 while unchanged; a server that
  ignores it answers 200, and the generation comparison decides);
* ranged reads are ``Range`` headers (416 past the end reads as ``b""``), a suffix is
  ``bytes=-N``;
* a missing bucket is a bare 404 on some servers: a 404 on a write or a LIST is the
  bucket's, and a 404 on a read is checked once by a one-key LIST before it is called
  the object's;
* ``delete_many`` sends one DELETE per key (GCS's batch endpoint is not served by the
  emulator, so it would be untested; deletes are free on GCS), 8 at a time.

An object over 8 MiB goes up as the client's resumable upload: an initiating POST
(carrying the precondition) and a PUT with the bytes, which GCS bills as one Class A
operation ("a completed resumable upload is considered one Class A operation"), so it
is counted as one.  fake-gcs-server
does not enforce preconditions on resumable uploads, so the tests' CAS runs on small
objects; only fresh ULID-named data objects are that large, and the root manifest
(the only object ever replaced) stays far below it (invariant I6).

Retries are this module's own (the client's are switched off): up to ``max_retries``
more attempts within ``retry_timeout`` for a request that was not sent, timed out, was
reset or got a 5xx; a conditional write retried after a lost answer may come back as a
conflict although it landed (invariant I2: callers never read a conflict as "did not
land").  A 429 is not retried here: ThrottledError, the caller waits at least a second.

Fork safety: the client (a requests session and its connection pool) is built per
process, so a forked child never shares its parent's sockets; the credentials object is
reused.  Errors go through :func:`tieredbuf.store.errmap.classify`, one line each.
"""

from __future__ import annotations

import builtins
import random
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from google.api_core import exceptions as gx
from google.auth import exceptions as ax
from google.cloud import storage

from tieredbuf.errors import (
    AlreadyExistsError,
    BucketNotFoundError,
    ObjectNotFoundError,
    OutcomeUnknownError,
    PreconditionFailedError,
    StoreError,
    ThrottledError,
    TransientStoreError,
)
from tieredbuf.runtime import forks
from tieredbuf.runtime.redact import redacted_copy as redacted
from tieredbuf.runtime.redact import scrub
from tieredbuf.store._common import check_key, check_prefix, check_range
from tieredbuf.store.base import (
    KEY_LIMITED_MANIFEST_WRITES_PER_S,
    GetResult,
    IfMatch,
    ObjectMeta,
    PutMode,
)
from tieredbuf.store.counting import MeteredStore, RequestCounts
from tieredbuf.store.errmap import Facts, classify, is_metadata_uri
from tieredbuf.store.probe import PROBES

GOOGLE_ENDPOINT = "https://storage.googleapis.com"
MULTIPART_LIMIT = 8 << 20
"""Bodies up to this size go up in one request (the client's multipart upload); larger
ones as a resumable upload (two requests, billed as one operation)."""
LIST_PAGE = 1000
DELETE_THREADS = 8
_BUCKET_GONE_RE = re.compile(r"bucket does not exist", re.IGNORECASE)
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class GCSSettings:
    """What a GCS store is built from: enough to build its client again in a child."""

    bucket: str
    prefix: str
    endpoint: str | None
    """The JSON API's base URL (an emulator's); None: Google's."""
    credentials: Any
    """A google.auth credentials object (AnonymousCredentials for an emulator)."""
    connect_timeout: float = 5.0
    timeout: float = 60.0
    max_retries: int = 3
    retry_timeout: float = 30.0

    @property
    def where(self) -> str:
        return self.endpoint or GOOGLE_ENDPOINT


def gcs_facts(e: BaseException) -> Facts:
    """The facts of a google-cloud-storage, google-auth or requests error."""
    import requests

    if isinstance(e, gx.GoogleAPICallError):
        errors = e.errors or []
        first = errors[0] if errors and isinstance(errors[0], dict) else {}
        message = first.get("message") or (str(e.message).split(": ", 1)[-1] or None)
        request = getattr(e.response, "request", None)
        return Facts(
            status=int(e.code) if e.code is not None else None,
            code=first.get("reason"),
            message=message.splitlines()[0][:300] if message else None,
            method=getattr(request, "method", None),
            uri=(getattr(request, "url", None) or "").split("?", 1)[0] or None,
        )
    if isinstance(e, ax.RefreshError | ax.DefaultCredentialsError):
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        return Facts(tag="unauthenticated", transport=text, metadata_service=is_metadata_uri(text))
    if isinstance(e, ax.TransportError):
        text = str(e)
        return Facts(connect=True, transport=text[:300], metadata_service=is_metadata_uri(text))
    if isinstance(e, requests.exceptions.ConnectTimeout):
        return Facts(connect=True, transport="connect timed out")
    if isinstance(e, requests.exceptions.ConnectionError):
        text = str(e)
        if "NameResolutionError" in text or "Failed to resolve" in text:
            return Facts(connect=True, transport="the host name does not resolve (DNS)")
        if "NewConnectionError" in text or "Connection refused" in text:
            return Facts(connect=True, transport="connection refused")
        return Facts(transport="connection reset")
    if isinstance(e, requests.exceptions.Timeout):
        return Facts(transport="timed out")
    if type(e).__name__ == "DataCorruption":  # a download's checksum did not match
        return Facts(transport="the bytes read did not match the object's checksum")
    return Facts(transport=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")


def gcs_error(
    f: Facts, key: str, *, write: bool, bucket: str, where: str, listing: bool = False
) -> Exception:
    """The tieredbuf error for a failed GCS request on ``key``: :func:`classify`, and a
    404 on a write or a LIST (or one that says so) names the bucket."""
    if f.status == 404 and (write or listing or _BUCKET_GONE_RE.search(f.message or "")):
        return BucketNotFoundError(
            bucket,
            f"bucket {bucket!r} does not exist at {where} "
            f"({'writing' if write else 'reading'} {key}): create it, or fix the URL",
        )
    if f.status == 404:
        return ObjectNotFoundError(key, f"object not found: {key}")
    return classify(f, key, write=write, bucket=bucket, where=where, provider="gcs")


def retry_delay(error: Exception, attempt: int, elapsed: float, s: GCSSettings) -> float | None:
    """Seconds to wait before attempt ``attempt + 1`` (0-based) after ``error``, or None
    to give up: only requests that were not sent, timed out, were reset or got a 5xx are
    retried (never a 429: the caller waits a second), at most ``max_retries`` times
    within ``retry_timeout``."""
    # TransientStoreError: not sent (StoreUnreachableError), outcome unknown, 5xx, reset
    if isinstance(error, ThrottledError) or not isinstance(error, TransientStoreError):
        return None
    if attempt >= s.max_retries:
        return None
    ceiling = min(5.0, 0.1 * 2**attempt)
    delay = random.uniform(ceiling / 2, ceiling)
    return delay if elapsed + delay < s.retry_timeout else None


class _Client:
    """The google-cloud-storage client of one process (rebuilt in a forked child)."""

    def __init__(self, s: GCSSettings) -> None:
        self.settings = s
        self._lock = threading.Lock()
        self._lock_pid = forks.pid()
        self._client: Any = None
        self._pid = -1
        self._bucket: Any = None

    def bucket(self) -> Any:
        """The bucket handle of this process's client (built on first use in each
        process: a forked child never sends on its parent's pooled connections)."""
        if self._pid != forks.pid():
            self._build()
        return self._bucket

    def _build(self) -> None:
        if self._lock_pid != forks.pid():
            self._lock = threading.Lock()  # a parent thread may have held it at the fork
            self._lock_pid = forks.pid()
        with self._lock:
            if self._pid == forks.pid():
                return
            options: dict[str, Any] = {}
            if self.settings.endpoint is not None:
                options["api_endpoint"] = self.settings.endpoint
            client = storage.Client(
                project="<none>",
                credentials=self.settings.credentials,
                client_options=options or None,
            )
            client.project = None  # object requests name no project
            self._client, self._bucket = client, client.bucket(self.settings.bucket)
            self._pid = forks.pid()

    def client(self) -> Any:
        self.bucket()
        return self._client

    def close(self) -> None:
        """Close this process's connections (a later request opens new ones)."""
        with self._lock:
            if self._client is not None and self._pid == forks.pid():
                self._client.close()
            self._client, self._bucket, self._pid = None, None, -1


class GCSStore:
    """A Store over one GCS bucket and prefix (see the module docstring)."""

    delete_batch = 1
    """Keys per DELETE request (counted one by one: :mod:`tieredbuf.store.counting`)."""

    def __init__(
        self,
        settings: GCSSettings,
        url: str,
        *,
        probe: bool = True,
        conn: _Client | None = None,
        manifest_writes_per_s: float = KEY_LIMITED_MANIFEST_WRITES_PER_S,
    ) -> None:
        self._s = settings
        self._url = url
        self._probe = probe
        self._conn = conn or _Client(settings)
        self.manifest_writes_per_s = manifest_writes_per_s
        self._bucket_seen = False
        self._meter: RequestCounts | None = None

    @property
    def url(self) -> str:
        return self._url

    @property
    def settings(self) -> GCSSettings:
        return self._s

    @property
    def described(self) -> str:
        return f"GCS endpoint {self._s.where} (bucket {self._s.bucket!r})"

    def __repr__(self) -> str:
        return f"GCSStore({self._url!r})"

    def attach_meter(self, counts: RequestCounts) -> None:
        """Count the requests this store sends on its own (the probe, the bucket check)
        in ``counts``."""
        self._meter = counts

    def _extra(self, op: str, key: str) -> None:
        if self._meter is not None:
            self._meter.add(op, key)

    def _name(self, key: str) -> str:
        return f"{self._s.prefix}/{key}" if self._s.prefix else key

    def _timeout(self) -> tuple[float, float]:
        return (self._s.connect_timeout, self._s.timeout)

    def _error(
        self, e: BaseException, key: str, *, write: bool, listing: bool = False
    ) -> Exception:
        return scrub(
            gcs_error(
                gcs_facts(e),
                key,
                write=write,
                bucket=self._s.bucket,
                where=self._s.where,
                listing=listing,
            )
        )

    def _call(self, key: str, write: bool, fn: Callable[[], _T], listing: bool = False) -> _T:
        """``fn()`` with this store's retries; errors mapped (see :func:`retry_delay`)."""
        start = time.monotonic()
        attempt = 0
        while True:
            try:
                return fn()
            except gx.NotModified:
                raise
            except Exception as e:
                err = self._error(e, key, write=write, listing=listing)
                delay = retry_delay(err, attempt, time.monotonic() - start, self._s)
                if delay is None:
                    raise err from redacted(e)
            time.sleep(delay)  # backoff between attempts, not synchronisation
            attempt += 1

    def _check_bucket(self, key: str, e: Exception) -> None:
        """A 404 on a read: the object's, unless a one-key LIST says the bucket is gone."""
        if self._bucket_seen:
            return
        self._extra("list", "")
        try:
            self._list_page("", None, 1)
        except BucketNotFoundError as be:
            raise be from e
        except Exception:
            return
        self._bucket_seen = True

    def _read(self, key: str, fn: Callable[[], _T]) -> _T:
        try:
            result = self._call(key, False, fn)
        except ObjectNotFoundError as e:
            self._check_bucket(key, e)
            raise
        self._bucket_seen = True
        return result

    # --- reads ------------------------------------------------------------------

    def _download(self, key: str, **kw: Any) -> tuple[bytes, int | None]:
        blob = self._conn.bucket().blob(self._name(key))
        data = blob.download_as_bytes(retry=None, timeout=self._timeout(), **kw)
        return bytes(data), blob.generation

    def get(self, key: str) -> GetResult:
        check_key(key)
        data, generation = self._read(key, lambda: self._download(key))
        if generation is None:
            raise StoreError(f"the store returned no generation for {key}")
        return GetResult(data=data, etag=str(generation))

    def get_if_changed(self, key: str, etag: str) -> GetResult | None:
        check_key(key)
        if not etag.isdigit():
            r = self.get(key)  # not a generation: it cannot be the current one
            return None if r.etag == etag else r
        try:
            data, generation = self._read(
                key, lambda: self._download(key, if_generation_not_match=int(etag))
            )
        except gx.NotModified:
            return None  # 304: unchanged
        if generation is None:
            raise StoreError(f"the store returned no generation for {key}")
        # a server that ignores ifGenerationNotMatch answers 200 with the unchanged object
        return None if str(generation) == etag else GetResult(data=data, etag=str(generation))

    def _ranged(self, key: str, start: int, end: int | None) -> bytes:
        def fetch() -> bytes:
            try:
                return self._download(key, start=start, end=end)[0]
            except gx.RequestRangeNotSatisfiable:
                return b""  # 416: past the end, or an empty object

        return self._read(key, fetch)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        check_key(key)
        check_range(start, end)
        if start == end:
            self.head(key)  # still report a missing key
            return b""
        return self._ranged(key, start, end - 1)

    def get_suffix(self, key: str, length: int) -> bytes:
        check_key(key)
        if length < 0:
            raise ValueError(f"invalid suffix length {length}")
        if length == 0:
            self.head(key)
            return b""
        return self._ranged(key, -length, None)

    def head(self, key: str) -> ObjectMeta:
        check_key(key)

        def reload() -> Any:
            blob = self._conn.bucket().blob(self._name(key))
            blob.reload(retry=None, timeout=self._timeout())
            return blob

        blob = self._read(key, reload)
        return self._meta(key, blob)

    @staticmethod
    def _meta(key: str, blob: Any) -> ObjectMeta:
        gen = blob.generation
        return ObjectMeta(
            key=key,
            size=int(blob.size or 0),
            etag=str(gen) if gen is not None else None,
            last_modified=blob.updated,
        )

    def _list_page(self, prefix: str, token: str | None, size: int) -> tuple[list[Any], str | None]:
        full = self._name(prefix) if prefix else (f"{self._s.prefix}/" if self._s.prefix else "")

        def page() -> tuple[list[Any], str | None]:
            it = self._conn.client().list_blobs(
                self._s.bucket,
                prefix=full or None,
                max_results=size,
                page_token=token,
                retry=None,
                timeout=self._timeout(),
            )
            first = next(it.pages, None)
            return (list(first) if first is not None else []), it.next_page_token

        return self._call(prefix, False, page, listing=True)

    def list(self, prefix: str) -> Iterator[ObjectMeta]:
        check_prefix(prefix)
        cut = len(self._s.prefix) + 1 if self._s.prefix else 0
        token: str | None = None
        while True:
            blobs, token = self._list_page(prefix, token, LIST_PAGE)
            self._bucket_seen = True
            for b in blobs:
                yield self._meta(b.name[cut:], b)
            if not token:
                return

    # --- writes -----------------------------------------------------------------

    def _ensure_probed(self, mode: PutMode) -> None:
        target = (self._s.where, self._s.bucket)
        if not self._probe or mode == "overwrite" or PROBES.passed(target):
            return
        raw = GCSStore(self._s, self._url, probe=False, conn=self._conn)
        probe = raw if self._meter is None else MeteredStore(raw, self._meter)
        PROBES.ensure(target, probe, self.described)

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = "overwrite") -> str:
        check_key(key)
        if isinstance(mode, IfMatch):
            if not mode.etag.isdigit():
                raise PreconditionFailedError(
                    key, f"precondition failed on {key} ({mode.etag!r} is no GCS generation)"
                )
            match: int | None = int(mode.etag)
        elif mode == "create":
            match = 0
        elif mode == "overwrite":
            match = None
        else:
            raise ValueError(f"unknown put mode {mode!r}")
        self._ensure_probed(mode)
        body = bytes(data)

        def upload() -> int | None:
            blob = self._conn.bucket().blob(self._name(key))
            blob.upload_from_string(
                body,
                content_type="application/octet-stream",
                if_generation_match=match,
                retry=None,
                timeout=self._timeout(),
            )
            return blob.generation  # type: ignore[no-any-return]

        try:
            generation = self._call(key, True, upload)
        except PreconditionFailedError as e:
            if mode == "create":
                raise AlreadyExistsError(key, f"object already exists: {key}") from e
            raise
        self._bucket_seen = True
        if generation is None:
            raise OutcomeUnknownError(f"the store acknowledged {key} without a generation")
        return str(generation)

    def put_multipart(
        self, key: str, chunks: Iterable[bytes | memoryview], *, mode: PutMode = "create"
    ) -> str:
        return self.put(key, b"".join(chunks), mode=mode)

    def copy(self, src: str, dst: str) -> None:
        check_key(src)
        check_key(dst)

        def copy() -> None:
            bucket = self._conn.bucket()
            # server-side; dst is a fresh ULID key (the contract), so no precondition
            bucket.copy_blob(
                bucket.blob(self._name(src)),
                bucket,
                self._name(dst),
                retry=None,
                timeout=self._timeout(),
            )

        try:
            self._call(src, True, copy)
        except BucketNotFoundError as e:  # a 404 on the copy: the source's, or the bucket's
            self._check_bucket(src, e)
            raise ObjectNotFoundError(src, f"object not found: {src}") from e

    def _delete(self, key: str) -> Exception | None:
        def delete() -> None:
            self._conn.bucket().blob(self._name(key)).delete(retry=None, timeout=self._timeout())

        try:
            self._call(key, True, delete)
        except BucketNotFoundError as e:  # a 404 on a DELETE: the key is already gone
            if self._bucket_seen:
                return None
            try:
                self._check_bucket(key, e)
            except BucketNotFoundError as be:
                return be
            return None
        except StoreError as e:
            return e
        return None

    def delete_many(self, keys: Sequence[str]) -> builtins.list[tuple[str, Exception]]:
        keys = [check_key(k) for k in keys]
        if len(keys) <= 1:
            results = [self._delete(k) for k in keys]
        else:
            with ThreadPoolExecutor(min(DELETE_THREADS, len(keys))) as pool:
                results = list(pool.map(self._delete, keys))
        return [(k, e) for k, e in zip(keys, results, strict=True) if e is not None]

    def close(self) -> None:
        self._conn.close()
