"""Prove that an object store (S3 endpoint, Azure Blob account, GCS bucket) honours
conditional writes before trusting it.

Some S3-compatible servers accept ``If-None-Match: *`` and ``If-Match`` and then
ignore them.  On such a server every CAS "succeeds", two producers overwrite each
other's manifest and acknowledged data is lost silently.  So before the first
conditional write to an endpoint (once per process per (endpoint, bucket)) we write a
probe object under ``_probe/<ULID>`` and check that the server refuses what it must
refuse.  The decision is a pure sequence of store calls, so it is tested against a
store that ignores modes (see tests/store/test_probe.py).
"""

from __future__ import annotations

import os
import threading

from ulid import ULID

from tieredbuf import keys
from tieredbuf.errors import (
    AlreadyExistsError,
    ConditionalWritesUnsupportedError,
    ConflictError,
    ObjectNotFoundError,
    PreconditionFailedError,
)
from tieredbuf.store.base import IfMatch, Store


def probe_conditional_writes(store: Store, where: str) -> None:
    """Raise ConditionalWritesUnsupportedError unless ``store`` enforces both preconditions.

    Four conditional PUTs of one probe object: create (must succeed), create again (must
    be refused), replace with the version token the first returned (must succeed), and
    replace with that now stale token (must be refused).  A stale token is what a lost
    CAS race presents, and it works on every store whatever its tokens look like (S3 and
    Azure ETags, GCS generations).  ``where`` names the endpoint in the error message.
    The probe object is deleted afterwards (best effort; GC ignores ``_probe/`` keys).
    """
    key = keys.probe_key(ULID())
    try:
        try:
            first = store.put(key, b"probe-1", mode="create")
        except ConflictError:
            # the client retried a create whose first response was lost and met its own
            # write; the object is ours.  Read its version back.
            first = store.get(key).etag
        try:
            store.put(key, b"probe-2", mode="create")
        except AlreadyExistsError:
            pass
        else:
            raise ConditionalWritesUnsupportedError(
                f"{where} ignores If-None-Match: * (create-if-absent overwrote {key!r}); "
                "tieredbuf needs a store that enforces conditional writes (AWS S3, MinIO, "
                "SeaweedFS, recent Ceph RGW, Azure Blob, GCS) -- pass probe=False only if "
                "you know better"
            )
        try:
            store.put(key, b"probe-3", mode=IfMatch(first))
        except ConflictError as e:
            # the client may have retried a replace whose answer was lost and met its own
            # write (I2): refused only if the object is not what it wrote
            if store.get(key).data != b"probe-3":
                raise ConditionalWritesUnsupportedError(
                    f"{where} refused If-Match with the object's current etag {first!r} on "
                    f"{key!r}: its etags are not usable as version tokens"
                ) from e
        try:
            store.put(key, b"probe-4", mode=IfMatch(first))
        except (PreconditionFailedError, ObjectNotFoundError):
            pass
        except AlreadyExistsError:
            # a 409 ConditionalRequestConflict surfaces this way: also a refusal
            pass
        else:
            raise ConditionalWritesUnsupportedError(
                f"{where} ignores If-Match (a PUT with a stale etag replaced {key!r}); "
                "tieredbuf needs a store that enforces conditional writes -- pass probe=False "
                "only if you know better"
            )
    finally:
        store.delete_many([key])


class ProbeCache:
    """Run the probe once per process per target; thread-safe; failures are not cached."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._passed: set[tuple[str, str]] = set()

    def ensure(self, target: tuple[str, str], store: Store, where: str) -> None:
        if target in self._passed:
            return
        with self._lock:
            lock = self._locks.setdefault(target, threading.Lock())
        with lock:
            if target in self._passed:
                return
            probe_conditional_writes(store, where)
            self._passed.add(target)

    def passed(self, target: tuple[str, str]) -> bool:
        return target in self._passed

    def forget(self) -> None:
        """Forget every result (tests)."""
        with self._lock:
            self._passed.clear()

    def after_fork(self) -> None:
        """In a forked child: fresh locks (a parent thread may have held one) and no
        results -- the child probes again through its own client."""
        self._lock = threading.Lock()
        self._locks = {}
        self._passed = set()


PROBES = ProbeCache()
"""The process-wide probe results, keyed by (endpoint, bucket)."""
os.register_at_fork(after_in_child=PROBES.after_fork)
