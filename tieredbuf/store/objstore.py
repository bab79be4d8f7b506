"""The Store contract over obstore 0.12.1: S3 (and S3-compatible servers), Azure Blob
and memory.

Behaviour checked against moto 5.2.5, SeaweedFS 4.48 and Azurite 3.37 (tests/store/):

* ``mode="create"`` sends If-None-Match: *, ``mode={"e_tag": et}`` sends If-Match
  (both on S3 and on Azure Blob, where a taken key is 409 BlobAlreadyExists and a stale
  etag 412 ConditionNotMet).  Only ``e_tag`` is passed (adding ``"version": None``
  raises TypeError in 0.12.1).
* obstore does **not** do conditional multipart uploads: with any mode other than
  "overwrite" it silently falls back to one PUT of the whole body.  ``put_multipart``
  therefore joins the chunks and sends one conditional PUT for create / IfMatch
  (S3 takes up to 5 GiB in one PUT), and uses a real multipart upload only for
  "overwrite".  (Azure takes up to 5000 MiB in one Put Blob.)
* ``get_if_changed`` sends If-None-Match: etag; obstore raises NotModifiedError on the
  304, which is the answer "unchanged", never an error.
* A range starting at or past the end answers 416; an empty object answers a suffix
  request with 416 on some servers.  Both are returned as ``b""`` (slice semantics).
* obstore retries a PUT whose response was lost; a conditional PUT that landed then
  comes back as a conflict (invariant I2).  Conflicts are reported as conflicts;
  callers must not read them as "did not land".
"""

from __future__ import annotations

import builtins
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import obstore as obs
from obstore import exceptions as obx

from tieredbuf import keys
from tieredbuf.errors import (
    BucketNotFoundError,
    ForkedError,
    ObjectNotFoundError,
    OutcomeUnknownError,
    PreconditionFailedError,
    StoreError,
    TransientStoreError,
)
from tieredbuf.runtime import forks
from tieredbuf.runtime.redact import redacted_copy as redacted
from tieredbuf.store import obsbody
from tieredbuf.store._common import check_key, check_prefix, check_range, prefix_dir
from tieredbuf.store.base import (
    DEFAULT_MANIFEST_WRITES_PER_S,
    GetResult,
    IfMatch,
    ObjectMeta,
    PutMode,
    Stored,
    put_with_checksum,
)
from tieredbuf.store.botostore import BotoS3Store, S3Settings
from tieredbuf.store.counting import MeteredStore, RequestCounts
from tieredbuf.store.errmap import (
    explains_refusal,
    unexplained_refusal,
)
from tieredbuf.store.obserrors import map_error, not_partial, obstore_facts, unsatisfiable
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
_SUFFIX_ATTEMPTS = 5


@dataclass(frozen=True, slots=True)
class Remote:
    """The object store service a network ObjStore talks to (names it in errors and in
    the conditional-write probe)."""

    provider: Literal["s3", "azure"]
    bucket: str
    """The S3 bucket or the Azure container."""
    where: str | None
    """The endpoint (None: the provider's own, e.g. AWS)."""

    @property
    def described(self) -> str:
        if self.provider == "azure":
            return f"Azure Blob endpoint {self.where} (container {self.bucket!r})"
        return f"S3 endpoint {self.where or 'aws'} (bucket {self.bucket!r})"


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
    """A Store over one obstore ObjectStore (S3Store or AzureStore with a prefix, or
    MemoryStore).

    In a process forked after obstore's runtime started (:mod:`tieredbuf.runtime.forks`),
    obstore's network calls would hang.  An S3 store then sends its requests through
    botocore instead (:mod:`.botostore`), built from the same ``s3`` settings; an Azure
    store has no second client and raises ForkedError, naming the fix (start children
    with 'spawn' / 'forkserver', or make the first request after the fork).
    """

    def __init__(
        self,
        inner: ObjectStore,
        url: str,
        *,
        probe_target: tuple[str, str] | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        s3: S3Settings | None = None,
        remote: Remote | None = None,
        manifest_writes_per_s: float = DEFAULT_MANIFEST_WRITES_PER_S,
    ) -> None:
        """``probe_target`` = (endpoint, bucket): probe conditional writes before the first
        conditional PUT to that target (once per process).  None: never probe.  ``s3``:
        what an S3 ``inner`` was built from (rebuilds it with botocore after fork).
        ``remote``: the service (names the bucket in errors; defaults from ``s3``).
        ``manifest_writes_per_s``: the default manifest write budget on this store
        (:func:`tieredbuf.store.base.manifest_writes_per_s`)."""
        self._inner = inner
        self._url = url
        self._probe_target = probe_target
        self._chunk_size = chunk_size
        self._s3 = s3
        if remote is None and s3 is not None:
            remote = Remote("s3", s3.bucket, s3.endpoint)
        self._remote = remote
        self.manifest_writes_per_s = manifest_writes_per_s
        self._forked: BotoS3Store | None = None
        self._bucket_seen = False
        """A request succeeded, so the bucket exists (a HEAD 404 is then the object's)."""
        self._meter: RequestCounts | None = None

    def attach_meter(self, counts: RequestCounts) -> None:
        """Count the requests this store sends on its own (the conditional-write probe,
        the bucket check, fallbacks) in ``counts``: see :mod:`tieredbuf.store.counting`."""
        self._meter = counts

    def _extra(self, op: str, key: str) -> None:
        if self._meter is not None:
            self._meter.add(op, key)

    @property
    def url(self) -> str:
        return self._url

    @property
    def obstore(self) -> ObjectStore:
        """The underlying obstore store (for tools that want it directly)."""
        return self._inner

    @property
    def s3(self) -> S3Settings | None:
        """What the S3 store was built from (None for memory and Azure)."""
        return self._s3

    @property
    def remote(self) -> Remote | None:
        """The service this store talks to (None for memory)."""
        return self._remote

    def __repr__(self) -> str:
        return f"ObjStore({self._url!r})"

    def _alt(self) -> BotoS3Store | None:
        """The botocore twin to use instead of obstore (forked child), else None.
        Raises ForkedError for an Azure store in such a child."""
        if self._remote is None or not forks.obstore_inherited():
            forks.note_obstore_call()
            return None
        if self._s3 is None:
            raise ForkedError(
                f"{self._url}: this process ({forks.pid()}) is a fork of one that already "
                f"sent object-store requests through obstore, whose runtime does not "
                f"survive fork(); {self._remote.provider} stores have no other client. "
                f"Start child processes with multiprocessing's 'spawn' or 'forkserver' "
                f"method, or fork before the parent's first store request"
            )
        if self._forked is None:
            self._forked = BotoS3Store(self._s3, self._url)
        return self._forked

    def _error(self, e: BaseException, key: str, *, write: bool) -> Exception:
        r = self._remote
        if r is None:
            return map_error(e, key, write=write)
        return map_error(e, key, write=write, bucket=r.bucket, where=r.where, provider=r.provider)

    def _check_bucket(self, key: str, e: BaseException) -> None:
        """A HEAD answers a missing bucket with a bare 404: ask once with a LIST, which
        names NoSuchBucket (ContainerNotFound on Azure), before calling the object
        missing."""
        if self._remote is None or self._bucket_seen:
            return
        try:
            self._extra("list", "")
            obs.list_with_delimiter(self._inner, None)
        except Exception as le:
            err = self._error(le, key, write=False)
            if isinstance(err, BucketNotFoundError):
                raise err from redacted(e)
            return
        self._bucket_seen = True

    # --- reads ------------------------------------------------------------------

    def get(self, key: str) -> GetResult:
        check_key(key)
        alt = self._alt()
        if alt is not None:
            return alt.get(key)
        try:
            r = obs.get(self._inner, key)
            data = obsbody.whole(r, key)
            etag = r.meta["e_tag"]
        except StoreError:
            raise
        except Exception as e:
            raise self._error(e, key, write=False) from redacted(e)
        if etag is None:
            raise StoreError(f"the store returned no etag for {key}")
        return GetResult(data, etag, obsbody.checksum(r))

    def get_if_changed(self, key: str, etag: str) -> GetResult | None:
        check_key(key)
        alt = self._alt()
        if alt is not None:
            return alt.get_if_changed(key, etag)
        try:
            r = obs.get(self._inner, key, options={"if_none_match": etag})
            data = bytes(r.bytes())
            now = r.meta["e_tag"]
        except obx.NotModifiedError:
            return None  # 304: S3, Azure Blob and memory answer so while it is unchanged
        except Exception as e:
            raise self._error(e, key, write=False) from redacted(e)
        if now is None:
            raise StoreError(f"the store returned no etag for {key}")
        # a server that ignores If-None-Match answers 200 with the unchanged object
        return None if now == etag else GetResult(data=data, etag=now)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        check_key(key)
        alt = self._alt()
        if alt is not None:
            return alt.get_range(key, start, end)
        check_range(start, end)
        if start == end:
            self.head(key)  # still report a missing key
            return b""
        try:
            return bytes(obs.get_range(self._inner, key, start=start, end=end))
        except Exception as e:
            if unsatisfiable(e):
                return b""
            if not_partial(e):
                self._extra("get", key)
                return self.get(key).data[start:end]
            raise self._error(e, key, write=False) from redacted(e)

    def read_into(self, key: str, start: int, out: memoryview) -> Stored | None:
        """One ranged GET whose body is streamed into ``out`` (see ReadsInto and
        :mod:`tieredbuf.store.obsbody`): the response is never held whole beside ``out``.
        Returns the object's size from the response (Content-Range)."""
        check_key(key)
        alt = self._alt()
        if alt is not None:
            return alt.read_into(key, start, out)
        if start < 0:
            raise ValueError(f"invalid range start {start}")
        if not len(out):
            self._extra("head", key)
            return Stored(self.head(key).size)
        try:
            r = obs.get(self._inner, key, options={"range": (start, start + len(out))})
            size = int(r.meta["size"])
            if obsbody.into(r, out, key) < min(len(out), size - start):
                raise StoreError(f"{key}: the response ended before its range did")
        except StoreError:
            raise
        except Exception as e:
            if unsatisfiable(e):  # the object ends before ``start``: its size, from a HEAD
                self._extra("head", key)
                return Stored(self.head(key).size)
            if not_partial(e):
                self._extra("get", key)
                whole = self.get(key)
                got = whole.data[start : start + len(out)]
                out[: len(got)] = got
                return Stored(len(whole.data), whole.crc32)
            raise self._error(e, key, write=False) from redacted(e)
        return Stored(size, obsbody.checksum(r))

    def get_suffix(self, key: str, length: int) -> bytes:
        check_key(key)
        alt = self._alt()
        if alt is not None:
            return alt.get_suffix(key, length)
        if length < 0:
            raise ValueError(f"invalid suffix length {length}")
        if length == 0:
            self.head(key)
            return b""
        if self._remote is not None and self._remote.provider == "azure":
            return self._suffix_by_size(key, length)
        try:
            r = obs.get(self._inner, key, options={"range": {"suffix": length}})
            return bytes(r.bytes())
        except Exception as e:
            if unsatisfiable(e):
                return b""  # an empty object
            if not_partial(e):
                self._extra("get", key)
                return self.get(key).data[-length:]
            raise self._error(e, key, write=False) from redacted(e)

    def _suffix_by_size(self, key: str, length: int) -> bytes:
        """A suffix read where the service has no suffix range (Azure Blob): HEAD for the
        size, then a ranged GET pinned to that version with If-Match, so a replaced object
        (the manifest root) is never read as a mix of two versions; a replacement in
        between reads again."""
        for _ in range(_SUFFIX_ATTEMPTS):
            self._extra("head", key)
            meta = self.head(key)
            if meta.size == 0:
                return b""
            start = max(0, meta.size - length)
            options: Any = {"range": (start, meta.size)}
            if meta.etag is not None:
                options["if_match"] = meta.etag
            try:
                return bytes(obs.get(self._inner, key, options=options).bytes())
            except Exception as e:
                err = self._error(e, key, write=False)
                if isinstance(err, PreconditionFailedError):
                    continue  # replaced between the HEAD and the GET: read again
                raise err from redacted(e)
        raise TransientStoreError(
            f"{key} was replaced during each of {_SUFFIX_ATTEMPTS} suffix reads: try again"
        )

    def _explain_refusal(self, key: str, e: BaseException) -> None:
        """A HEAD answers wrong credentials and a missing permission alike, with a bare
        403: ask once with a one-byte GET of the same key (the same permission), whose
        answer names the cause (see :func:`tieredbuf.store.errmap.unexplained_refusal`)."""
        if not unexplained_refusal(obstore_facts(e)):
            return
        try:
            self._extra("get", key)
            obs.get_range(self._inner, key, start=0, end=1)
        except Exception as ge:
            err = self._error(ge, key, write=False)
            if explains_refusal(err):
                raise err from redacted(ge)

    def head(self, key: str) -> ObjectMeta:
        check_key(key)
        alt = self._alt()
        if alt is not None:
            return alt.head(key)
        try:
            meta = _meta(obs.head(self._inner, key))
        except Exception as e:
            err = self._error(e, key, write=False)
            if isinstance(err, ObjectNotFoundError):
                self._check_bucket(key, e)
            self._explain_refusal(key, e)
            raise err from redacted(e)
        self._bucket_seen = True
        return meta

    def list(self, prefix: str) -> Iterator[ObjectMeta]:
        check_prefix(prefix)
        alt = self._alt()
        if alt is not None:
            yield from alt.list(prefix)
            return
        # obstore lists by path segments ('a' lists 'a/...', never 'ab'): list the
        # directory part and filter, so the contract's "starts with" holds.
        base = prefix_dir(prefix)
        try:
            for batch in obs.list(self._inner, base or None, chunk_size=1000):
                for m in batch:
                    if m["path"].startswith(prefix):
                        yield _meta(m)
        except Exception as e:
            raise self._error(e, prefix, write=False) from redacted(e)

    # --- writes -----------------------------------------------------------------

    def _ensure_probed(self, mode: PutMode) -> None:
        if self._probe_target is None or mode == "overwrite" or PROBES.passed(self._probe_target):
            return
        endpoint, bucket = self._probe_target
        raw = ObjStore(
            self._inner,
            self._url,
            probe_target=None,
            chunk_size=self._chunk_size,
            s3=self._s3,
            remote=self._remote,
        )
        probe = raw if self._meter is None else MeteredStore(raw, self._meter)
        where = (
            self._remote.described
            if self._remote is not None
            else f"endpoint {endpoint} (bucket {bucket!r})"
        )
        PROBES.ensure(self._probe_target, probe, where)

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = "overwrite") -> str:
        return self._put_one(key, data, mode, None)

    def put_checksummed(
        self, key: str, data: bytes | memoryview, crc32: int, *, mode: PutMode = "create"
    ) -> str:
        """:meth:`put` with ``crc32`` kept in the object's metadata (KeepsChecksums)."""
        return self._put_one(key, data, mode, crc32)

    def _put_one(self, key: str, data: bytes | memoryview, mode: PutMode, crc32: int | None) -> str:
        check_key(key)
        om = _obstore_mode(mode)
        self._ensure_probed(mode)
        alt = self._alt()
        if alt is not None:
            return put_with_checksum(alt, key, data, crc32, mode=mode)
        attrs: Any = None if crc32 is None else {keys.CHECKSUM_METADATA: keys.format_crc32(crc32)}
        try:
            r = obs.put(self._inner, key, data, mode=om, use_multipart=False, attributes=attrs)
        except Exception as e:
            raise self._error(e, key, write=True) from redacted(e)
        self._bucket_seen = True
        return self._etag_of(r, key)

    def put_multipart(
        self, key: str, chunks: Iterable[bytes | memoryview], *, mode: PutMode = "create"
    ) -> str:
        check_key(key)
        om = _obstore_mode(mode)
        self._ensure_probed(mode)
        alt = self._alt()
        if alt is not None:
            return alt.put_multipart(key, chunks, mode=mode)
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
            raise self._error(e, key, write=True) from redacted(e)
        self._bucket_seen = True
        return self._etag_of(r, key)

    @staticmethod
    def _etag_of(r: Any, key: str) -> str:
        etag = r.get("e_tag")
        if etag is None:
            raise OutcomeUnknownError(f"the store acknowledged {key} without an etag")
        return str(etag)

    def copy(self, src: str, dst: str) -> None:
        check_key(src)
        check_key(dst)
        alt = self._alt()
        if alt is not None:
            alt.copy(src, dst)
            return
        try:
            # server-side (S3 CopyObject, up to 5 GiB); dst is a fresh ULID key, so the
            # unconditional copy cannot replace anything (S3 has no conditional copy)
            obs.copy(self._inner, src, dst, overwrite=True)
        except Exception as e:
            raise self._error(e, src, write=True) from redacted(e)

    def delete_many(self, keys: Sequence[str]) -> builtins.list[tuple[str, Exception]]:
        keys = [check_key(k) for k in keys]
        if not keys:
            return []
        alt = self._alt()
        if alt is not None:
            return alt.delete_many(keys)
        try:
            obs.delete(self._inner, keys)
            return []
        except Exception:
            pass  # find out which ones failed, one by one
        failures: builtins.list[tuple[str, Exception]] = []
        for k in keys:
            try:
                self._extra("delete", k)
                obs.delete(self._inner, k)
            except FileNotFoundError:
                continue
            except Exception as e:
                failures.append((k, self._error(e, k, write=True)))
        return failures

    def close(self) -> None:
        """obstore stores hold no resources that need closing."""
