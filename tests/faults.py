"""Store wrappers for tests and benchmarks: fault injection (invariant I2), a per-key
write limit, and request counting (by operation and by kind of key).

``FaultInjectingStore`` reproduces what a real S3 client does when a response is lost:
``when="after"`` performs the real operation and then raises, so the caller sees an
error although the write landed.  With ``error=PreconditionFailedError`` (If-Match) or
``AlreadyExistsError`` (create) this is exactly obstore retrying a PUT that had
already succeeded and meeting its own write (invariant I2, docs/invariants.md); with
``OutcomeUnknownError`` it is a timeout / connection reset after the PUT.
``when="before"`` raises without touching the inner store.

``KeyRateLimitedStore`` models Google Cloud Storage's and Cloudflare R2's limit of
about one write per second to one key: a second write to a key within the window is
refused with HTTP 429 SlowDown (classified as the real clients' 429 is: a transient
error, refused and not applied).

Damaged objects (replaced, truncated, extended, a byte flipped; invariant I10) are
``tests/damage.py``'s ``DamagingStore``: a torture harness wraps its store in it and
damages what it chooses.
"""

from __future__ import annotations

import builtins
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeVar

from tieredbuf.errors import ConflictError, ObjectNotFoundError
from tieredbuf.keys import key_kind
from tieredbuf.store.base import (
    KEY_LIMITED_MANIFEST_WRITES_PER_S,
    GetResult,
    ObjectMeta,
    PutMode,
    Store,
    Stored,
    copy_range,
)
from tieredbuf.store.errmap import Facts, classify

Op = Literal[
    "get", "get_range", "get_suffix", "head", "put", "put_multipart", "copy", "list", "delete_many"
]
OPS: tuple[Op, ...] = (
    "get",
    "get_range",
    "get_suffix",
    "head",
    "put",
    "put_multipart",
    "copy",
    "list",
    "delete_many",
)
When = Literal["before", "after"]
ErrorSpec = type[Exception] | Exception | Callable[[str], Exception]

T = TypeVar("T")


def _make_error(spec: ErrorSpec, op: str, key: str) -> Exception:
    if isinstance(spec, Exception):
        return spec
    if isinstance(spec, type):
        cls: type[Exception] = spec
        msg = f"injected fault on {op} {key}"
        if issubclass(cls, ConflictError | ObjectNotFoundError):
            return cls(key, msg)
        return cls(msg)
    return spec(key)


@dataclass
class Fault:
    """One armed fault; ``fired`` counts how often it triggered."""

    op: Op
    key: str | None
    """Exact key (for list: the prefix; for delete_many: any of the keys); None = any."""
    when: When
    error: ErrorSpec
    times: int | None
    """Remaining triggers; None = forever."""
    mode: PutMode | None = None
    """For put / put_multipart: trigger only on this mode (None = any)."""
    fired: int = field(default=0)

    def matches(self, op: str, keys: Sequence[str], mode: PutMode | None) -> bool:
        if op != self.op or self.times == 0:
            return False
        if self.key is not None and self.key not in keys:
            return False
        return self.mode is None or self.mode == mode


class FaultInjectingStore:
    """A Store that forwards to ``inner`` and raises armed faults.  Thread-safe."""

    def __init__(self, inner: Store) -> None:
        self._inner = inner
        self._lock = threading.Lock()
        self._faults: list[Fault] = []

    @property
    def inner(self) -> Store:
        return self._inner

    @property
    def url(self) -> str:
        return self._inner.url

    def arm(
        self,
        op: Op,
        *,
        key: str | None = None,
        when: When = "after",
        error: ErrorSpec,
        times: int | None = 1,
        mode: PutMode | None = None,
    ) -> Fault:
        """Make the next ``times`` calls of ``op`` (on ``key``, with ``mode``) raise ``error``.

        ``error`` is an exception class (ConflictError / ObjectNotFoundError subclasses
        get the key), an instance, or a callable key -> exception.  ``when="after"``
        runs the real operation first; if that itself fails, its error propagates and
        the fault stays armed (no response was lost).
        """
        if op not in OPS:
            raise ValueError(f"unknown op {op!r}; one of {OPS}")
        if when not in ("before", "after"):
            raise ValueError(f"when must be 'before' or 'after', got {when!r}")
        fault = Fault(op=op, key=key, when=when, error=error, times=times, mode=mode)
        with self._lock:
            self._faults.append(fault)
        return fault

    def disarm(self) -> None:
        with self._lock:
            self._faults.clear()

    def _take(self, op: str, keys: Sequence[str], mode: PutMode | None = None) -> Fault | None:
        with self._lock:
            for f in self._faults:
                if f.matches(op, keys, mode):
                    if f.times is not None:
                        f.times -= 1
                    f.fired += 1
                    return f
        return None

    def _run(
        self,
        op: str,
        key: str,
        fn: Callable[[], T],
        keys: Sequence[str] = (),
        mode: PutMode | None = None,
    ) -> T:
        fault = self._take(op, keys or (key,), mode)
        if fault is None:
            return fn()
        if fault.when == "before":
            raise _make_error(fault.error, op, key)
        try:
            fn()
        except BaseException:
            # the real operation failed: no response was "lost"; the fault stays armed
            with self._lock:
                if fault.times is not None:
                    fault.times += 1
                fault.fired -= 1
            raise
        raise _make_error(fault.error, op, key)

    def get(self, key: str) -> GetResult:
        return self._run("get", key, lambda: self._inner.get(key))

    def get_if_changed(self, key: str, etag: str) -> GetResult | None:
        # a GET (with If-None-Match): faults armed on "get" fire on it too
        return self._run("get", key, lambda: self._inner.get_if_changed(key, etag))

    def get_range(self, key: str, start: int, end: int) -> bytes:
        return self._run("get_range", key, lambda: self._inner.get_range(key, start, end))

    def read_into(self, key: str, start: int, out: memoryview) -> Stored | None:
        # a ranged GET: faults armed on "get_range" fire on it too
        return self._run("get_range", key, lambda: copy_range(self._inner, key, start, out))

    def get_suffix(self, key: str, length: int) -> bytes:
        return self._run("get_suffix", key, lambda: self._inner.get_suffix(key, length))

    def head(self, key: str) -> ObjectMeta:
        return self._run("head", key, lambda: self._inner.head(key))

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = "overwrite") -> str:
        return self._run("put", key, lambda: self._inner.put(key, data, mode=mode), mode=mode)

    def put_multipart(
        self, key: str, chunks: Iterable[bytes | memoryview], *, mode: PutMode = "create"
    ) -> str:
        return self._run(
            "put_multipart",
            key,
            lambda: self._inner.put_multipart(key, chunks, mode=mode),
            mode=mode,
        )

    def copy(self, src: str, dst: str) -> None:
        self._run("copy", dst, lambda: self._inner.copy(src, dst))

    def list(self, prefix: str) -> Iterator[ObjectMeta]:
        return iter(self._run("list", prefix, lambda: list(self._inner.list(prefix))))

    def delete_many(self, keys: Sequence[str]) -> builtins.list[tuple[str, Exception]]:
        first = keys[0] if keys else ""
        return self._run("delete_many", first, lambda: self._inner.delete_many(keys), keys=keys)

    def close(self) -> None:
        self._inner.close()


class KeyRateLimitedStore:
    """A Store that refuses a second write to one key within ``window_s`` seconds of the
    last accepted one (put in any mode, put_multipart, copy to it), as GCS and R2 do:
    HTTP 429 SlowDown, through :func:`~tieredbuf.store.errmap.classify` like a real
    client's answer, so a TransientStoreError.  A refused write changes nothing and does
    not restart the window.  ``writes[key]`` holds the ``clock()`` times of the accepted
    writes, ``refused[key]`` counts the refusals, ``attempts[key]`` lists every write as
    (time, thread id, not refused by the limit).  Its ``manifest_writes_per_s`` is the
    budget tieredbuf gives such stores (GCS, R2).  Thread-safe."""

    def __init__(
        self,
        inner: Store,
        window_s: float = 1.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        manifest_writes_per_s: float = KEY_LIMITED_MANIFEST_WRITES_PER_S,
    ) -> None:
        self._inner = inner
        self.window_s = window_s
        self._clock = clock
        self.manifest_writes_per_s = manifest_writes_per_s
        self._lock = threading.Lock()
        self._key_locks: dict[str, threading.Lock] = {}
        self.writes: dict[str, builtins.list[float]] = {}
        self.refused: Counter[str] = Counter()
        self.attempts: dict[str, builtins.list[tuple[float, int, bool]]] = {}

    @property
    def inner(self) -> Store:
        return self._inner

    @property
    def url(self) -> str:
        return self._inner.url

    def _write(self, key: str, fn: Callable[[], T]) -> T:
        with self._lock:
            lock = self._key_locks.setdefault(key, threading.Lock())
        with lock:  # one write to a key at a time: the check and the write are one step
            now = self._clock()
            last = self.writes.get(key)
            refuse = bool(last) and now - last[-1] < self.window_s  # type: ignore[index]
            with self._lock:
                self.attempts.setdefault(key, []).append((now, threading.get_ident(), not refuse))
            if refuse:
                with self._lock:
                    self.refused[key] += 1
                facts = Facts(
                    status=429,
                    code="SlowDown",
                    method="PUT",
                    uri=key,
                    message="Please reduce your request rate.",
                )
                raise classify(facts, key, write=True)
            result = fn()
            with self._lock:
                self.writes.setdefault(key, []).append(self._clock())
            return result

    def get(self, key: str) -> GetResult:
        return self._inner.get(key)

    def get_if_changed(self, key: str, etag: str) -> GetResult | None:
        return self._inner.get_if_changed(key, etag)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        return self._inner.get_range(key, start, end)

    def read_into(self, key: str, start: int, out: memoryview) -> Stored | None:
        return copy_range(self._inner, key, start, out)

    def get_suffix(self, key: str, length: int) -> bytes:
        return self._inner.get_suffix(key, length)

    def head(self, key: str) -> ObjectMeta:
        return self._inner.head(key)

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = "overwrite") -> str:
        return self._write(key, lambda: self._inner.put(key, data, mode=mode))

    def put_multipart(
        self, key: str, chunks: Iterable[bytes | memoryview], *, mode: PutMode = "create"
    ) -> str:
        return self._write(key, lambda: self._inner.put_multipart(key, chunks, mode=mode))

    def copy(self, src: str, dst: str) -> None:
        self._write(dst, lambda: self._inner.copy(src, dst))

    def list(self, prefix: str) -> Iterator[ObjectMeta]:
        return self._inner.list(prefix)

    def delete_many(self, keys: Sequence[str]) -> builtins.list[tuple[str, Exception]]:
        return self._inner.delete_many(keys)

    def close(self) -> None:
        self._inner.close()


class CountingStore:
    """A Store that forwards to ``inner`` and counts calls per operation, and requests
    per operation and kind of key (:func:`tieredbuf.keys.key_kind`).  Thread-safe.

    ``counts["get"]`` etc. (calls); ``of("root")``: requests on one kind of key, by
    operation (a ``delete_many`` counts one ``delete`` per key); ``bytes_read`` /
    ``bytes_written`` sum payload sizes.
    """

    def __init__(self, inner: Store) -> None:
        self._inner = inner
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._by_kind: Counter[tuple[str, str]] = Counter()
        self.bytes_read = 0
        self.bytes_written = 0

    @property
    def inner(self) -> Store:
        return self._inner

    @property
    def url(self) -> str:
        return self._inner.url

    @property
    def counts(self) -> Counter[str]:
        """A snapshot of the call counts."""
        with self._lock:
            return Counter(self._counts)

    @property
    def reads(self) -> int:
        """GET-type requests (get, get_range, get_suffix)."""
        c = self.counts
        return c["get"] + c["get_range"] + c["get_suffix"]

    @property
    def by_kind(self) -> Counter[tuple[str, str]]:
        """A snapshot of the requests by (operation, kind of key)."""
        with self._lock:
            return Counter(self._by_kind)

    def of(self, kind: str) -> dict[str, int]:
        """Requests on one kind of key (``root``, ``data``, ``group``, ``subscriber``,
        ``announcement``...), by operation."""
        with self._lock:
            return {op: n for (op, k), n in self._by_kind.items() if k == kind and n}

    def reset(self) -> None:
        with self._lock:
            self._counts.clear()
            self._by_kind.clear()
            self.bytes_read = 0
            self.bytes_written = 0

    def _count(self, op: str, key: str, read: int = 0, written: int = 0) -> None:
        with self._lock:
            self._counts[op] += 1
            self._by_kind[(op, key_kind(key))] += 1
            self.bytes_read += read
            self.bytes_written += written

    def get(self, key: str) -> GetResult:
        self._count("get", key)
        r = self._inner.get(key)
        self._count_bytes(read=len(r.data))
        return r

    def get_if_changed(self, key: str, etag: str) -> GetResult | None:
        self._count("get", key)  # one GET, whether it answered 304 or the object
        r = self._inner.get_if_changed(key, etag)
        if r is not None:
            self._count_bytes(read=len(r.data))
        return r

    def get_range(self, key: str, start: int, end: int) -> bytes:
        self._count("get_range", key)
        b = self._inner.get_range(key, start, end)
        self._count_bytes(read=len(b))
        return b

    def read_into(self, key: str, start: int, out: memoryview) -> Stored | None:
        self._count("get_range", key)  # one ranged GET, read into the caller's buffer
        said = copy_range(self._inner, key, start, out)
        known = len(out) if said is None else max(0, min(len(out), said.size - start))
        self._count_bytes(read=known)
        return said

    def get_suffix(self, key: str, length: int) -> bytes:
        self._count("get_suffix", key)
        b = self._inner.get_suffix(key, length)
        self._count_bytes(read=len(b))
        return b

    def head(self, key: str) -> ObjectMeta:
        self._count("head", key)
        return self._inner.head(key)

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = "overwrite") -> str:
        self._count("put", key, written=memoryview(data).nbytes)
        return self._inner.put(key, data, mode=mode)

    def put_multipart(
        self, key: str, chunks: Iterable[bytes | memoryview], *, mode: PutMode = "create"
    ) -> str:
        self._count("put_multipart", key)

        def counted() -> Iterator[bytes | memoryview]:
            for c in chunks:
                self._count_bytes(written=memoryview(c).nbytes)
                yield c

        return self._inner.put_multipart(key, counted(), mode=mode)

    def copy(self, src: str, dst: str) -> None:
        self._count("copy", dst)
        self._inner.copy(src, dst)

    def list(self, prefix: str) -> Iterator[ObjectMeta]:
        self._count("list", prefix)
        return self._inner.list(prefix)

    def delete_many(self, keys: Sequence[str]) -> builtins.list[tuple[str, Exception]]:
        with self._lock:
            self._counts["delete_many"] += 1
            for k in keys:
                self._by_kind[("delete", key_kind(k))] += 1
        return self._inner.delete_many(keys)

    def close(self) -> None:
        self._inner.close()

    def _count_bytes(self, *, read: int = 0, written: int = 0) -> None:
        with self._lock:
            self.bytes_read += read
            self.bytes_written += written
