"""Subprocess body for the crash tests: stages records and prints each LOCAL ack.

    python -m tests.stage.stage_worker DIR MODE [N]

MODE ``loop``: append records ``rec-<i>`` forever (the parent SIGKILLs us).
MODE ``exit-after-acks``: append N, wait for every ack, then os._exit (no close).
MODE ``exit-before-cursor``: append N, then crash inside the first seal after the
segment is committed but before the WAL cursor moves.
"""

from __future__ import annotations

import os
import sys
import threading
from datetime import timedelta

from tieredbuf.config import SegmentConfig, StageConfig, WalConfig
from tieredbuf.stage.stage import Stage
from tieredbuf.stage.wal import WalWriter


def main() -> None:
    d, mode = sys.argv[1], sys.argv[2]
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    cfg = StageConfig(
        wal=WalConfig(flush_interval=timedelta(milliseconds=2), rotation_target=64 << 10),
        segment=SegmentConfig(target_size=32 << 10, max_open_duration=timedelta(seconds=60)),
    )
    stage = Stage(d, "p", cfg)
    out = threading.Condition()
    printed = 0

    def acked(i: int) -> None:
        nonlocal printed
        with out:
            sys.stdout.write(f"{i}\n")
            sys.stdout.flush()
            printed += 1
            out.notify_all()

    if mode == "exit-before-cursor":

        def boom(self: WalWriter, position: int) -> None:
            os._exit(3)

        WalWriter.advance_cursor = boom  # type: ignore[method-assign]
    i = 0
    futs = []
    while mode == "loop" or i < n:
        f = stage.append_records([f"rec-{i}".encode()], f"m{i}".encode())
        f.add_done_callback(lambda _f, i=i: acked(i))
        futs.append(f)
        i += 1
    for f in futs:
        f.result(timeout=30)
    with out:  # callbacks run after result() returns: wait until every ack is printed
        out.wait_for(lambda: printed == len(futs), timeout=30)
    if mode == "exit-before-cursor":
        stage.seal_all()
    os._exit(0)


if __name__ == "__main__":
    main()
