"""Keep freed heap memory for reuse instead of handing it back to the OS (glibc only).

A staged producer joins each call's small records into one WAL body (one CRC, one
iovec; ``format/wal.entry_body``) and keeps those bodies until their segment is
sealed -- 32 MiB by default -- then frees them all at once.  glibc returns the top of
a heap to the kernel once more than ``M_TRIM_THRESHOLD`` (128 KiB by default) is free
there, so every body of the next segment lands in fresh pages: page faults and
zeroing with the GIL held, ~80 us per 100 KiB call against ~3 us for the join itself
(docs/architecture.md).  :func:`keep_freed_heap` raises the trim threshold (and fixes
the mmap threshold, which setting the trim threshold stops glibc from adapting) so
that memory is reused.

This is process-wide and only changes *when* glibc returns freed memory: the heap
stays at its high-water mark (bounded by the stage's ``max_open_bytes`` and the other
caps) instead of shrinking after each seal.  It is skipped when the environment sets
either threshold (``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_THRESHOLD_``, or
``GLIBC_TUNABLES``: the operator's choice wins), on a C library without ``mallopt``,
and with ``StageConfig(keep_freed_memory=False)``.
"""

from __future__ import annotations

import ctypes
import os
import threading

TRIM_THRESHOLD = 64 << 20
"""Free bytes at a heap's top that glibc keeps before trimming it (two segments' worth)."""
MMAP_THRESHOLD = 4 << 20
"""Allocations at least this large are mmapped (and unmapped when freed) as before."""
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_ENV = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")

_lock = threading.Lock()
_done: bool | None = None


def heap_kept() -> bool | None:
    """What :func:`keep_freed_heap` decided in this process: True (raised), False (not
    raised: another C library, or the environment decides), None (not asked yet)."""
    return _done


def keep_freed_heap(environ: dict[str, str] | None = None) -> bool:
    """Raise glibc's trim threshold once per process; True if it is raised (now or
    before), False where it is not (another C library, or the environment decides)."""
    global _done
    env = os.environ if environ is None else environ
    with _lock:
        if _done is not None:
            return _done
        if any(k in env for k in _ENV):
            _done = False
            return False
        try:
            mallopt = ctypes.CDLL(None).mallopt
        except (OSError, AttributeError):
            _done = False
            return False
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        mallopt.restype = ctypes.c_int
        # mallopt returns 1 on success; the mmap threshold first (it caps the other)
        _done = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
            mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
        )
        return _done
