"""tieredbuf.runtime.signals.SignalEvent: a stop flag a signal handler can set without deadlock.

``threading.Event.set()`` from a handler can land while the main thread holds the
Event's lock inside ``wait()``; the process then hangs.  That hung ``consume --follow``
on a Ctrl-C (the harness below, with a ``threading.Event``, hung after 6,207 signals
sent every 0.5 ms).  These tests pin the replacement's behaviour.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from tieredbuf.runtime.signals import SignalEvent


def test_a_handler_that_sets_it_wakes_the_main_thread_wait() -> None:
    ev = SignalEvent()
    old = signal.signal(signal.SIGUSR1, lambda *_: ev.set())
    try:
        t = threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGUSR1))
        t.start()
        assert ev.wait(60) is True  # not the timeout: the byte in the pipe woke select
        t.join()
    finally:
        signal.signal(signal.SIGUSR1, old)
        ev.close()
    assert ev.is_set()


def test_wait_times_out_false_and_set_from_another_thread_wakes_it() -> None:
    with SignalEvent() as ev:
        assert ev.wait(0.01) is False and not ev.is_set()
        t = threading.Thread(target=ev.set)
        t.start()
        assert ev.wait(60) is True
        t.join()


def test_set_after_close_writes_nothing_and_close_is_idempotent() -> None:
    ev = SignalEvent()
    ev.close()
    r, w = os.pipe()  # likely reuses the closed numbers: set() must not write into them
    try:
        ev.set()
        ev.close()
        os.set_blocking(r, False)
        with pytest.raises(BlockingIOError):
            os.read(r, 1)
        assert ev.is_set()
    finally:
        os.close(r)
        os.close(w)


CHILD = textwrap.dedent("""
    import signal, sys
    from tieredbuf.runtime.signals import SignalEvent
    box = [SignalEvent()]
    done = SignalEvent()
    hits = [0]
    def on_usr1(n, f):
        hits[0] += 1
        box[0].set()
    signal.signal(signal.SIGUSR1, on_usr1)
    signal.signal(signal.SIGUSR2, lambda n, f: done.set())
    print("ready", flush=True)
    loops = 0
    while not done.is_set():
        ev = SignalEvent()
        box[0] = ev
        ev.wait(0.00001)
        ev.close()
        loops += 1
    print(hits[0], loops, flush=True)
""")


@pytest.mark.slow
def test_a_storm_of_signals_never_hangs_a_loop_that_waits_on_it() -> None:
    """The loop waits while the handler sets, 10,000 times; a last signal still ends it."""
    p = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
        for _ in range(10_000):
            os.kill(p.pid, signal.SIGUSR1)
            time.sleep(0.0003)  # spreads the signals over the loop, not a synchronisation
        os.kill(p.pid, signal.SIGUSR2)
        out, _ = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    hits, loops = map(int, out.split())
    assert p.returncode == 0
    assert hits > 0 and loops > 0
