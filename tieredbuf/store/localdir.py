"""The Store contract on a local (or shared POSIX) directory, in plain Python.

Not obstore's LocalStore: it cannot replace-if-match (no compare-and-swap) and
acknowledges a write from the page cache, without fsync.  Here:

* a key ``a/b/c`` is the file ``<root>/a/b/c``; parents are created and fsynced;
* every write goes to a temp file ``.tieredbuf-tmp-*`` in the target's directory,
  which is fsynced, then moved into place (``os.link`` for create, so it never replaces;
  ``os.replace`` otherwise) and the directory fsynced: a reader sees the old object or
  the whole new one, never a part, and an acknowledged write survives a crash;
* every replace (overwrite, replace-if-match) and delete holds ``<root>/.tieredbuf.lock``
  (``fcntl.flock``), so conditional writes are atomic across threads and processes
  sharing the directory; only the move happens under the lock, the data is written and
  fsynced before.  A create-if-absent is one ``link(2)``, atomic by itself, and takes
  no lock (with 16 processes uploading, a root CAS queued behind their directory
  fsyncs when creates took it); where the filesystem refuses hard links it checks and
  renames under the lock;
* the etag is a content hash (blake2b, 16 bytes, hex): it survives restarts, does not
  depend on mtime or inode numbers (inodes are reused), and -- like an S3 single-part
  etag -- names the content, so an ABA rewrite of identical bytes matches.  It is
  computed once, while the object is written, and kept with the file in the extended
  attribute ``user.tieredbuf.etag`` (``<digest>:<size>:<mtime_ns>``, set on the temp
  file before its fsync and rename), so reading it back -- a CAS's compare, a ``get``,
  a ``head`` -- costs one ``fgetxattr``, not a pass over the bytes, and a
  ``get_if_changed`` of an unchanged object reads no byte of it.  Where the
  attribute is missing (a filesystem without user xattrs, a copy that dropped it, a
  store written by an older tieredbuf) or does not match the file's size and mtime
  (bytes changed in place behind the store's back) the content is hashed instead,
  which gives the same value;
* ``put_link`` creates an object as a hard link of a durable, immutable local file (the
  local tier's sealed segments, on the same file system): no byte is copied, and the
  commit is the same create-if-absent link and directory fsync.  Such an object has no
  kept etag (its inode is the stage's read-only segment, which the store leaves alone):
  its etag is hashed when asked, as for a file without the attribute;
* ``list()`` never shows temp files or the lock, and removes temp files left by a
  crashed writer once they are older than ``TEMP_MAX_AGE`` (by ctime); ``list()`` reports
  ``etag=None`` (computing it would read every object; ``head()`` has it).
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import fcntl
import hashlib
import os
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from datetime import UTC, datetime, timedelta
from pathlib import Path

from tieredbuf.errors import (
    AlreadyExistsError,
    InvalidKeyError,
    ObjectNotFoundError,
    OutcomeUnknownError,
    PermanentStoreError,
    PreconditionFailedError,
    StoreError,
)
from tieredbuf.runtime.fsutil import fsync_dir, may_pass_over
from tieredbuf.store import xattrs
from tieredbuf.store._common import check_key, check_prefix, check_range, os_error, prefix_dir
from tieredbuf.store.base import GetResult, IfMatch, ObjectMeta, PutMode, Stored

RESERVED_PREFIX = ".tieredbuf"
LOCK_NAME = ".tieredbuf.lock"
TEMP_PREFIX = ".tieredbuf-tmp-"
TEMP_MAX_AGE = timedelta(hours=1)
_READ_CHUNK = 1 << 20
_clock = time.time
"""What ``list()`` measures temp files' age against (tests move it)."""
_NOT_FOUND_ERRNOS = (errno.ENOENT, errno.ENOTDIR, errno.EISDIR)


def _hasher(data: bytes = b"") -> hashlib.blake2b:
    return hashlib.blake2b(data, digest_size=16)


class LocalDirStore:
    """A Store rooted at a directory; safe for concurrent processes on one machine."""

    def __init__(
        self, root: str | os.PathLike[str], *, url: str | None = None, etag_xattr: bool = True
    ) -> None:
        """``etag_xattr=False``: never keep etags in extended attributes (hash the content
        on every read of an etag, as on a filesystem without user xattrs)."""
        self._xattr = etag_xattr and hasattr(os, "setxattr")
        self._root = str(Path(root).absolute())
        self._url = url or Path(self._root).as_uri()
        # the root is made by the first write, not by opening: reading a mistyped URL
        # must leave no directory behind
        self._tlock = threading.Lock()
        self._durable_dirs: set[str] = set()
        """Directories under the root whose entries this store made durable."""
        self._lock_fd = -1
        self._lock_pid = -1

    @property
    def url(self) -> str:
        return self._url

    @property
    def root(self) -> str:
        return self._root

    def __repr__(self) -> str:
        return f"LocalDirStore({self._root!r})"

    # --- paths and locking ------------------------------------------------------------

    def _path(self, key: str) -> str:
        check_key(key)
        if any(part.startswith(RESERVED_PREFIX) for part in key.split("/")):
            raise InvalidKeyError(f"invalid object key {key!r}: {RESERVED_PREFIX}* is reserved")
        return os.path.join(self._root, *key.split("/"))

    def _ensure_root(self) -> None:
        """The root, with a durable entry (as :meth:`_ensure_dir`): every folder made on
        the way to it has its parent fsynced; a root found there has its parent fsynced
        once, unless this process could not have changed that (``may_pass_over``)."""
        if self._root in self._durable_dirs and os.path.isdir(self._root):
            return
        try:
            missing = []
            at = self._root
            while not os.path.isdir(at) and os.path.dirname(at) != at:
                missing.append(at)
                at = os.path.dirname(at)
            for d in reversed(missing):
                with contextlib.suppress(FileExistsError):  # a racer's: fsynced below too
                    os.mkdir(d)
                fsync_dir(os.path.dirname(d))
            if not missing:
                try:
                    fsync_dir(os.path.dirname(self._root))
                except OSError as e:
                    if not may_pass_over(e, os.path.dirname(self._root)):
                        raise
            if not os.path.isdir(self._root):
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), self._root)
            self._durable_dirs.add(self._root)
        except OSError as e:
            if e.errno in (errno.EEXIST, errno.ENOTDIR):  # a file where a directory must be
                raise PermanentStoreError(
                    f"cannot create store directory {self._root}: it (or a folder above it) "
                    f"is a file, not a directory"
                ) from e
            if e.errno in (errno.ENOENT, errno.EROFS, errno.EACCES, errno.EPERM):
                # after makedirs made the parents, ENOENT is a file system that takes no
                # folder there (/proc, /sys): no retry changes that, nor a read-only one
                raise PermanentStoreError(
                    f"cannot create store directory {self._root}: {e.strerror}"
                ) from e
            raise os_error(e, f"cannot create store directory {self._root}") from e

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with self._tlock:
            if self._lock_pid != os.getpid():
                self._ensure_root()
                # first use, or a forked child: a lock fd shared with the parent
                # would share the parent's flock, so open our own.
                try:
                    self._lock_fd = os.open(
                        os.path.join(self._root, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644
                    )
                except OSError as e:
                    raise os_error(e, f"cannot open lock file in {self._root}") from e
                self._lock_pid = os.getpid()
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _ensure_dir(self, dirpath: str) -> None:
        """Create ``dirpath`` (under the root) and its parents, each with a durable
        entry: its parent fsynced after the mkdir, or -- found there, but not made
        durable by this store -- once before its first use.  An earlier mkdir whose
        parent fsync failed, or a process killed between the two, leaves a directory
        that lasts only until the power goes, with every object fsynced into it."""
        if dirpath == self._root:
            self._ensure_root()
            return
        if dirpath in self._durable_dirs and os.path.isdir(dirpath):
            return
        parent = os.path.dirname(dirpath)
        self._ensure_dir(parent)
        try:
            os.mkdir(dirpath)
        except FileExistsError:
            if not os.path.isdir(dirpath):
                raise PermanentStoreError(f"{dirpath} exists and is not a directory") from None
        fsync_dir(parent)
        self._durable_dirs.add(dirpath)

    # --- reads ------------------------------------------------------------------------

    def _open(self, key: str) -> int:
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            if e.errno in _NOT_FOUND_ERRNOS:
                raise ObjectNotFoundError(key) from e
            raise os_error(e, f"cannot open {key}") from e
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise ObjectNotFoundError(key)
        return fd

    def get(self, key: str) -> GetResult:
        fd = self._open(key)
        try:
            with os.fdopen(fd, "rb", closefd=False) as f:
                data = f.read()
            kept = self._kept_etag(fd)  # the same inode as the bytes just read
            crc = self._kept_checksum(fd)
        except OSError as e:
            raise os_error(e, f"cannot read {key}") from e
        finally:
            os.close(fd)
        if kept is not None:
            return GetResult(data, kept, crc)
        return GetResult(data, lambda: _hasher(data).hexdigest(), crc)

    def get_if_changed(self, key: str, etag: str) -> GetResult | None:
        """None while the file's etag is still ``etag``: with a kept etag that costs an
        open, an fstat and an fgetxattr, no read of the bytes (a file without one is read
        and hashed, as ``get`` would).  The etag and the bytes come from one open file,
        so from one version, as in ``get``."""
        fd = self._open(key)
        try:
            kept = self._kept_etag(fd)
            if kept == etag:
                return None
            with os.fdopen(fd, "rb", closefd=False) as f:
                data = f.read()
            kept = self._kept_etag(fd)  # as get: checked after the read
        except OSError as e:
            raise os_error(e, f"cannot read {key}") from e
        finally:
            os.close(fd)
        now = kept if kept is not None else _hasher(data).hexdigest()
        return None if now == etag else GetResult(data, now)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        check_range(start, end)
        fd = self._open(key)
        try:
            return os.pread(fd, end - start, start) if end > start else b""
        except OSError as e:
            raise os_error(e, f"cannot read {key}") from e
        finally:
            os.close(fd)

    def read_into(self, key: str, start: int, out: memoryview) -> Stored:
        """``preadv`` straight into ``out`` (see ReadsInto): no copy of the bytes read."""
        if start < 0:
            raise ValueError(f"invalid range start {start}")
        fd = self._open(key)
        try:
            size = os.fstat(fd).st_size
            at, end = 0, max(0, min(len(out), size - start))
            while at < end:
                n = os.preadv(fd, [out[at:end]], start + at)
                if n == 0:  # the file shrank since the fstat: say what is there now
                    return Stored(start + at)
                at += n
            return Stored(size, self._kept_checksum(fd))
        except OSError as e:
            raise os_error(e, f"cannot read {key}") from e
        finally:
            os.close(fd)

    def get_suffix(self, key: str, length: int) -> bytes:
        if length < 0:
            raise ValueError(f"invalid suffix length {length}")
        fd = self._open(key)
        try:
            size = os.fstat(fd).st_size
            start = max(0, size - length)
            return os.pread(fd, size - start, start) if size > start else b""
        except OSError as e:
            raise os_error(e, f"cannot read {key}") from e
        finally:
            os.close(fd)

    def _kept_etag(self, fd: int, st: os.stat_result | None = None) -> str | None:
        """The etag the file's writer kept in its xattr, if it still describes the file."""
        return xattrs.kept_etag(fd, st) if self._xattr else None

    def _etag_fd(self, fd: int, st: os.stat_result | None = None) -> str:
        kept = self._kept_etag(fd, st)
        if kept is not None:
            return kept
        h = _hasher()
        offset = 0
        while chunk := os.pread(fd, _READ_CHUNK, offset):
            h.update(chunk)
            offset += len(chunk)
        return h.hexdigest()

    def head(self, key: str) -> ObjectMeta:
        fd = self._open(key)
        try:
            st = os.fstat(fd)
            etag = self._etag_fd(fd, st)
        except OSError as e:
            raise os_error(e, f"cannot read {key}") from e
        finally:
            os.close(fd)
        return ObjectMeta(
            key=key,
            size=st.st_size,
            etag=etag,
            last_modified=datetime.fromtimestamp(st.st_mtime, UTC),
        )

    def list(self, prefix: str) -> Iterator[ObjectMeta]:
        check_prefix(prefix)
        base = prefix_dir(prefix)
        start = os.path.join(self._root, *base.rstrip("/").split("/")) if base else self._root
        yield from self._walk(start, base, prefix)

    def _walk(self, dirpath: str, rel: str, prefix: str) -> Iterator[ObjectMeta]:
        try:
            entries = sorted(os.scandir(dirpath), key=lambda d: d.name)
        except FileNotFoundError:
            return
        except NotADirectoryError:
            return
        except OSError as e:
            raise os_error(e, f"cannot list {dirpath}") from e
        now = _clock()
        for entry in entries:
            name = entry.name
            if name.startswith(RESERVED_PREFIX):
                if name.startswith(TEMP_PREFIX):
                    self._reap(entry, now)
                continue
            key = rel + name
            try:
                if entry.is_dir(follow_symlinks=False):
                    if key.startswith(prefix) or prefix.startswith(key + "/"):
                        yield from self._walk(entry.path, key + "/", prefix)
                    continue
                if not key.startswith(prefix) or not entry.is_file(follow_symlinks=False):
                    continue
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # deleted while we looked
            yield ObjectMeta(
                key=key,
                size=st.st_size,
                etag=None,
                last_modified=datetime.fromtimestamp(st.st_mtime, UTC),
            )

    @staticmethod
    def _reap(entry: os.DirEntry[str], now: float) -> None:
        """Remove a temp file a crashed writer left behind (old enough not to be live).
        Its age is its ctime's, which a new link sets: a temp name that put_link just
        gave a segment sealed an hour ago keeps that segment's old mtime."""
        try:
            if now - entry.stat(follow_symlinks=False).st_ctime > TEMP_MAX_AGE.total_seconds():
                os.unlink(entry.path)
        except OSError:
            pass

    # --- writes -----------------------------------------------------------------------

    def _write_temp(
        self, dirpath: str, chunks: Iterable[bytes | memoryview], crc32: int | None = None
    ) -> tuple[str, str]:
        """Write chunks to a fsynced temp file in ``dirpath`` (``crc32`` kept beside them);
        returns (temp path, etag)."""
        self._ensure_dir(dirpath)
        tmp = os.path.join(dirpath, f"{TEMP_PREFIX}{uuid.uuid4().hex}")
        h = _hasher()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            for chunk in chunks:
                view = memoryview(chunk).cast("B")
                h.update(view)
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
            digest = h.hexdigest()
            if self._xattr:
                self._keep_etag(fd, digest)
            self._keep_checksum(fd, crc32)
            os.fsync(fd)  # data, and the attributes with the inode
        except BaseException:
            os.close(fd)
            _unlink_quietly(tmp)
            raise
        os.close(fd)
        return tmp, digest

    def _keep_etag(self, fd: int, digest: str) -> None:
        if not xattrs.keep_etag(fd, digest):
            self._xattr = False  # this filesystem has none: hash on read from now on

    def _keep_checksum(self, file: int | str, crc32: int | None) -> None:
        """Keep a data object's CRC32 with its file (KeepsChecksums); a filesystem without
        user xattrs keeps none, and its readers check sizes only."""
        if crc32 is not None and self._xattr:
            xattrs.keep_checksum(file, crc32)

    def _kept_checksum(self, fd: int) -> int | None:
        return xattrs.kept_checksum(fd) if self._xattr else None

    def _commit(self, key: str, path: str, tmp: str, mode: PutMode) -> None:
        dirpath = os.path.dirname(path)
        if os.path.isdir(path):  # (a directory is never made under the lock either)
            raise PermanentStoreError(f"cannot write {key}: a key prefix of that name exists")
        if mode == "create":
            self._link_new(key, path, tmp)
            _unlink_quietly(tmp)
            _sync_moved(key, dirpath)
            return
        with self._locked():
            if isinstance(mode, IfMatch):
                try:
                    fd = os.open(path, os.O_RDONLY)
                except FileNotFoundError as e:
                    raise ObjectNotFoundError(key, f"replace-if-match on missing {key}") from e
                try:
                    current = self._etag_fd(fd)
                finally:
                    os.close(fd)
                if current != mode.etag:
                    raise PreconditionFailedError(
                        key, f"{key} is at etag {current}, expected {mode.etag}"
                    )
                os.replace(tmp, path)
            elif mode == "overwrite":
                os.replace(tmp, path)
            else:
                raise ValueError(f"unknown put mode {mode!r}")
            _sync_moved(key, dirpath)

    def _link_new(self, key: str, path: str, tmp: str) -> None:
        try:
            os.link(tmp, path)
        except FileExistsError as e:
            _found_durable(key, os.path.dirname(path))
            raise AlreadyExistsError(key) from e
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK):
                raise
            # no hard links on this filesystem: check-then-rename, atomic under our lock
            with self._locked():
                if os.path.lexists(path):
                    _found_durable(key, os.path.dirname(path))
                    raise AlreadyExistsError(key) from e
                os.replace(tmp, path)

    def _put_chunks(
        self,
        key: str,
        chunks: Iterable[bytes | memoryview],
        mode: PutMode,
        crc32: int | None = None,
    ) -> str:
        path = self._path(key)
        if not (mode in ("create", "overwrite") or isinstance(mode, IfMatch)):
            raise ValueError(f"unknown put mode {mode!r}")
        tmp = ""
        try:
            tmp, etag = self._write_temp(os.path.dirname(path), chunks, crc32)
            self._commit(key, path, tmp, mode)
        except (StoreError, ValueError):
            raise
        except OSError as e:
            raise os_error(e, f"cannot write {key}") from e
        finally:
            if tmp:
                _unlink_quietly(tmp)
        return etag

    def put_link(self, key: str, link: Callable[[str], None], *, crc32: int | None = None) -> None:
        """Create ``key`` (create-if-absent, AlreadyExistsError) as a hard link of a file
        on this file system, without copying a byte: ``link(tmp)`` must create the temp
        path ``tmp`` (in the key's directory) as a second name of a file whose bytes
        are already durable (fsynced) and never change again -- the local tier's
        sealed, read-only segments (Stage.link_segment).  Then the usual commit: the
        create-if-absent link of the temp name to the key and the directory fsync, so
        a reader sees the whole object or none, and once this returns it survives a
        power cut.  An OSError raised by ``link`` itself (EXDEV: the file lives on
        another file system; EPERM, EMLINK: no more links) propagates unchanged, and no
        object is created: the caller uploads the bytes instead.  ``crc32`` is kept with
        the file (KeepsChecksums: the one inode the stage's file and the object share)."""
        path = self._path(key)
        dirpath = os.path.dirname(path)
        try:
            self._ensure_dir(dirpath)
        except OSError as e:
            raise os_error(e, f"cannot write {key}") from e
        tmp = os.path.join(dirpath, f"{TEMP_PREFIX}{uuid.uuid4().hex}")
        link(tmp)  # the caller's OSError: no temp name was made
        try:
            self._keep_checksum(tmp, crc32)
            self._commit(key, path, tmp, "create")
        except (StoreError, ValueError):
            raise
        except OSError as e:
            raise os_error(e, f"cannot write {key}") from e
        finally:
            _unlink_quietly(tmp)

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = "overwrite") -> str:
        return self._put_chunks(key, (data,), mode)

    def put_checksummed(
        self, key: str, data: bytes | memoryview, crc32: int, *, mode: PutMode = "create"
    ) -> str:
        return self._put_chunks(key, (data,), mode, crc32)

    def put_multipart(
        self, key: str, chunks: Iterable[bytes | memoryview], *, mode: PutMode = "create"
    ) -> str:
        return self._put_chunks(key, chunks, mode)

    def copy(self, src: str, dst: str) -> None:
        """A hard link (objects are immutable), or a byte copy where links are refused;
        create-if-absent, the directory fsynced."""
        spath, dpath = self._path(src), self._path(dst)
        if not os.path.isfile(spath):
            raise ObjectNotFoundError(src)
        self._ensure_dir(os.path.dirname(dpath))
        try:
            with self._locked():
                if os.path.lexists(dpath):
                    _found_durable(dst, os.path.dirname(dpath))
                    raise AlreadyExistsError(dst)
                os.link(spath, dpath)
                fsync_dir(os.path.dirname(dpath))
            return
        except FileNotFoundError as e:
            raise ObjectNotFoundError(src) from e
        except OSError as e:
            if e.errno not in (
                errno.EPERM,
                errno.EOPNOTSUPP,
                errno.ENOTSUP,
                errno.EMLINK,
                errno.EXDEV,
            ):
                raise os_error(e, f"cannot copy {src} to {dst}") from e
        got = self.get(src)
        self._put_chunks(dst, (got.data,), "create", got.crc32)

    def delete_many(self, keys: Sequence[str]) -> builtins.list[tuple[str, Exception]]:
        paths = [(k, self._path(k)) for k in keys]
        failures: builtins.list[tuple[str, Exception]] = []
        dirs: set[str] = set()
        with self._locked():
            for key, path in paths:
                try:
                    os.unlink(path)
                    dirs.add(os.path.dirname(path))
                except FileNotFoundError:
                    continue
                except OSError as e:
                    if e.errno == errno.ENOTDIR:
                        continue
                    failures.append((key, os_error(e, f"cannot delete {key}")))
            for d in dirs:
                try:
                    fsync_dir(d)
                except OSError as e:
                    failures.extend(
                        (k, os_error(e, f"cannot fsync {d} after deleting {k}"))
                        for k, p in paths
                        if os.path.dirname(p) == d
                    )
        return failures

    def close(self) -> None:
        with self._tlock:
            if self._lock_fd >= 0 and self._lock_pid == os.getpid():
                os.close(self._lock_fd)
            self._lock_fd = -1
            self._lock_pid = -1


def _found_durable(key: str, dirpath: str) -> None:
    """Before a create answers AlreadyExistsError: the object found may be this
    writer's own earlier attempt whose directory fsync failed (OutcomeUnknownError), and
    the caller takes the answer for "it landed" -- so it must have landed for good."""
    _sync_moved(key, dirpath)


def _sync_moved(key: str, dirpath: str) -> None:
    """fsync the directory ``key`` was just moved into: until then a crash may undo it."""
    try:
        fsync_dir(dirpath)
    except OSError as e:
        raise OutcomeUnknownError(
            f"{key} was moved into place but its directory could not be fsynced: {e}"
        ) from e


def _unlink_quietly(path: str) -> None:
    with suppress(OSError):
        os.unlink(path)
