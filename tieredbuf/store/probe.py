"""Prove that an object store (S3 endpoint, Azure Blob account, GCS bucket) honours
conditional writes before trusting it.

Some S3-compatible servers accept ``If-None-Match: *`` and ``If-Match`` and then
ignore them.  On such a server every CAS "succeeds", two producers overwrite each
other's manifest and acknowledged data is lost silently.  So before the first
conditional write to an endpoint (once per process per (endpoint, bucket)) we write a
probe object under ``_probe/<ULID>`` and check that the server refuses what it must
refuse::

    1. create  probe-1                   must land      (its version token E)
    2. create  probe-2                   must be refused (the key exists)
    3. If-Match E, probe-3               must land
    4. If-Match E (now stale), probe-4   must be refused

A stale token is what a lost CAS race presents, and it is a real token of the store's
own kind whatever its tokens look like (S3 and Azure ETags, GCS generations), where a
made-up one may not parse.  A response can be lost after the server applied the write;
the client retries, and the retry meets the probe's own write: a landed create comes
back as AlreadyExistsError, a landed If-Match as PreconditionFailedError (invariant
I2).  So a refusal of step 1 or 3 is never taken at its word: the probe reads the
object back, and a body of its own (probe-1, probe-3) means the write landed.  The
store is judged unable only on evidence no lost response can explain:

* step 2 or 4 *succeeds*: the answer is the server's own verdict on a write it must
  refuse (a lost response hides an answer; it never turns a refusal into a success);
* step 3 is refused with 412 while the object still holds probe-1 under E: the write
  did not land, and the server refused the token it gave out;
* step 3 is refused and the object holds probe-2 or probe-4, or holds probe-1 under
  another token than its PUT answered.

A 409 (S3's ConditionalRequestConflict: a concurrent conditional write, such as the
probe's own first attempt still in flight) with the object unchanged proves nothing:
the step is tried again, and after :data:`ATTEMPTS` such answers the probe fails with
a TransientStoreError (not cached: the next conditional write probes again).

The decision is a pure sequence of store calls, so it is tested against stores that
ignore modes (tests/store/test_probe.py), and through a proxy that loses responses
after the write landed.
"""

from __future__ import annotations

import os
import threading

from ulid import ULID

from tieredbuf import keys
from tieredbuf.errors import (
    ConditionalWritesUnsupportedError,
    ConflictError,
    ObjectNotFoundError,
    PermanentStoreError,
    PreconditionFailedError,
    TransientStoreError,
)
from tieredbuf.store.base import GetResult, IfMatch, Store

_P1, _P2, _P3, _P4 = b"probe-1", b"probe-2", b"probe-3", b"probe-4"
ATTEMPTS = 3
"""How often a step is tried while the store answers 409 with the object unchanged."""
_HINT = (
    "tieredbuf needs a store that enforces conditional writes (AWS S3, MinIO, SeaweedFS, "
    "recent Ceph RGW, Azure Blob, GCS) -- pass probe=False only if you know better"
)


def probe_conditional_writes(store: Store, where: str) -> None:
    """Raise ConditionalWritesUnsupportedError unless ``store`` enforces both preconditions
    (see the module docstring for the steps and what counts as evidence).

    ``where`` names the endpoint in the error message.  The probe object is deleted
    afterwards (best effort; GC ignores ``_probe/`` keys anyway).
    """
    key = keys.probe_key(ULID())
    try:
        etag = _create(store, key, where)
        try:
            store.put(key, _P2, mode="create")
        except ConflictError:
            pass  # refused, as it must be (412, or a 409 conflict)
        else:
            raise ConditionalWritesUnsupportedError(
                f"{where} ignores If-None-Match: * (create-if-absent overwrote {key!r}); {_HINT}"
            )
        _replace(store, key, etag, where)
        try:
            store.put(key, _P4, mode=IfMatch(etag))
        except (ConflictError, ObjectNotFoundError):
            pass  # refused: 412 (or 404 on some servers; a 409 conflict)
        else:
            raise ConditionalWritesUnsupportedError(
                f"{where} ignores If-Match (a PUT with a stale token replaced {key!r}); {_HINT}"
            )
    finally:
        store.delete_many([key])


def _read_back(store: Store, key: str) -> GetResult | None:
    try:
        return store.get(key)
    except ObjectNotFoundError:
        return None


def _foreign(key: str, where: str, found: GetResult) -> PermanentStoreError:
    return PermanentStoreError(
        f"{where} answered the conditional-write probe's fresh key {key!r} with "
        f"{len(found.data)} byte(s) the probe never wrote there: the store returns "
        f"another object's content"
    )


def _create(store: Store, key: str, where: str) -> str:
    """Step 1: create ``key`` (a fresh ULID) holding probe-1; its etag.  A refusal is
    read back: probe-1 there is the probe's own create, landed with its response lost."""
    for _ in range(ATTEMPTS):
        try:
            return store.put(key, _P1, mode="create")
        except ConflictError as e:
            found = _read_back(store, key)
            if found is None:
                last: ConflictError = e  # a 409, or a refusal of nothing: try again
                continue
            if found.data == _P1:
                return found.etag  # the retry met the probe's own landed create
            raise _foreign(key, where, found) from e
    raise TransientStoreError(
        f"{where} refused, {ATTEMPTS} times, to create the conditional-write probe's fresh "
        f"key {key!r}, and no object is there ({last}): try again"
    ) from last


def _replace(store: Store, key: str, etag: str, where: str) -> None:
    """Step 3: replace probe-1 by probe-3 with If-Match ``etag``.  A refusal is read
    back: probe-3 there is the probe's own write, landed with its response lost."""
    for _ in range(ATTEMPTS):
        try:
            store.put(key, _P3, mode=IfMatch(etag))
            return
        except ConflictError as e:
            found = _read_back(store, key)
            if found is not None and found.data == _P3:
                return  # the retry met the probe's own landed write
            if found is None:
                raise TransientStoreError(
                    f"the conditional-write probe's object {key!r} vanished from {where} "
                    f"while the probe ran ({e}): try again"
                ) from e
            if found.data in (_P2, _P4):
                raise ConditionalWritesUnsupportedError(
                    f"{where} applied a conditional write it refused ({key!r} holds "
                    f"{found.data.decode()}); {_HINT}"
                ) from e
            if found.data != _P1:
                raise _foreign(key, where, found) from e
            if found.etag != etag:
                raise ConditionalWritesUnsupportedError(
                    f"{where} gave etag {etag!r} for {key!r} but serves the same, unchanged "
                    f"object with etag {found.etag!r}: its etags are not usable as version "
                    f"tokens; {_HINT}"
                ) from e
            if isinstance(e, PreconditionFailedError):
                raise ConditionalWritesUnsupportedError(
                    f"{where} refused If-Match with the object's current etag {etag!r} on "
                    f"{key!r} (read back: it still holds the probe's first body under that "
                    f"etag, so the write did not land and no lost response explains the "
                    f"refusal): its etags are not usable as version tokens; {_HINT}"
                ) from e
            last: ConflictError = e  # a 409 conflict with the object unchanged: try again
    raise TransientStoreError(
        f"{where} answered, {ATTEMPTS} times, a conflict to the conditional-write probe's "
        f"If-Match on {key!r} with the object unchanged ({last}): try again"
    ) from last


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
