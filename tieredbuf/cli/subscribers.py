"""``tieredbuf subscribers``: list a buffer's subscribers, or remove one.

tieredbuf subscribers URL [--json]        position, lag (entries, bytes, age), epoch,
                                          last activity, lost; shared work queues'
                                          leases and rejected entries
tieredbuf subscribers remove URL NAME     unregister NAME (releases what it held)
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import TextIO

import tieredbuf
from tieredbuf.cli._common import plural
from tieredbuf.errors import ConfigError

EXIT_OK, EXIT_PARTIAL = 0, 1


def _ago(ms: int | None, now_ms: int) -> str:
    return "-" if ms is None else f"{max(0, now_ms - ms) / 1000:.1f}s ago"


def cmd_subscribers(
    args: argparse.Namespace,
    out: TextIO,
    open_buffer: Callable[[argparse.Namespace], tieredbuf.Buffer],
) -> int:
    """``tieredbuf subscribers URL [--json]`` and ``tieredbuf subscribers remove URL NAME``."""
    words = list(args.words)
    if words[0] == "remove":
        if len(words) != 3:
            raise ConfigError("usage: tieredbuf subscribers remove URL NAME")
        args.url, name = words[1], words[2]
        buf = open_buffer(args)
        if not buf.exists():
            raise tieredbuf.BufferNotFoundError(buf.url)
        removed = buf.remove_subscriber(name)
        out.write(f"{'removed' if removed else 'no such subscriber'} {name!r}\n")
        return EXIT_OK if removed else EXIT_PARTIAL
    if len(words) != 1:
        raise ConfigError(
            "usage: tieredbuf subscribers URL [--json] | tieredbuf subscribers remove URL NAME"
        )
    args.url = words[0]
    subs = open_buffer(args).subscribers()
    if args.json:
        out.write(json.dumps([s.as_dict() for s in subs]) + "\n")
        return EXIT_OK
    now = time.time_ns() // 1_000_000
    rows = [("name", "kind", "next", "lag", "lag bytes", "lag age", "epoch", "active", "lost")]
    for s in subs:
        age = "-" if s.lag_seconds is None else f"{s.lag_seconds:.1f}s"
        lost = str(s.lost) + (f" (+{s.lost_now} unlinked)" if s.lost_now else "")
        rows.append(
            (
                s.name,
                "shared" if s.shared else "stream",
                str(s.next_sequence),
                str(s.lag_entries),
                str(s.lag_bytes),
                age,
                str(s.epoch),
                _ago(s.last_activity_ms, now),
                lost,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        out.write("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() + "\n")
    for s in subs:
        if s.work is not None:
            w = s.work
            out.write(
                f"{s.name}: {w['leased']} leased, {w['claimable_again']} to redeliver, "
                f"claim cursor {w['claim_cursor']}, "
                f"{w['workers']} {plural(w['workers'], 'worker')}, "
                f"{w['rejected_total']} rejected\n"
            )
        for rej in s.rejected[-20:]:
            reason = rej.reason.decode("utf-8", "backslashreplace")
            out.write(f"  rejected {rej.seq} after {rej.deliveries} deliveries: {reason}\n")
        if len(s.rejected) > 20 or (s.work and s.work["rejected_total"] > len(s.rejected)):
            out.write(
                f"  ... {s.work['rejected_total'] if s.work else len(s.rejected)} in "
                "all; --json lists the most recent 256\n"
            )
    if not subs:
        out.write("no subscribers\n")
    return EXIT_OK


def cmd(args: argparse.Namespace, out: TextIO) -> int:
    from tieredbuf.cli._common import open_buffer

    return cmd_subscribers(args, out, open_buffer)
