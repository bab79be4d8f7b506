"""A simulated file layer for the stage: power cuts that keep only what an fsync covered,
and injected disk faults.

``SimFs`` implements the primitives of ``tieredbuf.stage.filesystem.FileSystem`` in memory
(the stage's compound helpers -- write_atomic, fsync_dir, zero_file -- run unchanged on
top of them), and keeps, beside the live state every read sees (the page cache), the
state a power cut would leave.  It models what Linux and ext4 promise, and no more:

* **File data** is durable up to the last completed ``fsync``/``fdatasync`` of that
  file (its size too).  ``sync_file_range`` (``write_back``) is not a barrier.
* **A directory entry** -- a create, a rename, an unlink, a mkdir -- is durable only
  once its directory has been fsynced.  An fsync of a file does not make its name
  durable (ext4 happens to commit it in the same journal transaction; nothing
  promises that).
* **A power cut** (``cut()``, or ``arm(k)``: at the k-th state-changing operation)
  freezes the machine: from then on every operation raises :class:`PowerCut`.
  ``reconstruct(mode, rng)`` builds the disk a reboot would find:

  - ``drop``: only what is durable;
  - ``keep``: everything (what a SIGKILL leaves: the page cache survives);
  - ``subset``: durable state plus a seeded random subset of the operations that
    were not durable yet, applied in order, each file and each directory on its own:
    a write kept, lost, or torn (only its part before a 512-byte boundary kept), a
    truncate or zeroing kept or lost, a create, rename or unlink kept or lost (a
    rename kept while the file's data is lost, or a rename lost while a later one of
    the same file is kept).  A write that was lost reads as the bytes the file had
    (zeros past its durable end).  Renames are atomic: a kept rename moves the file
    from whatever name it has in the directory.

  Not modelled: sectors of one write persisted out of order (a hole in the middle of
  one write with its end kept), and a disk that lies about a flush.

* **Faults**: ``fail(op, errno_, ...)`` makes matching operations raise ``OSError``;
  ``capacity`` makes writes that do not fit raise ENOSPC (a short write first, as
  Linux does when part of it fits).

Thread-safe (one lock); file descriptors are plain ints from 1000 up.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tieredbuf.stage.filesystem import FileSystem

SECTOR = 512


class PowerCut(OSError):
    """The simulated machine lost power: every operation fails from now on."""

    def __init__(self) -> None:
        super().__init__(errno.EIO, "simulated power cut: the machine is off")


@dataclass(slots=True)
class _Inode:
    ino: int
    is_dir: bool
    data: bytearray = field(default_factory=bytearray)
    """Live content (files): what reads see."""
    durable: bytes = b""
    """Content as of the last completed fsync/fdatasync."""
    pending: list[tuple[Any, ...]] = field(default_factory=list)
    """Data operations since then: ("write", off, bytes) | ("truncate", size) |
    ("zero", off, length)."""
    entries: dict[str, int] = field(default_factory=dict)
    """Directories: live name -> inode."""
    durable_entries: dict[str, int] = field(default_factory=dict)
    dir_pending: list[tuple[Any, ...]] = field(default_factory=list)
    """Directories: ("link", name, ino) | ("unlink", name, ino) | ("rename", src, dst, ino)
    since the last fsync of the directory."""


@dataclass(slots=True)
class _Open:
    ino: int
    path: Path
    offset: int = 0


@dataclass(slots=True)
class _Fault:
    op: str
    err: int
    path_contains: str
    times: int | None
    after: int
    fired: int = 0


class SimFs(FileSystem):
    """See the module doc."""

    def __init__(self, capacity: int | None = None) -> None:
        super().__init__()
        self._lock = threading.RLock()
        self._inodes: dict[int, _Inode] = {}
        self._next_ino = 1
        self._root = self._new_inode(is_dir=True).ino
        self._fds: dict[int, _Open] = {}
        self._next_fd = 1000
        self._locks: set[int] = set()
        self.capacity = capacity
        """Bytes of file data the disk holds (None: unbounded): writes past it fail."""
        self.dead = False
        self.ops = 0
        """State-changing operations performed (the clock ``arm`` counts on)."""
        self._cut_at: int | None = None
        self.trace: deque[str] = deque(maxlen=60)
        """The last operations, for failure reports."""
        self._faults: list[_Fault] = []
        self._cut_match: Callable[[str], bool] | None = None
        self._cut_next = False

    # --- set-up and power -----------------------------------------------------------

    def makedirs_durable(self, path: str | Path) -> Path:
        """Create ``path`` (and parents) as if it had been there before the test."""
        p = Path(path)
        with self._lock:
            cur = self._inodes[self._root]
            for part in p.parts[1:]:
                ino = cur.entries.get(part)
                if ino is None:
                    ino = self._new_inode(is_dir=True).ino
                    cur.entries[part] = ino
                    cur.durable_entries[part] = ino
                cur = self._inodes[ino]
        return p

    def arm(self, cut_at: int | None) -> None:
        """Cut the power when the ``cut_at``-th state-changing operation (counted from
        now) is about to run; None disarms."""
        with self._lock:
            self._cut_at = None if cut_at is None else self.ops + cut_at

    def cut_after(self, matches: Callable[[str], bool]) -> None:
        """Cut the power right after the first operation whose trace line ``matches``."""
        with self._lock:
            self._cut_match = matches

    def cut(self) -> None:
        with self._lock:
            if not self.dead:
                self.dead = True
                self.trace.append(f"#{self.ops} POWER CUT")

    def fail(
        self, op: str, err: int, path_contains: str = "", times: int | None = 1, after: int = 0
    ) -> _Fault:
        """Make the next ``times`` (None: every) matching operations raise
        ``OSError(err)``, after letting ``after`` of them pass.  ``op``: writev,
        fdatasync, fsync, rename, link, unlink, open, ftruncate, zero_range, fsync_dir (an
        fsync of a directory), or "*"."""
        f = _Fault(op, err, path_contains, times, after)
        with self._lock:
            self._faults.append(f)
        return f

    def heal(self) -> None:
        """Remove every injected fault."""
        with self._lock:
            self._faults.clear()

    def used_bytes(self) -> int:
        with self._lock:
            return self._used_locked()

    # --- internals ------------------------------------------------------------------

    def _new_inode(self, is_dir: bool) -> _Inode:
        node = _Inode(self._next_ino, is_dir)
        self._next_ino += 1
        self._inodes[node.ino] = node
        return node

    def _check_alive(self) -> None:
        if self.dead:
            raise PowerCut()

    def _tick(self, what: str, op: str, path: Path | None) -> None:
        """Before a state-changing operation: power, the cut clock, faults."""
        self._check_alive()
        self._fault(op, path)
        self.ops += 1
        if self._cut_next or (self._cut_at is not None and self.ops >= self._cut_at):
            self.dead = True
            self.trace.append(f"#{self.ops} POWER CUT before {what}")
            raise PowerCut()
        self.trace.append(f"#{self.ops} {what}")
        if self._cut_match is not None and self._cut_match(what):
            self._cut_next = True

    def _fault(self, op: str, path: Path | None) -> None:
        for f in self._faults:
            if f.op not in (op, "*"):
                continue
            if f.path_contains and (path is None or f.path_contains not in str(path)):
                continue
            if f.after > 0:
                f.after -= 1
                continue
            if f.times is not None and f.fired >= f.times:
                continue
            f.fired += 1
            self.trace.append(f"#{self.ops} FAULT {op} {path}: {os.strerror(f.err)}")
            raise OSError(f.err, os.strerror(f.err), str(path) if path else None)

    def _lookup(self, path: Path) -> tuple[_Inode, str, int | None]:
        """(parent directory, name, inode or None)."""
        p = Path(path)
        if not p.is_absolute():
            p = Path.cwd() / p
        cur = self._inodes[self._root]
        parts = p.parts[1:]
        if not parts:
            raise PermissionError(errno.EPERM, "the root", str(p))
        for part in parts[:-1]:
            ino = cur.entries.get(part)
            if ino is None:
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(p))
            cur = self._inodes[ino]
            if not cur.is_dir:
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(p))
        return cur, parts[-1], cur.entries.get(parts[-1])

    def _inode_at(self, path: Path) -> _Inode:
        if Path(path) == Path("/"):
            return self._inodes[self._root]
        _, _, ino = self._lookup(path)
        if ino is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
        return self._inodes[ino]

    def _fd(self, fd: int) -> _Open:
        try:
            return self._fds[fd]
        except KeyError:
            raise OSError(errno.EBADF, os.strerror(errno.EBADF)) from None

    # --- primitives -----------------------------------------------------------------

    def open(
        self,
        path: Any,
        flags: int,
        mode: int = 0o777,
        *,  # type: ignore[override]
        dir_fd: Any = None,
    ) -> int:
        path = Path(path)
        with self._lock:
            self._check_alive()
            if flags & os.O_DIRECTORY:
                node = self._inode_at(path)
                if not node.is_dir:
                    raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path))
            else:
                parent, name, ino = self._lookup(path)
                if ino is not None and flags & os.O_CREAT and flags & os.O_EXCL:
                    raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path))
                if ino is None:
                    if not flags & os.O_CREAT:
                        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
                    self._tick(f"create {path}", "open", path)
                    node = self._new_inode(is_dir=False)
                    parent.entries[name] = node.ino
                    parent.dir_pending.append(("link", name, node.ino))
                else:
                    node = self._inodes[ino]
                    if node.is_dir:
                        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
                    if flags & os.O_TRUNC and node.data:
                        self._tick(f"truncate-open {path}", "open", path)
                        node.data = bytearray()
                        node.pending.append(("truncate", 0))
            fd = self._next_fd
            self._next_fd += 1
            self._fds[fd] = _Open(node.ino, path)
            return fd

    def close(self, fd: int) -> None:  # type: ignore[override]
        with self._lock:
            o = self._fds.pop(fd, None)
            if o is not None:
                self._locks.discard(fd)

    def writev(self, fd: int, buffers: Iterable[Any]) -> int:  # type: ignore[override]
        data = b"".join(buffers)  # bytes, memoryviews and pa.Buffers: 1-byte items
        with self._lock:
            o = self._fd(fd)
            node = self._inodes[o.ino]
            if self.capacity is not None:
                grow = max(0, o.offset + len(data) - len(node.data))
                room = self.capacity - self._used_locked()
                if grow > room:
                    fits = max(0, len(data) - (grow - max(room, 0)))
                    if fits == 0:
                        self._check_alive()
                        self.trace.append(f"#{self.ops} ENOSPC writev {o.path}")
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(o.path))
                    data = data[:fits]  # a short write: what fits
            self._tick(f"write {o.path} [{o.offset}, +{len(data)})", "writev", o.path)
            off = o.offset
            if off > len(node.data):
                node.data.extend(bytes(off - len(node.data)))
            node.data[off : off + len(data)] = data
            node.pending.append(("write", off, data))
            o.offset = off + len(data)
            return len(data)

    def _used_locked(self) -> int:
        """Bytes of the files that still hold space: linked, or open."""
        live = {o.ino for o in self._fds.values()}
        todo = [self._root]
        while todo:
            node = self._inodes[todo.pop()]
            for ino in node.entries.values():
                if ino not in live:
                    live.add(ino)
                    todo.append(ino)
        return sum(len(self._inodes[i].data) for i in live if not self._inodes[i].is_dir)

    def _sync(self, fd: int, op: str) -> None:
        with self._lock:
            o = self._fd(fd)
            node = self._inodes[o.ino]
            self._tick(f"{op} {o.path}", "fsync_dir" if node.is_dir else op, o.path)
            if node.is_dir:
                node.durable_entries = dict(node.entries)
                node.dir_pending.clear()
            else:
                node.durable = bytes(node.data)
                node.pending.clear()

    def fdatasync(self, fd: int) -> None:  # type: ignore[override]
        self._sync(fd, "fdatasync")

    def fsync(self, fd: int) -> None:  # type: ignore[override]
        self._sync(fd, "fsync")

    def ftruncate(self, fd: int, length: int) -> None:  # type: ignore[override]
        with self._lock:
            o = self._fd(fd)
            node = self._inodes[o.ino]
            self._tick(f"ftruncate {o.path} {length}", "ftruncate", o.path)
            if length < len(node.data):
                del node.data[length:]
            else:
                node.data.extend(bytes(length - len(node.data)))
            node.pending.append(("truncate", length))

    def lseek(self, fd: int, pos: int, how: int) -> int:  # type: ignore[override]
        with self._lock:
            self._check_alive()
            o = self._fd(fd)
            if how == os.SEEK_END:
                o.offset = len(self._inodes[o.ino].data) + pos
            elif how == os.SEEK_SET:
                o.offset = pos
            else:
                o.offset += pos
            return o.offset

    def fchmod(self, fd: int, mode: int) -> None:  # type: ignore[override]
        with self._lock:
            self._check_alive()
            self._fd(fd)

    def keep_checksum(self, fd: int, crc32: int) -> None:
        """A simulated disk keeps no extended attributes (the segment's sidecar has it)."""
        with self._lock:
            self._check_alive()
            self._fd(fd)

    def chmod(self, path: Any, mode: int, **kw: Any) -> None:  # type: ignore[override]
        with self._lock:
            self._check_alive()
            self._inode_at(Path(path))

    def rename(self, src: Any, dst: Any, **kw: Any) -> None:  # type: ignore[override]
        src, dst = Path(src), Path(dst)
        with self._lock:
            self._check_alive()
            sp, sname, sino = self._lookup(src)
            dp, dname, _ = self._lookup(dst)
            if sino is None:
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(src))
            if sp is not dp:
                raise NotImplementedError("SimFs renames within one directory only")
            self._tick(f"rename {src} -> {dname}", "rename", src)
            del sp.entries[sname]
            sp.entries[dname] = sino
            sp.dir_pending.append(("rename", sname, dname, sino))

    def link(self, src: Any, dst: Any, **kw: Any) -> None:  # type: ignore[override]
        """A second name for a file, in any directory (a hard link): durable once the
        destination directory is fsynced, like a create."""
        src, dst = Path(src), Path(dst)
        with self._lock:
            self._check_alive()
            _, _, sino = self._lookup(src)
            dp, dname, dino = self._lookup(dst)
            if sino is None:
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(src))
            if self._inodes[sino].is_dir:
                raise PermissionError(errno.EPERM, os.strerror(errno.EPERM), str(src))
            if dino is not None:
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
            self._tick(f"link {src} -> {dst}", "link", dst)
            dp.entries[dname] = sino
            dp.dir_pending.append(("link", dname, sino))

    def link_count(self, path: Path) -> int:
        with self._lock:
            self._check_alive()
            ino = self._inode_at(Path(path)).ino
            return sum(
                1
                for node in self._inodes.values()
                if node.is_dir
                for i in node.entries.values()
                if i == ino
            )

    def unlink(self, path: Path, missing_ok: bool = False) -> None:
        with self._lock:
            self._check_alive()
            parent, name, ino = self._lookup(path)
            if ino is None:
                if missing_ok:
                    return
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
            if self._inodes[ino].is_dir:
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
            self._tick(f"unlink {path}", "unlink", path)
            del parent.entries[name]
            parent.dir_pending.append(("unlink", name, ino))

    def mkdir(self, path: Path) -> bool:
        with self._lock:
            self._check_alive()
            parent, name, ino = self._lookup(path)
            if ino is not None:
                if not self._inodes[ino].is_dir:
                    raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path))
                return False
            self._tick(f"mkdir {path}", "mkdir", path)
            node = self._new_inode(is_dir=True)
            parent.entries[name] = node.ino
            parent.dir_pending.append(("link", name, node.ino))
            return True

    def listdir(self, path: Path) -> list[str]:
        with self._lock:
            self._check_alive()
            node = self._inode_at(path)
            if not node.is_dir:
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path))
            return sorted(node.entries)

    def exists(self, path: Path) -> bool:
        with self._lock:
            self._check_alive()
            try:
                self._inode_at(path)
            except (FileNotFoundError, NotADirectoryError):
                return False
            return True

    def is_dir(self, path: Path) -> bool:
        with self._lock:
            try:
                return self._inode_at(path).is_dir
            except (FileNotFoundError, NotADirectoryError):
                return False

    def file_size(self, path: Path) -> int:
        with self._lock:
            self._check_alive()
            return len(self._inode_at(path).data)

    def read_bytes(self, path: Path) -> bytes:
        with self._lock:
            self._check_alive()
            node = self._inode_at(path)
            if node.is_dir:
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
            return bytes(node.data)

    @contextlib.contextmanager
    def read_view(self, path: Path) -> Iterator[bytes]:  # type: ignore[override]
        """The live bytes (what a map of the page cache shows)."""
        yield self.read_bytes(path)

    def lock(self, path: Path) -> int:
        fd = self.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        with self._lock:
            ino = self._fds[fd].ino
            if any(self._fds[f].ino == ino for f in self._locks if f in self._fds):
                self.close(fd)
                raise BlockingIOError(errno.EWOULDBLOCK, "locked")
            self._locks.add(fd)
        return fd

    @property
    def can_write_back(self) -> bool:
        return True

    def write_back(self, fd: int, offset: int, length: int) -> None:
        with self._lock:  # not a barrier: nothing becomes durable
            self._check_alive()
            self._fd(fd)

    def drop_cache(self, fd: int) -> None:
        with self._lock:  # a cache hint: nothing on the disk changes
            self._check_alive()
            self._fd(fd)

    def zero_range(self, fd: int, offset: int, length: int) -> None:
        with self._lock:
            o = self._fd(fd)
            node = self._inodes[o.ino]
            self._tick(f"zero {o.path} [{offset}, +{length})", "zero_range", o.path)
            end = min(offset + length, len(node.data))
            if end > offset:
                node.data[offset:end] = bytes(end - offset)
            node.pending.append(("zero", offset, length))

    # --- the disk after a power cut -------------------------------------------------

    def reconstruct(
        self,
        mode: str,
        rng: random.Random | None = None,
        p_keep: float = 0.5,
        p_tear: float = 0.25,
        decide: Callable[[str, tuple[Any, ...]], bool | None] | None = None,
    ) -> SimFs:
        """The file system a reboot finds (see the module doc); the power must be off.
        ``decide(description, op)``: in ``subset`` mode, True keeps a non-durable
        operation, False loses it, None leaves it to chance (tests that need one
        particular outcome); ``description`` is the trace line of the operation."""
        if mode not in ("drop", "keep", "subset"):
            raise ValueError(mode)
        rng = rng or random.Random(0)
        with self._lock:
            if not self.dead:
                raise RuntimeError("reconstruct() needs the power off: call cut() first")
            out = SimFs(self.capacity)
            out._inodes.clear()
            out._next_ino = self._next_ino
            contents: dict[int, bytes] = {}

            names = self._names()

            def keep(where: str, op: tuple[Any, ...]) -> bool:
                if decide is not None:
                    d = decide(where, op)
                    if d is not None:
                        return d
                return rng.random() < p_keep

            def content(node: _Inode) -> bytes:
                if node.ino not in contents:
                    contents[node.ino] = self._file_after_cut(
                        node,
                        mode,
                        rng,
                        lambda op: keep(names.get(node.ino, "?"), op),
                        0.0 if decide is not None else p_tear,
                    )
                return contents[node.ino]

            def entries(node: _Inode) -> dict[str, int]:
                if mode == "keep":
                    return dict(node.entries)
                ents = dict(node.durable_entries)
                if mode == "drop":
                    return ents
                for op in node.dir_pending:
                    if not keep(names.get(node.ino, "?"), op):
                        continue
                    if op[0] == "link":
                        ents[op[1]] = op[2]
                    elif op[0] == "unlink":
                        if ents.get(op[1]) == op[2]:
                            del ents[op[1]]
                    else:  # rename: the file leaves whatever name it has here
                        _, _src, dst, ino = op
                        for n in [n for n, i in ents.items() if i == ino]:
                            del ents[n]
                        ents[dst] = ino
                return ents

            def copy(ino: int) -> None:
                node = self._inodes[ino]
                new = _Inode(ino, node.is_dir)
                out._inodes[ino] = new
                if node.is_dir:
                    ents = entries(node)
                    new.entries = dict(ents)
                    new.durable_entries = dict(ents)
                    for child in ents.values():
                        if child not in out._inodes:
                            copy(child)
                else:
                    data = content(node)
                    new.data = bytearray(data)
                    new.durable = data

            copy(self._root)
            out._root = self._root
            return out

    def _names(self) -> dict[int, str]:
        """inode -> a live path (for ``decide``)."""
        out: dict[int, str] = {self._root: "/"}
        todo = [(self._root, "")]
        while todo:
            ino, prefix = todo.pop()
            for name, child in self._inodes[ino].entries.items():
                if child not in out:
                    out[child] = f"{prefix}/{name}"
                    todo.append((child, f"{prefix}/{name}"))
        return out

    @staticmethod
    def _file_after_cut(
        node: _Inode,
        mode: str,
        rng: random.Random,
        keep: Callable[[tuple[Any, ...]], bool],
        p_tear: float,
    ) -> bytes:
        if mode == "keep":
            return bytes(node.data)
        data = bytearray(node.durable)
        if mode == "drop":
            return bytes(data)
        for op in node.pending:
            if not keep(op):
                continue  # lost
            if op[0] == "write":
                _, off, chunk = op
                if rng.random() < p_tear:  # torn: only the part before a sector boundary
                    bounds = [
                        b for b in range((off // SECTOR + 1) * SECTOR, off + len(chunk), SECTOR)
                    ]
                    if bounds:
                        chunk = chunk[: rng.choice(bounds) - off]
                if off > len(data):
                    data.extend(bytes(off - len(data)))
                data[off : off + len(chunk)] = chunk
            elif op[0] == "truncate":
                size = op[1]
                if size < len(data):
                    del data[size:]
                else:
                    data.extend(bytes(size - len(data)))
            else:  # zero
                _, off, length = op
                end = min(off + length, len(data))
                if end > off:
                    data[off:end] = bytes(end - off)
        return bytes(data)

    # --- inspection (tests) ---------------------------------------------------------

    def walk(self, path: str | Path) -> dict[str, bytes | None]:
        """Everything under ``path``: relative name -> live bytes (None: a directory)."""
        out: dict[str, bytes | None] = {}
        with self._lock:
            base = self._inode_at(Path(path))

            def rec(node: _Inode, prefix: str) -> None:
                for name, ino in sorted(node.entries.items()):
                    child = self._inodes[ino]
                    if child.is_dir:
                        out[prefix + name] = None
                        rec(child, f"{prefix}{name}/")
                    else:
                        out[prefix + name] = bytes(child.data)

            rec(base, "")
        return out

    def materialize(self, path: str | Path, dest: Path) -> None:
        """Copy everything under ``path`` to the real directory ``dest``."""
        dest.mkdir(parents=True, exist_ok=True)
        for rel, data in self.walk(path).items():
            if data is None:
                (dest / rel).mkdir(parents=True, exist_ok=True)
            else:
                (dest / rel).write_bytes(data)
