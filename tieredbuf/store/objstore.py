"""The Store contract over obstore 0.12.1: S3 (and S3-compatible servers) and memory.

Behaviour checked against moto 5.2.5 and SeaweedFS 4.48 (tests/store/):

* ``mode="create"`` sends If-None-Match: *, ``mode={"e_tag": et}`` sends If-Match.
  Only ``e_tag`` is passed (adding ``"version": None`` raises TypeError in 0.12.1).
* obstore does **not** do conditional multipart uploads: with any mode other than
  "overwrite" it silently falls back to one PUT of the whole body.  ``put_multipart``
  therefore joins the chunks and sends one conditional PUT for create / IfMatch
  (S3 takes up to 5 GiB in one PUT), and uses a real multipart upload only for
  "overwrite".
* A range starting at or past the end answers 416; an empty object answers a suffix
  request with 416 on some servers.  Both are returned as ``b""`` (slice semantics).
* obstore retries a PUT whose response was lost; a conditional PUT that landed then
  comes back as a conflict (invariant I2).  Conflicts are reported as conflicts;
  callers must not read them as "did not land".
"""

from __future__ import annotations

import builtins
import re
from collections.abc import Iterable, Iterator, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import obstore as obs
from obstore import exceptions as obx

from tieredbuf.errors import (
    AlreadyExistsError,
    ObjectNotFoundError,
    OutcomeUnknownError,
    PreconditionFailedError,
    StoreError,
)
from tieredbuf.store._common import check_key, check_prefix, check_range, prefix_dir
from tieredbuf.store.base import GetResult, IfMatch, ObjectMeta, PutMode
from tieredbuf.store.probe import PROBES

if TYPE_CHECKING:
    from obstore.store import ObjectStore

DEFAULT_RETRY: dict[str, Any] = {
    "max_retries": 3,
    "retry_timeout": timedelta(seconds=30),
    "backoff": {
        "init_backoff": timedelta(milliseconds=100),
        "max_backoff": timedelta(seconds=5),
        "base": 2,
    },
}
"""obstore's default is 10 attempts over up to 180 s; a buffer wants to hear sooner."""

DEFAULT_CONNECT_TIMEOUT = timedelta(seconds=5)
DEFAULT_TIMEOUT = timedelta(seconds=60)
"""Whole-request timeout; a 64 MiB segment PUT must fit in it."""

DEFAULT_CHUNK_SIZE = 8 << 20

# Messages of obstore GenericError that mean "the request may have reached the server".
_TRANSPORT_RE = re.compile(
    r"timed? ?out|timeout|error sending request|connection|reset|broken pipe|"
    r"incomplete message|unexpected eof|body error|request or response body error|"
    r"status code: 5\d\d",
    re.IGNORECASE,
)
_UNSATISFIABLE_RE = re.compile(r"status code: 416|StartTooLarge|Range Not Satisfiable")
_NOT_PARTIAL_RE = re.compile(r"NotPartial|non-partial response")


def _unsatisfiable(e: Exception) -> bool:
    """A range past the end (S3 416, MemoryStore StartTooLarge): the slice is empty."""
    return isinstance(e, obx.GenericError) and bool(_UNSATISFIABLE_RE.search(str(e)))


def _not_partial(e: Exception) -> bool:
    """The server answered a range request with the whole object (moto does for an empty
    object): obstore refuses the body, so the caller falls back to a full GET."""
    return isinstance(e, obx.GenericError) and bool(_NOT_PARTIAL_RE.search(str(e)))


def map_error(e: BaseException, key: str, *, write: bool) -> Exception:
    """The tieredbuf error for an obstore / builtin error raised by an operation on ``key``."""
    msg = str(e)
    if isinstance(e, obx.AlreadyExistsError):
        # also a 409 ConditionalRequestConflict on If-Match: another writer won
        return AlreadyExistsError(key, f"object already exists (or CAS conflict): {key}: {msg}")
    if isinstance(e, obx.PreconditionError):
        return PreconditionFailedError(key, f"precondition failed on {key}: {msg}")
    if isinstance(e, FileNotFoundError | obx.NotFoundError):
        if "NoSuchBucket" in msg:
            return StoreError(f"bucket does not exist (reading {key}): {msg}")
        return ObjectNotFoundError(key, f"object not found: {key}: {msg}")
    if write and _TRANSPORT_RE.search(msg):
        return OutcomeUnknownError(
            f"outcome unknown for write of {key} (it may have landed): {msg}"
        )
    return StoreError(f"store operation on {key} failed: {type(e).__name__}: {msg}")


def _obstore_mode(mode: PutMode) -> Any:
    if isinstance(mode, IfMatch):
        return {"e_tag": mode.etag}
    if mode in ("create", "overwrite"):
        return mode
    raise ValueError(f"unknown put mode {mode!r}")


def _meta(m: Any) -> ObjectMeta:
    return ObjectMeta(
        key=m["path"],
        size=int(m["size"]),
        etag=m.get("e_tag"),
        last_modified=m.get("last_modified"),
    )


class ObjStore:
    """A Store over one obstore ObjectStore (S3Store with a prefix, or MemoryStore)."""

    def __init__(
        self,
        inner: ObjectStore,
        url: str,
        *,
        probe_target: tuple[str, str] | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
    ) -> None:
        """``probe_target`` = (endpoint, bucket): probe conditional writes before the first
        conditional PUT to that target (once per process).  None: never probe."""
        self._inner = inner
        self._url = url
        self._probe_target = probe_target
        self._chunk_size = chunk_size

    @property
    def url(self) -> str:
        return self._url

    @property
    def obstore(self) -> ObjectStore:
        """The underlying obstore store (for tools that want it directly)."""
        return self._inner

    def __repr__(self) -> str:
        return f"ObjStore({self._url!r})"

    # --- reads ------------------------------------------------------------------

    def get(self, key: str) -> GetResult:
        check_key(key)
        try:
            r = obs.get(self._inner, key)
            data = bytes(r.bytes())
            etag = r.meta["e_tag"]
        except Exception as e:
            raise map_error(e, key, write=False) from e
        if etag is None:
            raise StoreError(f"the store returned no etag for {key}")
        return GetResult(data=data, etag=etag)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        check_key(key)
        check_range(start, end)
        if start == end:
            self.head(key)  # still report a missing key
            return b""
        try:
            return bytes(obs.get_range(self._inner, key, start=start, end=end))
        except Exception as e:
            if _unsatisfiable(e):
                return b""
            if _not_partial(e):
                return self.get(key).data[start:end]
            raise map_error(e, key, write=False) from e

    def get_suffix(self, key: str, length: int) -> bytes:
        check_key(key)
        if length < 0:
            raise ValueError(f"invalid suffix length {length}")
        if length == 0:
            self.head(key)
            return b""
        try:
            r = obs.get(self._inner, key, options={"range": {"suffix": length}})
            return bytes(r.bytes())
        except Exception as e:
            if _unsatisfiable(e):
                return b""  # an empty object
            if _not_partial(e):
                return self.get(key).data[-length:]
            raise map_error(e, key, write=False) from e

    def head(self, key: str) -> ObjectMeta:
        check_key(key)
        try:
            return _meta(obs.head(self._inner, key))
        except Exception as e:
            raise map_error(e, key, write=False) from e

    def list(self, prefix: str) -> Iterator[ObjectMeta]:
        check_prefix(prefix)
        # obstore lists by path segments ('a' lists 'a/...', never 'ab'): list the
        # directory part and filter, so the contract's "starts with" holds.
        base = prefix_dir(prefix)
        try:
            for batch in obs.list(self._inner, base or None, chunk_size=1000):
                for m in batch:
                    if m["path"].startswith(prefix):
                        yield _meta(m)
        except Exception as e:
            raise map_error(e, prefix, write=False) from e

    # --- writes -----------------------------------------------------------------

    def _ensure_probed(self, mode: PutMode) -> None:
        if self._probe_target is None or mode == "overwrite" or PROBES.passed(self._probe_target):
            return
        endpoint, bucket = self._probe_target
        raw = ObjStore(self._inner, self._url, probe_target=None, chunk_size=self._chunk_size)
        PROBES.ensure(self._probe_target, raw, f"S3 endpoint {endpoint} (bucket {bucket!r})")

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = "overwrite") -> str:
        check_key(key)
        om = _obstore_mode(mode)
        self._ensure_probed(mode)
        try:
            r = obs.put(self._inner, key, data, mode=om, use_multipart=False)
        except Exception as e:
            raise map_error(e, key, write=True) from e
        return self._etag_of(r, key)

    def put_multipart(
        self, key: str, chunks: Iterable[bytes | memoryview], *, mode: PutMode = "create"
    ) -> str:
        check_key(key)
        om = _obstore_mode(mode)
        self._ensure_probed(mode)
        try:
            if mode == "overwrite":
                r = obs.put(
                    self._inner,
                    key,
                    iter(chunks),
                    mode=om,
                    use_multipart=True,
                    chunk_size=self._chunk_size,
                )
            else:
                # obstore 0.12.1 has no conditional multipart: one conditional PUT.
                r = obs.put(self._inner, key, b"".join(chunks), mode=om, use_multipart=False)
        except Exception as e:
            raise map_error(e, key, write=True) from e
        return self._etag_of(r, key)

    @staticmethod
    def _etag_of(r: Any, key: str) -> str:
        etag = r.get("e_tag")
        if etag is None:
            raise OutcomeUnknownError(f"the store acknowledged {key} without an etag")
        return str(etag)

    def delete_many(self, keys: Sequence[str]) -> builtins.list[tuple[str, Exception]]:
        keys = [check_key(k) for k in keys]
        if not keys:
            return []
        try:
            obs.delete(self._inner, keys)
            return []
        except Exception:
            pass  # find out which ones failed, one by one
        failures: builtins.list[tuple[str, Exception]] = []
        for k in keys:
            try:
                obs.delete(self._inner, k)
            except FileNotFoundError:
                continue
            except Exception as e:
                failures.append((k, map_error(e, k, write=True)))
        return failures

    def close(self) -> None:
        """obstore stores hold no resources that need closing."""
