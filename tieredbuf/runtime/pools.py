"""Thread pools whose threads all start at once.

A :class:`~concurrent.futures.ThreadPoolExecutor` starts a thread per submit until it
has ``max_workers``: its thread count climbs to the bound at the first moment that many
tasks overlap, which can be minutes into a run. A bounded pool is not a leak, but a
thread count that grows late looks like one (the soak, ``bench/soak.py``, checks that it
stays flat after warm-up), so every long-lived pool here starts all its threads when it
is made: the count is flat from the start and the bound is visible at once.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor


def started_pool(workers: int, thread_name_prefix: str) -> ThreadPoolExecutor:
    """A pool of ``workers`` threads, every one of them already running."""
    pool = ThreadPoolExecutor(workers, thread_name_prefix=thread_name_prefix)
    gate = threading.Barrier(workers)
    # each task blocks until all have a thread of their own: the pool must start them all
    for f in [pool.submit(gate.wait, 30) for _ in range(workers)]:
        f.result()
    return pool
