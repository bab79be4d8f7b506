"""Every operating-system call the stage makes, in one place: the durable-file helpers
(the only place the stage spells out fsync ordering) and the primitives under them.

The stage never calls ``os`` or ``Path`` I/O directly.  Each stage component
(``Stage``, ``WalWriter``, ``SegmentDir``) takes a :class:`FileSystem` when it is built
(``current()`` by default: the real one) and calls only it.  A test can put a simulated
file layer there (``tests/stage/simfs.py``: power cuts that keep only what an fsync
covered, injected ENOSPC / EIO) and run the real stage code on it; a component keeps the
layer it was built with, so threads of a stage abandoned after a simulated power cut can
never touch the next one's files.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa

from tieredbuf import keys
from tieredbuf.errors import DiskError, DiskFullError, DiskIOError
from tieredbuf.runtime.fsutil import may_pass_over

__all__ = [
    "FileSystem",
    "IoGate",
    "current",
    "disk_error",
    "fsync_dir",
    "installed",
    "read_if_exists",
    "write_all",
    "write_atomic",
    "write_durable",
    "zero_file",
]

Buffers = Iterable[bytes | memoryview | pa.Buffer]

try:
    _IOV_MAX = max(1, min(os.sysconf("SC_IOV_MAX"), 1024))
except (AttributeError, ValueError, OSError):
    _IOV_MAX = 16


def _libc(name: str, argtypes: list[Any]) -> Callable[..., None] | None:
    """The libc function ``name`` (None where it does not exist), raising OSError
    with errno when it returns non-zero."""
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int

    def call(*args: int) -> None:
        if fn(*args) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    return call


WRITE_CHUNK = 1 << 20
"""Bytes per ``writev`` at most (a part larger than this is cut into views).  On this
project's test host (ext4, kernel 6.18, a VM) one 32 MiB ``writev`` into fresh
page-cache pages took 60-85 ms of system time, the same bytes in writes of <= 1.6 MiB
10-16 ms (docs/architecture.md); the WAL's entries are far below it."""
_SYNC_FILE_RANGE_FLAGS = 1 | 2 | 4  # WAIT_BEFORE | WRITE | WAIT_AFTER
_sync_file_range = _libc(
    "sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
)
_FALLOC_FL_ZERO_RANGE = 0x10
OWNER_ONLY = 0o700
"""The only permission bits a stage file or directory gets, whatever mode the stage
code asks for: staged records are their owner's alone (files 0600, sealed segments
0400, directories 0700).  A local-directory store linked to a sealed segment shares
its inode, so such objects are 0400 too."""
_fallocate = _libc("fallocate", [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64])


class FileSystem:
    """The real operating system.

    Primitives are the ``os`` functions themselves (no extra Python frame on the
    append path), but for those that set permission bits: they keep only
    :data:`OWNER_ONLY`'s.  The compound helpers below are written on the primitives
    only, so a simulated layer that overrides the primitives runs the stage's real
    ordering of writes, fdatasyncs, renames and directory fsyncs.
    """

    def __init__(self) -> None:
        self.durable_dirs: set[Path] = set()
        """The directories :meth:`makedirs` made sure have a durable entry."""

    close = staticmethod(os.close)
    writev = staticmethod(os.writev)
    fdatasync = staticmethod(os.fdatasync)
    fsync = staticmethod(os.fsync)
    ftruncate = staticmethod(os.ftruncate)
    lseek = staticmethod(os.lseek)
    rename = staticmethod(os.rename)

    def open(self, path: str | os.PathLike[str], flags: int, mode: int = 0o600) -> int:
        """``os.open``; a file it creates gets ``mode``'s owner bits only."""
        return os.open(path, flags, mode & OWNER_ONLY)

    def fchmod(self, fd: int, mode: int) -> None:
        os.fchmod(fd, mode & OWNER_ONLY)

    def chmod(self, path: str | os.PathLike[str], mode: int) -> None:
        os.chmod(path, mode & OWNER_ONLY)

    def keep_checksum(self, fd: int, crc32: int) -> None:
        """Keep a sealed ``.batch`` segment's CRC32 in the file's extended attribute
        ``user.tieredbuf.crc32`` (its sidecar keeps it too): a local-directory store that
        takes the file as a hard link then has it beside the object (the same inode).
        Set while the file is still writable; best effort -- a filesystem without user
        xattrs keeps none, and the object then carries none."""
        with contextlib.suppress(OSError):
            os.setxattr(fd, keys.CHECKSUM_XATTR, keys.format_crc32(crc32).encode())

    link = staticmethod(os.link)
    """A second name for a file (``os.link``): the exporter links a sealed segment into a
    local-directory store on the same file system instead of copying its bytes."""

    def unlink(self, path: Path, missing_ok: bool = False) -> None:
        path.unlink(missing_ok=missing_ok)

    def link_count(self, path: Path) -> int:
        """How many names the file at ``path`` has (``st_nlink``): more than one means
        another name (a store object) shares its bytes, so they must never change."""
        return os.stat(path).st_nlink

    def mkdir(self, path: Path) -> bool:
        """Create one directory (0700); False if it already exists."""
        try:
            path.mkdir(mode=OWNER_ONLY)
        except FileExistsError:
            if not path.is_dir():
                raise
            return False
        return True

    def listdir(self, path: Path) -> list[str]:
        return os.listdir(path)

    def exists(self, path: Path) -> bool:
        return path.exists()

    def file_size(self, path: Path) -> int:
        return path.stat().st_size

    def read_bytes(self, path: Path) -> bytes:
        return path.read_bytes()

    @contextlib.contextmanager
    def read_view(self, path: Path) -> Iterator[bytes | memoryview]:
        """A file's bytes without reading them into this process's memory: a read-only
        map of its page-cache pages (b"" for an empty file), valid inside the ``with``
        only (a 32 MiB segment read into fresh memory costs a copy and the zeroing of
        8,192 new pages; a map costs neither)."""
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                yield b""
                return
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m, memoryview(m) as v:
                yield v

    def lock(self, path: Path) -> int:
        """Open ``path`` and take an exclusive ``flock`` on it (BlockingIOError if
        another open file description holds it); returns the fd."""
        import fcntl

        fd = self.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException:
            os.close(fd)
            raise
        return fd

    @property
    def can_write_back(self) -> bool:
        return _sync_file_range is not None

    def write_back(self, fd: int, offset: int, length: int) -> None:
        """Start writing ``fd``'s dirty pages [offset, offset + length) to the disk and
        wait for it (``sync_file_range``).  NOT a durability barrier: no metadata, no
        disk cache flush; only an fdatasync/fsync makes bytes durable."""
        if _sync_file_range is not None:
            _sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_FLAGS)

    def drop_cache(self, fd: int) -> None:
        """Evict ``fd``'s clean pages from the page cache (``posix_fadvise(DONTNEED)``;
        call it after an fdatasync).  Changes nothing on disk: a hint, best effort (an
        error is ignored: a seal must not fail on it)."""
        if hasattr(os, "posix_fadvise"):
            with contextlib.suppress(OSError):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def zero_range(self, fd: int, offset: int, length: int) -> None:
        """``fallocate(FALLOC_FL_ZERO_RANGE)``: zeros, blocks kept allocated (not
        durable until an fsync).  OSError(EOPNOTSUPP) where unsupported."""
        if _fallocate is None:
            raise OSError(errno.EOPNOTSUPP, "fallocate unavailable")
        _fallocate(fd, _FALLOC_FL_ZERO_RANGE, offset, length)

    # --- compound helpers (primitives only) ----------------------------------------

    def write_all(self, fd: int, parts: Buffers) -> int:
        """Write every part with as few ``writev`` calls as IOV_MAX and WRITE_CHUNK
        allow (handles short writes); returns the byte count.  Parts are 1-byte-item
        buffers (``len`` is their size).  One ``os.write`` per part cost ~7x more at
        1 KiB records; one ``writev`` of a whole 32 MiB segment cost ~6x the system
        time of 1 MiB ones (see WRITE_CHUNK)."""
        todo: list[bytes | memoryview | pa.Buffer] = list(parts)
        writev = self.writev
        total = 0
        i = 0
        while i < len(todo):
            end, nbytes = i, 0
            while end < len(todo) and end - i < _IOV_MAX:
                size = len(todo[end])
                if nbytes + size > WRITE_CHUNK:
                    if nbytes:  # write what is gathered; this part starts the next call
                        break
                    view = memoryview(todo[end])  # a part over the limit: cut (views)
                    todo[end : end + 1] = [view[:WRITE_CHUNK], view[WRITE_CHUNK:]]
                    size = WRITE_CHUNK
                nbytes += size
                end += 1
            chunk = todo[i:end]
            n = writev(fd, chunk)
            total += n
            if n == sum(map(len, chunk)):
                i += len(chunk)
                continue
            while n >= len(todo[i]):  # a short write: skip what was written, resume mid-part
                n -= len(todo[i])
                i += 1
            todo[i] = memoryview(todo[i])[n:]
        return total

    def write_durable(self, path: Path, parts: Buffers, mode: int = 0o644) -> int:
        """Create (or truncate) ``path`` with ``parts`` and fdatasync it (no rename)."""
        fd = self.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        try:
            n = self.write_all(fd, parts)
            self.fdatasync(fd)
        finally:
            self.close(fd)
        return n

    def write_atomic(self, path: Path, parts: Buffers, mode: int = 0o644) -> int:
        """tmp -> fdatasync -> rename -> directory fsync: readers see the old or the new
        file, and after the directory fsync the new one survives a power cut."""
        tmp = path.with_name(path.name + ".tmp")
        n = self.write_durable(tmp, parts, mode)
        self.rename(tmp, path)
        self.fsync_dir(path.parent)
        return n

    def read_if_exists(self, path: Path) -> bytes | None:
        try:
            return self.read_bytes(path)
        except FileNotFoundError:
            return None

    def fsync_dir(self, path: Path) -> None:
        """fsync a directory, so a create, rename or unlink inside it survives a crash."""
        fd = self.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            self.fsync(fd)
        finally:
            self.close(fd)

    def makedirs(self, path: Path) -> None:
        """``mkdir -p`` whose entries survive a power cut: the parent of every directory
        created here is fsynced (a directory entry is durable only then), and so, once,
        is the parent of ``path`` when it is found already there -- an earlier mkdir
        whose parent fsync failed, or a process killed between the two, leaves a
        directory that lasts only until the power goes.  A parent this process may not
        fsync, and could not have changed (``may_pass_over``), is passed over."""
        found = self.exists(path)
        if found and path in self.durable_dirs:
            return
        if not found:
            if path.parent != path:
                self.makedirs(path.parent)
            if self.mkdir(path):
                self.fsync_dir(path.parent)
                self.durable_dirs.add(path)
                return
        try:
            self.fsync_dir(path.parent)
        except OSError as e:
            if not may_pass_over(e, path.parent):
                raise
        self.durable_dirs.add(path)

    def zero_file(self, path: Path, size: int) -> None:
        """Zero ``path``'s bytes [0, size) without freeing its blocks, durably (fsync:
        the extent change is metadata).  Raises OSError where unsupported."""
        fd = self.open(path, os.O_WRONLY)
        try:
            self.zero_range(fd, 0, size)
            self.fsync(fd)
        finally:
            self.close(fd)


_current: FileSystem = FileSystem()


def current() -> FileSystem:
    """The file layer new stage components use (the real one unless a test installed
    another)."""
    return _current


@contextlib.contextmanager
def installed(fs: FileSystem) -> Iterator[FileSystem]:
    """Tests: stage components built inside this block use ``fs``."""
    global _current
    before, _current = _current, fs
    try:
        yield fs
    finally:
        _current = before


# module-level shorthands on the current layer (tests and tools)


def write_all(fd: int, parts: Buffers) -> int:
    return _current.write_all(fd, parts)


def write_durable(path: Path, parts: Buffers, mode: int = 0o644) -> int:
    return _current.write_durable(path, parts, mode)


def write_atomic(path: Path, parts: Buffers, mode: int = 0o644) -> int:
    return _current.write_atomic(path, parts, mode)


def read_if_exists(path: Path) -> bytes | None:
    return _current.read_if_exists(path)


def fsync_dir(path: Path) -> None:
    _current.fsync_dir(path)


def zero_file(path: Path, size: int) -> None:
    _current.zero_file(path, size)


class IoGate:
    """The WAL's fdatasync first: a sealer writes a segment's pages back in chunks,
    each started only while no WAL sync round is running.

    Why: a WAL round and a concurrent 32 MiB segment fdatasync split the disk, and
    the LOCAL ack waits for the WAL round; measured at 64 KiB records, the stage
    (WAL + segments) ran at 0.5 of raw write speed, and 1.0 with the segments'
    fdatasync removed.  Segment bytes still reach the disk in the gaps between WAL
    rounds (the group-commit interval) and whenever the WAL is idle -- e.g. while
    producers wait at the open-segment memory cap, which bounds how far seals lag.
    The gate only orders I/O: every segment is fdatasynced before it is committed.
    """

    chunk = 4 << 20
    """Bytes written back per gated step: a WAL round waits for at most one."""
    max_wait = 0.25
    """Seconds a chunk yields to back-to-back WAL rounds before it goes anyway."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._rounds = 0

    @contextlib.contextmanager
    def wal_round(self) -> Iterator[None]:
        with self._cond:
            self._rounds += 1
        try:
            yield
        finally:
            with self._cond:
                self._rounds -= 1
                if self._rounds == 0:
                    self._cond.notify_all()

    def _wait_idle(self) -> None:
        deadline = time.monotonic() + self.max_wait
        with self._cond:
            while self._rounds:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._cond.wait(left)

    def write_back(self, fd: int, size: int, fs: FileSystem | None = None) -> None:
        """Write ``fd``'s dirty pages [0, size) to the disk between WAL rounds (not
        durable yet: the caller's fdatasync still follows).  A no-op without
        ``sync_file_range`` (the fdatasync then writes everything at once)."""
        fs = fs or _current
        if not fs.can_write_back:
            return
        for off in range(0, size, self.chunk):
            self._wait_idle()
            fs.write_back(fd, off, min(self.chunk, size - off))


def disk_error(e: OSError, what: str, path: object = None) -> DiskError:
    """The typed stage error for a failed disk operation (DiskFullError for ENOSPC and
    EDQUOT, DiskIOError for the rest), with errno and path."""
    where = path if path is not None else e.filename
    cls = DiskFullError if e.errno in (errno.ENOSPC, errno.EDQUOT) else DiskIOError
    text = e.strerror or str(e)
    return cls(
        f"{what} failed: {text}" + (f" ({where})" if where is not None else ""),
        e.errno,
        None if where is None else str(where),
    )
