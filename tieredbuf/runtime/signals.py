"""A stop flag that a signal handler may set.

``threading.Event.set()`` takes the lock of the Event's condition.  ``Event.wait()``
holds that same lock for a few bytecodes before it parks, and CPython runs a signal
handler in the main thread between bytecodes.  A handler that calls ``set()`` on an
Event the main thread is waiting on can therefore land inside ``wait()`` with the lock
held, and block on it forever: the process then ignores every later signal but
SIGKILL.  Under a signal every half millisecond a plain Event hangs within a few
thousand signals; a Ctrl-C hung ``tieredbuf consume --follow`` this way.

:class:`SignalEvent` keeps the same small API (``set``, ``is_set``, ``wait``) without a
lock: ``set()`` stores a flag and writes a byte to a non-blocking pipe, and ``wait()``
waits on that pipe with ``select`` (which resumes after a handler runs, PEP 475, and
then sees the byte).
"""

from __future__ import annotations

import contextlib
import os
import select
from typing import Protocol


class Stop(Protocol):
    """What a loop needs of its stop flag: ``threading.Event`` and SignalEvent both fit."""

    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool: ...


class SignalEvent:
    """A one-way stop flag safe to set from a signal handler (and from any thread)."""

    def __init__(self) -> None:
        self._flag = False
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)

    def set(self) -> None:
        self._flag = True
        if self._w >= 0:  # not closed (a closed fd number may be someone else's now)
            with contextlib.suppress(OSError):  # full: it is set already
                os.write(self._w, b"\0")

    def is_set(self) -> bool:
        return self._flag

    def wait(self, timeout: float | None = None) -> bool:
        """True once set; False when ``timeout`` seconds pass first."""
        if not self._flag:
            select.select([self._r], [], [], timeout)
        return self._flag

    def close(self) -> None:
        """Closes the pipe (once); the flag keeps answering ``is_set``."""
        r, w, self._r, self._w = self._r, self._w, -1, -1
        for fd in (r, w):
            if fd >= 0:
                os.close(fd)

    def __enter__(self) -> SignalEvent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
