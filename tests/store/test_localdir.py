"""Local-directory backend specifics beyond the contract: atomic visibility, temp files,
content-hash etags, reserved names."""

from __future__ import annotations

import errno
import hashlib
import os
import threading
import time
from pathlib import Path

import pytest

from tieredbuf import errors
from tieredbuf.store import IfMatch, LocalDirStore, open_store
from tieredbuf.store._common import os_error
from tieredbuf.store.localdir import LOCK_NAME, TEMP_MAX_AGE, TEMP_PREFIX


def test_etag_is_a_content_hash_stable_across_reopen(tmp_path: Path) -> None:
    s = LocalDirStore(tmp_path)
    etag = s.put("a/b", b"payload")
    assert etag == hashlib.blake2b(b"payload", digest_size=16).hexdigest()
    s.close()
    again = LocalDirStore(tmp_path)
    assert again.head("a/b").etag == etag
    assert again.put("a/b", b"next", mode=IfMatch(etag)) != etag


def test_temp_files_and_lock_never_show_and_stale_temps_are_reaped(tmp_path: Path) -> None:
    s = LocalDirStore(tmp_path)
    s.put("d/x", b"1")
    fresh = tmp_path / "d" / f"{TEMP_PREFIX}live"
    stale = tmp_path / "d" / f"{TEMP_PREFIX}crashed"
    fresh.write_bytes(b"partial")
    stale.write_bytes(b"partial")
    old = time.time() - TEMP_MAX_AGE.total_seconds() - 60
    os.utime(stale, (old, old))
    assert (tmp_path / LOCK_NAME).exists()
    assert [m.key for m in s.list("")] == ["d/x"]
    assert fresh.exists() and not stale.exists()  # a live writer's temp file is left alone


def test_no_temp_file_is_left_after_failed_conditional_writes(tmp_path: Path) -> None:
    s = LocalDirStore(tmp_path)
    e = s.put("k", b"1", mode="create")
    with pytest.raises(errors.AlreadyExistsError):
        s.put("k", b"2", mode="create")
    with pytest.raises(errors.PreconditionFailedError):
        s.put("k", b"3", mode=IfMatch("0" * 32))
    with pytest.raises(errors.ObjectNotFoundError):
        s.put("missing", b"4", mode=IfMatch(e))
    assert sorted(os.listdir(tmp_path)) == sorted([LOCK_NAME, "k"])


@pytest.mark.parametrize("key", [".tieredbuf.lock", "a/.tieredbuf-tmp-x", "../escape"])
def test_reserved_and_escaping_keys_are_rejected(tmp_path: Path, key: str) -> None:
    s = LocalDirStore(tmp_path / "root")
    with pytest.raises(errors.InvalidKeyError):
        s.put(key, b"x")
    assert not (tmp_path / "escape").exists()


def test_a_key_cannot_also_be_a_prefix(tmp_path: Path) -> None:
    s = LocalDirStore(tmp_path)
    s.put("a/b", b"x")
    with pytest.raises(errors.StoreError):
        s.put("a", b"y")
    with pytest.raises(errors.ObjectNotFoundError):
        s.get("a")
    with pytest.raises(errors.StoreError):
        s.put("a/b/c", b"z")


def test_readers_never_see_a_partial_object(tmp_path: Path) -> None:
    """Overwrites alternate two 2 MiB objects of one repeated byte; every concurrent
    read must be entirely one or the other."""
    s = open_store(str(tmp_path))
    size = 2 << 20
    s.put("obj", b"a" * size)
    stop = threading.Event()
    bad: list[str] = []

    def reader() -> None:
        while not stop.is_set():
            data = s.get("obj").data
            if len(data) != size or data.count(data[:1]) != size:
                bad.append(f"torn read: {len(data)} bytes")
                return

    readers = [threading.Thread(target=reader) for _ in range(3)]
    for t in readers:
        t.start()
    try:
        for i in range(40):
            s.put("obj", (b"b" if i % 2 else b"a") * size)
    finally:
        stop.set()
        for t in readers:
            t.join()
    assert bad == []


def test_threads_sharing_one_store_do_not_lose_cas_updates(tmp_path: Path) -> None:
    s = LocalDirStore(tmp_path)
    s.put("n", b"0", mode="create")

    def work() -> None:
        for _ in range(50):
            while True:
                r = s.get("n")
                try:
                    s.put("n", str(int(r.data) + 1).encode(), mode=IfMatch(r.etag))
                    break
                except errors.ConflictError:
                    continue

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert s.get("n").data == b"200"


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (errno.EACCES, errors.AccessDeniedError),
        (errno.EROFS, errors.AccessDeniedError),
        (errno.ENOTDIR, errors.PermanentStoreError),
        (errno.ENOSPC, errors.TransientStoreError),
        (errno.EIO, errors.TransientStoreError),
    ],
)
def test_local_os_errors_are_classified_permanent_or_transient(
    code: int, expected: type[Exception]
) -> None:
    # run as root here, so permission bits cannot produce EACCES: the mapping is unit-tested
    e = os_error(OSError(code, os.strerror(code)), "cannot write data/x")
    assert isinstance(e, expected)
    assert "cannot write data/x" in str(e)


def _count_hashes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count every content hash the store computes (over how many bytes)."""
    from tieredbuf.store import localdir

    real = localdir._hasher
    calls: list[int] = []

    class Counting:
        def __init__(self, data: bytes = b"") -> None:
            self._h = real(data)
            calls.append(len(data))

        def update(self, data: bytes | memoryview) -> None:
            self._h.update(data)

        def hexdigest(self) -> str:
            return self._h.hexdigest()

    monkeypatch.setattr(localdir, "_hasher", Counting)
    return calls


def test_a_cas_hashes_the_content_once_when_it_writes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = LocalDirStore(tmp_path)
    e1 = s.put("queue/manifest", b"v1" * 1000, mode="create")
    hashes = _count_hashes(monkeypatch)
    got = s.get("queue/manifest")
    assert got.etag == e1  # read back from the xattr
    e2 = s.put("queue/manifest", b"v2" * 1000, mode=IfMatch(got.etag))
    assert hashes == [0]  # the new content's hash, computed while it was written
    assert e2 == hashlib.blake2b(b"v2" * 1000, digest_size=16).hexdigest()
    assert s.head("queue/manifest").etag == e2 and hashes == [0]
    with pytest.raises(errors.PreconditionFailedError):
        s.put("queue/manifest", b"v3", mode=IfMatch(e1))  # the compare reads the xattr
    assert len(hashes) == 2  # only v3's own hash (its temp file), never the current one


def test_the_kept_etag_survives_a_reopen_and_a_crash_in_between(tmp_path: Path) -> None:
    s = LocalDirStore(tmp_path)
    e = s.put("k", b"payload", mode="create")
    s.close()
    raw = os.getxattr(tmp_path / "k", "user.tieredbuf.etag").decode()
    assert raw.startswith(e + ":")
    again = LocalDirStore(tmp_path)
    assert again.get("k").etag == e == again.head("k").etag
    assert again.put("k", b"next", mode=IfMatch(e)) != e


def test_bytes_changed_behind_the_stores_back_are_hashed_not_trusted(tmp_path: Path) -> None:
    s = LocalDirStore(tmp_path)
    e = s.put("k", b"aaaa", mode="create")
    path = tmp_path / "k"
    path.chmod(0o644)
    with open(path, "r+b") as f:  # same size, new bytes, the xattr left as it was
        f.write(b"bbbb")
    later = time.time() + 5  # a coarse clock tick could leave mtime as it was
    os.utime(path, (later, later))
    want = hashlib.blake2b(b"bbbb", digest_size=16).hexdigest()
    assert s.head("k").etag == want == s.get("k").etag != e
    with pytest.raises(errors.PreconditionFailedError):
        s.put("k", b"c", mode=IfMatch(e))  # the stale token no longer wins a CAS


def test_an_object_without_the_xattr_reads_the_same_etag_by_hashing(tmp_path: Path) -> None:
    s = LocalDirStore(tmp_path)
    e = s.put("k", b"payload", mode="create")
    os.removexattr(tmp_path / "k", "user.tieredbuf.etag")  # e.g. copied by a tool that drops it
    assert s.get("k").etag == e == s.head("k").etag
    assert s.put("k", b"next", mode=IfMatch(e)) != e


def test_a_filesystem_without_xattrs_falls_back_to_hashing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOTSUP, "Operation not supported")

    monkeypatch.setattr(os, "setxattr", refuse)
    s = LocalDirStore(tmp_path)
    e = s.put("k", b"payload", mode="create")
    assert e == hashlib.blake2b(b"payload", digest_size=16).hexdigest()
    assert s.get("k").etag == e == s.head("k").etag
    assert s.put("k", b"next", mode=IfMatch(e)) != e
