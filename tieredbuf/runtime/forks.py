"""What a process forked from a tieredbuf process inherits, and what it must rebuild.

``fork()`` copies memory but not threads.  Three things break in the child:

* obstore's async runtime (tokio, one per process, created on obstore's first call).
  Its worker threads are gone, so every network request from the child hangs; a new
  ``S3Store`` does not help, the runtime is global.  :func:`obstore_inherited` is True
  in any process whose ancestor started it; S3 stores then talk through botocore
  (:mod:`tieredbuf.store.botostore`) instead.  In-memory obstore stores still work.
* Locks held by another thread at the moment of the fork stay held forever.  Objects
  that share a lock with threads register :func:`on_fork` to get fresh ones.
* Objects that own threads (producers, consumers, exporters) are dead in the child:
  :class:`ForkGuard` makes them fail at once with :class:`~tieredbuf.errors.ForkedError`
  naming the fix (create them after the fork) instead of hanging.

multiprocessing's ``forkserver`` and ``spawn`` start methods run a fresh interpreter
and inherit nothing of this.

And at interpreter exit, :func:`stop_at_exit` events are set before Python joins the
worker threads of thread pools: an upload retrying against a store that is down would
otherwise keep a process that never called ``close()`` from exiting.
"""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401 -- its exit hook must be registered before ours
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

from tieredbuf.errors import ForkedError

_pid = os.getpid()
_runtime_pid: int | None = None
"""The process that first called obstore (its runtime lives there), or None."""
_hooks: weakref.WeakKeyDictionary[Any, Callable[[Any], None]] = weakref.WeakKeyDictionary()
_hooks_lock = threading.Lock()


def pid() -> int:
    """This process's id (kept current across forks without a system call)."""
    return _pid


def note_obstore_call() -> None:
    """Called before every obstore request: records which process started its runtime."""
    global _runtime_pid
    if _runtime_pid is None:
        _runtime_pid = _pid


def obstore_inherited() -> bool:
    """True when obstore's runtime was started by an ancestor: its network calls would
    hang in this process."""
    return _runtime_pid is not None and _runtime_pid != _pid


def on_fork(obj: Any, hook: Callable[[Any], None]) -> None:
    """Call ``hook(obj)`` in the child after every fork, while ``obj`` is alive."""
    with _hooks_lock:
        _hooks[obj] = hook


_exit_events: weakref.WeakSet[threading.Event] = weakref.WeakSet()


def stop_at_exit(event: threading.Event) -> None:
    """Set ``event`` when the interpreter starts to exit (before pool threads are joined)."""
    _exit_events.add(event)


def _at_exit() -> None:
    for event in list(_exit_events):
        event.set()


# concurrent.futures joins its workers in a threading._register_atexit hook, which runs
# before atexit handlers; ours must run before it.  Those hooks run in *reverse*
# registration order, so concurrent.futures.thread (which registers its hook on import)
# is imported first (at the top of this module): registered after it, ours runs first.
_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(_at_exit)


def _after_fork_in_child() -> None:
    global _pid, _hooks_lock
    _pid = os.getpid()
    _hooks_lock = threading.Lock()  # another thread may have held it at the fork
    for obj, hook in list(_hooks.items()):
        hook(obj)


os.register_at_fork(after_in_child=_after_fork_in_child)


class ForkGuard:
    """Remembers the creating process; :meth:`check` raises ForkedError in any other."""

    __slots__ = ("_pid", "_what")

    def __init__(self, what: str) -> None:
        self._pid = _pid
        self._what = what

    @property
    def forked(self) -> bool:
        return self._pid != _pid

    def check(self) -> None:
        if self._pid != _pid:
            raise ForkedError(
                f"this {self._what} was created in process {self._pid} and is used in "
                f"process {_pid}, a fork of it: its threads did not survive the fork. "
                f"Create the {self._what} after the fork (in the child), or start child "
                f"processes with multiprocessing's 'forkserver' or 'spawn' method"
            )
