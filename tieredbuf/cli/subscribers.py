"""``tieredbuf subscribers``: list a buffer's subscribers, or remove one.

tieredbuf subscribers URL [--json]        position, lag (entries, bytes, age), epoch,
                                          last activity, lost; shared work queues'
                                          leases and rejected entries
tieredbuf subscribers remove URL NAME     unregister NAME (releases what it held)
tieredbuf subscribers redrive URL QUEUE [--sequences 3,7-9] [--drop]
                                          send the work queue's dead letters back
                                          (claimable again, delivery count reset), or
                                          --drop them (the buffer may unlink them)
"""

from __future__ import annotations

import argparse
import dataclasses
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
    if words[0] == "redrive":
        return _redrive(args, words, out, open_buffer)
    if args.sequences is not None or args.drop:
        raise ConfigError("--sequences and --drop go with: tieredbuf subscribers redrive")
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
                f"{w['waiting']} waiting to be redelivered, claim cursor {w['claim_cursor']}, "
                f"{w['workers']} {plural(w['workers'], 'worker')}, {w['rejected_total']} rejected "
                f"({w['rejected_kept']} kept for redrive)\n"
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


def parse_sequences(text: str) -> list[int]:
    """``3,7-9`` -> [3, 7, 8, 9] (a clear error on anything else)."""
    out: list[int] = []
    for part in text.split(","):
        a, _, b = part.strip().partition("-")
        if not a.isdigit() or (b and not b.isdigit()):
            raise ConfigError(f"--sequences: {part!r} is not a sequence or a range like 7-9")
        lo, hi = int(a), int(b or a)
        if hi < lo or hi - lo > 1 << 16:
            raise ConfigError(f"--sequences: bad range {part!r}")
        out.extend(range(lo, hi + 1))
    return out


def _redrive(
    args: argparse.Namespace,
    words: list[str],
    out: TextIO,
    open_buffer: Callable[[argparse.Namespace], tieredbuf.Buffer],
) -> int:
    if len(words) != 3:
        raise ConfigError(
            "usage: tieredbuf subscribers redrive URL QUEUE [--sequences 3,7-9] [--drop]"
        )
    args.url, name = words[1], words[2]
    seqs = None if args.sequences is None else parse_sequences(args.sequences)
    buf = open_buffer(args)
    r = buf.redrive(name, seqs, drop=args.drop)
    if args.json:
        out.write(json.dumps({k: list(v) for k, v in dataclasses.asdict(r).items()}) + "\n")
    else:
        for what, seqs_ in (
            ("redriven (claimable again)", r.redriven),
            ("dropped (the buffer may unlink them)", r.dropped),
            ("not redriven: retention already unlinked them", r.unlinked),
            ("not a kept dead letter of this queue", r.not_found),
        ):
            if seqs_:
                out.write(f"{what}: {', '.join(map(str, seqs_))}\n")
        if not (r.redriven or r.dropped or r.unlinked or r.not_found):
            out.write(f"no dead letters in {name!r}\n")
    return EXIT_PARTIAL if r.unlinked or r.not_found else EXIT_OK


def cmd(args: argparse.Namespace, out: TextIO) -> int:
    from tieredbuf.cli._common import open_buffer

    return cmd_subscribers(args, out, open_buffer)
