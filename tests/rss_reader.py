"""A consumer in a process of its own, for the read-ahead memory test (tests/test_memory.py).

    python -m tests.rss_reader URL READ_AHEAD_BYTES [worker]

Drains the buffer at URL, dropping each batch before asking for the next, and prints one
JSON line: the entries and bytes read, the resident set size when the reader was ready
to read (``base``) and its peak while reading (``peak``), in bytes.  The peak is Linux's
VmHWM, reset to the current RSS at the start (``/proc/self/clear_refs``), so what setting
up cost is not counted.
"""

from __future__ import annotations

import gc
import json
import sys


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def main() -> None:
    import tieredbuf

    url, budget = sys.argv[1], int(sys.argv[2])
    role = sys.argv[3] if len(sys.argv) > 3 else "consumer"
    buf = tieredbuf.open(url)
    reader = (
        buf.worker("rss", read_ahead_bytes=budget)
        if role == "worker"
        else buf.consumer(read_ahead_bytes=budget)
    )
    if role == "worker":
        reader.initialize()
        take = reader.claim
    else:
        reader.initialize()
        take = reader.next_batch
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    base = _status("VmRSS")
    entries = nbytes = 0
    while True:
        b = take()
        if b is None:
            break
        entries += 1
        nbytes += len(b.data)
        if role == "worker":
            reader.ack(b.sequence)
        del b
    peak = _status("VmHWM")
    reader.close()
    print(json.dumps({"entries": entries, "bytes": nbytes, "base": base, "peak": peak}))


if __name__ == "__main__":
    main()
