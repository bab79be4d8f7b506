"""What the sealed-segment CRC costs, against what sealing and exporting already do.

For one 32 MiB ``.batch`` segment (the default ``target_size``) built from produce()
calls of 100 x 1 KiB and 4 x 64 KiB records, each repetition times, alternating:

* ``seal``: what ``SegmentDir.prepare`` does to the bytes -- ``writev`` of the parts
  to a new file and ``fdatasync`` (the baseline of the seal-time figure);
* ``seal_crc``: the CRC32 over the same parts that ``prepare`` now adds;
* ``read``: ``Path.read_bytes`` of the sealed file (the exporter reads it anyway;
  the baseline of the upload-time figure);
* ``verify``: the CRC32 over those bytes that the exporter now adds before upload
  (``segments.verify``).  Start-up verification is ``read`` + ``verify`` per segment.

Prints medians and the ratios ``seal_crc / seal`` and ``verify / read``; writes
``bench/results/crc.json``.  Run under ``flock /tmp/tieredbuf-bench.lock``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import machine_info, print_table, write_json
from tieredbuf.format.batch import interleave_lengths
from tieredbuf.stage.filesystem import write_all

SEGMENT = 32 << 20


def parts_for(record: int, per_call: int) -> list[bytes | memoryview]:
    """The parts prepare() hands to writev: one block per produce() call."""
    call = b"".join(interleave_lengths([os.urandom(record)] * per_call))
    return [call] * (SEGMENT // len(call))


def once(parts: list[bytes | memoryview], d: Path) -> dict[str, float]:
    path = d / "seg.batch"
    out: dict[str, float] = {}
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
    try:
        write_all(fd, parts)
        os.fdatasync(fd)
    finally:
        os.close(fd)
    out["seal"] = time.perf_counter() - t
    t = time.perf_counter()
    crc = 0
    for p in parts:
        crc = zlib.crc32(p, crc)
    out["seal_crc"] = time.perf_counter() - t
    t = time.perf_counter()
    data = path.read_bytes()
    out["read"] = time.perf_counter() - t
    t = time.perf_counter()
    assert zlib.crc32(data) == crc
    out["verify"] = time.perf_counter() - t
    path.unlink()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--tmpdir")
    args = ap.parse_args()
    rows, results = [], {}
    with tempfile.TemporaryDirectory(dir=args.tmpdir) as tmp:
        for label, record, per_call in (("1KiB x100", 1024, 100), ("64KiB x4", 65536, 4)):
            parts = parts_for(record, per_call)
            runs = [once(parts, Path(tmp)) for _ in range(args.repeat)]
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            results[label] = {
                "median_s": med,
                "parts": len(parts),
                "seal_crc_over_seal": med["seal_crc"] / med["seal"],
                "verify_over_read": med["verify"] / med["read"],
            }
            rows.append(
                [
                    label,
                    len(parts),
                    *(f"{med[k] * 1000:.1f}" for k in ("seal", "seal_crc", "read", "verify")),
                    f"{med['seal_crc'] / med['seal']:.2f}",
                    f"{med['verify'] / med['read']:.2f}",
                ]
            )
    print(
        f"one 32 MiB .batch segment, median of {args.repeat}; load average {os.getloadavg()[0]:.2f}"
    )
    print_table(
        [
            "segment",
            "parts",
            "seal ms",
            "+crc ms",
            "read ms",
            "+verify ms",
            "crc/seal",
            "verify/read",
        ],
        rows,
    )
    write_json("crc", {"machine": machine_info(), "load_avg": os.getloadavg(), "results": results})


if __name__ == "__main__":
    main()
