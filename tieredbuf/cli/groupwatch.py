"""``tieredbuf work``'s command shim: nothing of a command outlives its runner.

``tieredbuf work`` starts each command as ``python -I -S groupwatch.py RUNNER_PID --
CMD ARG ...`` in a new session, so the shim leads a process group that holds the command
and everything it starts.  The runner stops a command by signalling that whole group.
The shim runs CMD as its child, relays its exit status (an exit code, or the same
signal), and watches its own parent: should the runner die without stopping the group
(SIGKILL, a crash), the shim finds itself re-parented within 0.1 s and kills the group,
so no command keeps running beside another runner's copy of the same entry.

Standard library only, run by path with ``-S``: it starts in a few milliseconds and
imports nothing of tieredbuf.
"""

from __future__ import annotations

import os
import signal
import sys
import time

POLL_S = 0.1


def _noted(signum: int, frame: object) -> None:
    """SIGTERM / SIGINT sent to the group reach the command too; the shim only waits to
    relay how the command ended (the runner SIGKILLs the group if it does not end)."""


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: groupwatch.py RUNNER_PID -- CMD [ARG ...]", file=sys.stderr)
        return 2
    runner, cmd = int(argv[0]), argv[2:]
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, _noted)  # a handler, not SIG_IGN: exec resets it for the command
    timed_wait = hasattr(signal, "sigtimedwait")  # Linux: woken by SIGCHLD, not a poll
    if timed_wait:
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])
    pid = os.fork()
    if pid == 0:
        if timed_wait:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGCHLD])  # exec keeps masks
        try:
            os.execvp(cmd[0], cmd)
        except OSError as e:
            print(f"cannot run {cmd[0]!r}: {e.strerror}", file=sys.stderr)
        os._exit(127)
    os.close(0)  # the command reads stdin; the shim must not hold the pipe open
    while True:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return 0
        if done:
            break
        if os.getppid() != runner:  # the runner is gone: take the whole group with it
            os.killpg(0, signal.SIGKILL)
        if timed_wait:
            signal.sigtimedwait([signal.SIGCHLD], POLL_S)
        else:
            time.sleep(POLL_S)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        return 128 + sig
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
