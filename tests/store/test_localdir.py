"""Local-directory backend specifics beyond the contract: atomic visibility, temp files,
content-hash etags, reserved names."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tieredbuf import errors
from tieredbuf.store import IfMatch, LocalDirStore, localdir, open_store
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


def test_temp_files_and_lock_never_show_and_stale_temps_are_reaped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = LocalDirStore(tmp_path)
    s.put("d/x", b"1")
    tmp = tmp_path / "d" / f"{TEMP_PREFIX}crashed"
    tmp.write_bytes(b"partial")
    born = time.time()
    assert (tmp_path / LOCK_NAME).exists()
    # (a file's ctime cannot be set back, so the clock list() reads moves forward)
    monkeypatch.setattr(localdir, "_clock", lambda: born + TEMP_MAX_AGE.total_seconds() - 60)
    assert [m.key for m in s.list("")] == ["d/x"]
    assert tmp.exists()  # a live writer's temp file is left alone
    monkeypatch.setattr(localdir, "_clock", lambda: born + TEMP_MAX_AGE.total_seconds() + 60)
    assert [m.key for m in s.list("")] == ["d/x"]
    assert not tmp.exists()  # a crashed writer's is reaped


def test_a_temp_name_just_linked_to_an_old_file_is_not_reaped(tmp_path: Path) -> None:
    """put_link gives a sealed segment -- perhaps written hours ago -- a temp name in the
    store: its mtime is old, but the link is new (ctime), so list() leaves it alone."""
    s = LocalDirStore(tmp_path / "store")
    s.put("d/x", b"1")
    old_file = tmp_path / "segment"
    old_file.write_bytes(b"sealed long ago")
    old = time.time() - TEMP_MAX_AGE.total_seconds() - 3600
    os.utime(old_file, (old, old))
    tmp = tmp_path / "store" / "d" / f"{TEMP_PREFIX}linked"
    os.link(old_file, tmp)
    assert tmp.stat().st_mtime < old + 1
    assert [m.key for m in s.list("")] == ["d/x"]
    assert tmp.exists()


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

    def check() -> str | None:
        data = s.get("obj").data
        return None if len(data) == size and data.count(data[:1]) == size else "torn read"

    assert _overwrite_while_reading(s, size, check, readers=3, writes=40) == []


def _overwrite_while_reading(
    s: Any, size: int, check: Callable[[], str | None], readers: int, writes: int
) -> list[str]:
    """Overwrite ``obj`` ``writes`` times with ``size`` bytes of a or b in turn while
    ``readers`` threads run ``check`` (a complaint, or None) until the writes are done;
    returns the complaints (each reader stops at its first)."""
    s.put("obj", b"a" * size)
    stop = threading.Event()
    bad: list[str] = []

    def reader() -> None:
        while not stop.is_set():
            if (complaint := check()) is not None:
                bad.append(complaint)
                return

    threads = [threading.Thread(target=reader) for _ in range(readers)]
    for t in threads:
        t.start()
    try:
        for i in range(writes):
            s.put("obj", (b"b" if i % 2 else b"a") * size)
    finally:
        stop.set()
        for t in threads:
            t.join()
    return bad


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


# --- put_link: an object as a hard link of a durable local file (the local tier) -------


def _sealed_file(tmp_path: Path, data: bytes) -> Path:
    p = tmp_path / "segments" / "s.batch"
    p.parent.mkdir(exist_ok=True)
    p.write_bytes(data)
    p.chmod(0o440)
    return p


def test_put_link_makes_the_object_a_second_name_of_the_file(tmp_path: Path) -> None:
    s = LocalDirStore(tmp_path / "store")
    src = _sealed_file(tmp_path, b"segment bytes")
    s.put_link("data/a.batch", lambda tmp: os.link(src, tmp))
    obj = tmp_path / "store" / "data" / "a.batch"
    assert s.get("data/a.batch").data == b"segment bytes"
    assert obj.stat().st_ino == src.stat().st_ino and src.stat().st_nlink == 2
    assert sorted(os.listdir(obj.parent)) == ["a.batch"]  # no temp name left
    assert [m.key for m in s.list("data/")] == ["data/a.batch"]
    # the store leaves the stage's inode alone (no kept etag): the etag is hashed
    assert "user.tieredbuf.etag" not in os.listxattr(src)
    want = hashlib.blake2b(b"segment bytes", digest_size=16).hexdigest()
    assert s.head("data/a.batch").etag == want == s.get("data/a.batch").etag


def test_put_link_is_create_if_absent(tmp_path: Path) -> None:
    s = LocalDirStore(tmp_path / "store")
    s.put("data/a.batch", b"first", mode="create")
    src = _sealed_file(tmp_path, b"second")
    with pytest.raises(errors.AlreadyExistsError):
        s.put_link("data/a.batch", lambda tmp: os.link(src, tmp))
    assert s.get("data/a.batch").data == b"first"
    assert src.stat().st_nlink == 1  # the temp name is gone again
    assert sorted(os.listdir(tmp_path / "store" / "data")) == ["a.batch"]


def test_put_link_passes_the_links_own_error_through_and_creates_nothing(
    tmp_path: Path,
) -> None:
    """EXDEV (the file is on another file system) reaches the caller as the OSError it
    is -- the exporter then uploads the bytes -- and no object or temp name is left."""
    s = LocalDirStore(tmp_path / "store")

    def cross_device(tmp: str) -> None:
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), tmp)

    with pytest.raises(OSError) as e:
        s.put_link("data/a.batch", cross_device)
    assert e.value.errno == errno.EXDEV and not isinstance(e.value, errors.TieredBufError)
    with pytest.raises(errors.ObjectNotFoundError):
        s.head("data/a.batch")
    assert os.listdir(tmp_path / "store" / "data") == []


def test_get_if_changed_of_an_unchanged_object_reads_and_hashes_no_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watcher's poll: the kept etag (one fgetxattr) answers it, as a 304 would."""
    s = LocalDirStore(tmp_path)
    e1 = s.put("queue/manifest", b"root" * 10_000, mode="create")
    hashes = _count_hashes(monkeypatch)
    opened: list[int] = []
    real_fdopen = os.fdopen

    def fdopen(fd: int, *a: object, **k: object) -> object:
        opened.append(fd)
        return real_fdopen(fd, *a, **k)  # type: ignore[call-overload]

    monkeypatch.setattr(os, "fdopen", fdopen)
    assert s.get_if_changed("queue/manifest", e1) is None
    assert (hashes, opened) == ([], [])
    e2 = s.put("queue/manifest", b"root v2", mode=IfMatch(e1))
    hashes.clear()
    r = s.get_if_changed("queue/manifest", e1)
    assert r is not None and (r.data, r.etag) == (b"root v2", e2)
    assert hashes == [] and len(opened) == 1  # the bytes read once, the etag kept


def test_get_if_changed_sees_bytes_changed_behind_the_stores_back(tmp_path: Path) -> None:
    """A kept etag that no longer describes the file is not trusted: the poll hashes the
    bytes and reports the change (a stale "unchanged" would hide new commits)."""
    s = LocalDirStore(tmp_path)
    e = s.put("k", b"aaaa", mode="create")
    path = tmp_path / "k"
    with open(path, "r+b") as f:  # same size, new bytes, the xattr left as it was
        f.write(b"bbbb")
    later = time.time() + 5  # a coarse clock tick could leave mtime as it was
    os.utime(path, (later, later))
    r = s.get_if_changed("k", e)
    assert r is not None
    assert (r.data, r.etag) == (b"bbbb", hashlib.blake2b(b"bbbb", digest_size=16).hexdigest())
    assert s.get_if_changed("k", r.etag) is None


@pytest.mark.parametrize("xattr", [True, False], ids=["kept-etag", "hashed-etag"])
def test_get_if_changed_answers_bytes_and_etag_of_one_version(tmp_path: Path, xattr: bool) -> None:
    """Overwrites alternate two 1 MiB objects while readers poll with a third etag:
    every answer is one whole version with that version's own etag, never a mix."""
    s = LocalDirStore(tmp_path, etag_xattr=xattr)
    size = 1 << 20
    etag_of = {c: hashlib.blake2b(c * size, digest_size=16).hexdigest() for c in (b"a", b"b")}

    def check() -> str | None:
        r = s.get_if_changed("obj", "0" * 32)
        if r is None or len(r.data) != size or r.data.count(r.data[:1]) != size:
            return f"torn or missing read: {r!r}"
        if r.etag != etag_of[r.data[:1]]:
            return f"etag {r.etag} is not that of {r.data[:1]!r}"
        return None

    assert _overwrite_while_reading(s, size, check, readers=2, writes=30) == []


def test_a_create_does_not_wait_for_the_lock_a_conditional_replace_takes(
    tmp_path: Path,
) -> None:
    """A create-if-absent is one atomic link(2): it needs no lock.  It used to take the
    store-wide lock, and with 16 processes uploading data objects a root CAS queued
    behind their directory fsyncs (0.11 s on average, 0.5 s at worst, in the cost
    benchmark's 100 B rows): every process that read the root meanwhile saw a free
    commit lease and raced for it.  A holder of the lock elsewhere (another open file
    description: another process) holds up a replace-if-match, not a create."""
    s = LocalDirStore(tmp_path)
    etag = s.put("root", b"1")  # makes the lock file
    fd = os.open(tmp_path / LOCK_NAME, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    created, replaced = threading.Event(), threading.Event()

    def create() -> None:
        s.put("data/x", b"d", mode="create")
        created.set()

    def replace() -> None:
        s.put("root", b"2", mode=IfMatch(etag))
        replaced.set()

    writers = [threading.Thread(target=create), threading.Thread(target=replace)]
    try:
        for t in writers:
            t.start()
        assert created.wait(30), "a create waited for the lock"
        assert not replaced.wait(0.3), "a replace-if-match ignored the lock"
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    for t in writers:
        t.join(timeout=30)
    assert replaced.is_set() and s.get("root").data == b"2" and s.get("data/x").data == b"d"


class _DirFsyncs:
    """Every directory fsync the store sends, the first of each path in ``fail``
    refused with EIO.  A power cut cannot run on real files; what it would take (a
    directory entry or a link no completed fsync covered) is judged on the simulated
    disk by tests/stage/test_power_cut.py, and here by which fsyncs run again."""

    def __init__(self, fail: set[str]) -> None:
        self.calls: list[str] = []
        self.fail = fail

    def __call__(self, path: str) -> None:
        self.calls.append(str(path))
        if str(path) in self.fail:
            self.fail.discard(str(path))
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))


def test_I1_a_directory_whose_new_entry_was_not_fsynced_is_fsynced_before_it_takes_an_object(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``data/`` made, the fsync of its parent refused: the next put found the
    directory and trusted it, so a power cut could take it and every object fsynced
    into it since.  A directory the store did not itself make durable gets its parent
    fsynced once, on its first use -- also one an earlier process made."""
    root = str(tmp_path / "store")
    s = LocalDirStore(root)
    s.put("queue/manifest", b"m")  # the root exists
    fsyncs = _DirFsyncs({root})
    monkeypatch.setattr(localdir, "fsync_dir", fsyncs)
    with pytest.raises(errors.StoreError):
        s.put("data/a.batch", b"a", mode="create")
    assert os.path.isdir(os.path.join(root, "data"))  # made, its entry not durable
    s.put("data/b.batch", b"b", mode="create")
    assert fsyncs.calls.count(root) == 2  # refused, then again before b went in
    s.put("data/c.batch", b"c", mode="create")
    assert fsyncs.calls.count(root) == 2  # once made durable, trusted
    fresh = LocalDirStore(root)  # another process finds data/ there
    fresh.put("data/d.batch", b"d", mode="create")
    assert fsyncs.calls.count(root) == 3


@pytest.mark.parametrize("how", ["put", "put_link"])
def test_I1_a_create_that_finds_its_key_makes_it_durable_before_answering_already_exists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """The link landed, the directory fsync was refused (OutcomeUnknownError); the
    retry's create finds the key, and the exporter takes AlreadyExistsError for "my
    earlier attempt landed" and appends it.  So the answer comes only after the
    directory fsync that the first attempt never completed."""
    root = tmp_path / "store"
    s = LocalDirStore(root)
    s.put("data/old.batch", b"o", mode="create")  # data/ exists and is durable
    src = _sealed_file(tmp_path, b"segment bytes")
    data_dir = str(root / "data")
    fsyncs = _DirFsyncs({data_dir})
    monkeypatch.setattr(localdir, "fsync_dir", fsyncs)

    def create() -> None:
        if how == "put":
            s.put("data/a.batch", b"segment bytes", mode="create")
        else:
            s.put_link("data/a.batch", lambda tmp: os.link(src, tmp))

    with pytest.raises(errors.OutcomeUnknownError):
        create()
    with pytest.raises(errors.AlreadyExistsError):
        create()
    assert fsyncs.calls.count(data_dir) == 2 and not fsyncs.fail


def test_I1_every_folder_made_on_the_way_to_the_root_has_a_durable_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``os.makedirs`` made ``a/b/store`` and only ``a/b`` was fsynced: a power cut could
    take ``a`` with the whole store in it."""
    fsyncs = _DirFsyncs(set())
    monkeypatch.setattr(localdir, "fsync_dir", fsyncs)
    root = tmp_path / "a" / "b" / "store"
    LocalDirStore(root).put("queue/manifest", b"m")
    assert [c for c in fsyncs.calls if not c.startswith(str(root))] == [
        str(tmp_path),
        str(tmp_path / "a"),
        str(tmp_path / "a" / "b"),
    ]


@pytest.mark.parametrize(("err", "passed_over"), [(errno.EROFS, True), (errno.EACCES, False)])
def test_I1_a_refused_fsync_above_a_found_root_is_passed_over_only_where_we_changed_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int, passed_over: bool
) -> None:
    """A root found there (an earlier process made it, and may have died before the
    fsync of its parent) has that parent fsynced.  Read-only: nothing there can be ours
    to make durable.  EACCES on a parent this process may write to: it may have made
    the root there itself, so the refusal is an error, not a pass."""
    root = tmp_path / "store"
    root.mkdir()

    def refuse(path: str) -> None:
        if str(path) == str(tmp_path):
            raise OSError(err, os.strerror(err), str(path))

    monkeypatch.setattr(localdir, "fsync_dir", refuse)
    s = LocalDirStore(root)
    if passed_over:
        s.put("queue/manifest", b"m")
        assert s.get("queue/manifest").data == b"m"
    else:
        with pytest.raises(errors.StoreError):
            s.put("queue/manifest", b"m")
