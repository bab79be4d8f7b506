"""One command of ``tieredbuf work``, run in a process group of its own.

The command runs under :mod:`tieredbuf.cli.groupwatch` (``python -I -S groupwatch.py
RUNNER_PID -- CMD ...``) in a new session: the shim leads a process group holding the
command and everything it starts, relays its exit status, and kills the group if the
runner dies.  :class:`Job` feeds the entry to its stdin, passes its stderr through
(keeping the last line), and stops it -- SIGTERM to the whole group, then SIGKILL to
the whole group after a grace period -- when the runner says so.  When the command
ends by itself, whatever it left running in its group is killed too: nothing of a job
outlives it.  The group is signalled before the shim is reaped, so its id cannot have
been reused meanwhile.
"""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from tieredbuf.errors import ConfigError

SHIM = str(Path(__file__).with_name("groupwatch.py"))
JOIN_S = 5.0
"""How long the stdin and stderr threads get once the group is gone."""


def _feed(pipe: IO[bytes] | None, data: bytes) -> None:
    if pipe is None:
        return
    with contextlib.suppress(BrokenPipeError, OSError):  # CMD need not read it all
        pipe.write(data)
    with contextlib.suppress(BrokenPipeError, OSError):
        pipe.close()


class Job:
    """A command running for one entry (see the module docstring)."""

    def __init__(
        self,
        cmd: list[str],
        data: bytes,
        env: dict[str, str],
        write_err: Callable[[bytes], None],
    ) -> None:
        if shutil.which(cmd[0], path=env.get("PATH")) is None:
            raise ConfigError(f"cannot run {cmd[0]!r}: not found")
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-S", SHIM, str(os.getpid()), "--", *cmd],
            stdin=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        self.pgid = self.proc.pid
        self._tail: collections.deque[bytes] = collections.deque(maxlen=1)
        self._write_err = write_err
        self._threads = [
            threading.Thread(target=_feed, args=(self.proc.stdin, data), daemon=True),
            threading.Thread(target=self._forward, daemon=True),
        ]
        for t in self._threads:
            t.start()
        self.stopped = False
        self._code: int | None = None

    def _forward(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._write_err(line)
            if line.strip():
                self._tail.append(line.strip())

    def _exited(self) -> bool:
        """The shim exited (not reaped yet: the group id stays ours)."""
        try:
            got = os.waitid(os.P_PID, self.pgid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return True
        return got is not None

    def wait(self, until: float) -> bool:
        """Wait until the command exited (True) or the monotonic time ``until`` (False)."""
        pause = 0.002
        while not self._exited():
            left = until - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(pause, left))
            pause = min(0.05, pause * 2)
        return True

    def _signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, sig)

    def stop(self, grace: float) -> None:
        """SIGTERM to the whole group; SIGKILL to the whole group once the command exited
        or ``grace`` seconds passed."""
        self.stopped = True
        self._signal(signal.SIGTERM)
        self.wait(time.monotonic() + max(0.0, grace))

    def finish(self) -> tuple[int | None, str]:
        """Kill what is left of the group, reap the command; its exit status (None: it was
        stopped) and the last line it wrote to stderr."""
        self._signal(signal.SIGKILL)  # before the reap: the group id is still ours
        code = self.proc.wait()
        for t in self._threads:
            t.join(JOIN_S)
        last = self._tail[0].decode("utf-8", "replace") if self._tail else ""
        return (None if self.stopped else code), last

    def kill(self) -> None:
        """The runner is leaving: kill the group now."""
        self.stopped = True
        self._signal(signal.SIGKILL)
