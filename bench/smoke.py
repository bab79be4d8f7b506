"""Every benchmark in a smoke mode of a few seconds, so that none can rot unseen.

CI runs this after the test suites.  Each script runs as a child process with small
sizes (the figures mean nothing at these sizes: only that the script runs to its end,
prints its table and writes its JSON), against this tree only (no baseline tree).
A script that exits non-zero, or runs past its time limit, fails the run.

    python bench/smoke.py                 # all of them (a few minutes)
    python bench/smoke.py core tree       # some of them
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent

SMOKE: dict[str, list[str]] = {
    "compression": ["--mib", "1", "--repeat", "1", "--sizes", "1024", "--data", "text"],
    "core": ["--quick", "--backends", "local", "--records", "2000", "--latency-seconds", "2"],
    "cost": ["--gib", "0.004", "--sizes", "1024", "--producers", "1", "--store", "local"],
    "crc": ["--repeat", "1"],
    "fanin": ["--smoke", "--no-baseline"],
    "fanin_service": ["--smoke"],
    "peers": [
        "--quick",
        "--stores",
        "local",
        "--sizes",
        "1024",
        "--seconds",
        "0.5",
        "--seconds-lat",
        "1",
        "--warmup",
        "0.2",
    ],
    "readers": ["--smoke"],
    "service": ["--store", "local", "--requests", "40", "--low-seconds", "1", "--time-cap", "20"],
    "soak": [
        "--duration",
        "6",
        "--warmup",
        "1",
        "--sample",
        "0.5",
        "--rate",
        "200",
        "--json",
        "soak-smoke",
    ],
    "spark_read": [
        "--rows",
        "20000",
        "--objects",
        "4",
        "--repeats",
        "1",
        "--latency-records",
        "2",
        "--latency-producers",
        "1,4",
        "--idle-caps",
        "200",
        "--idle-records",
        "1",
        "--idle-s",
        "0.5",
        "--idle-tail-s",
        "1",
        "--planning-sizes",
        "1000",
        "--planning-triggers",
        "2",
    ],
    "stage": ["--quick", "--produce-mib", "4", "--bundle-mib", "4", "--replay-mib", "4"],
    "subscribers": [
        "--entries",
        "100",
        "--seconds",
        "2",
        "--workers",
        "2",
        "--claim-batch",
        "8",
        "--producers",
        "1",
        "--subscribers",
        "1",
        "--round-trips",
        "loopback",
    ],
    "tree": ["--quick"],
    "verify": ["--entries", "60", "--object-kib", "1", "--stores", "local"],
    "worker_idle": ["--idle", "3", "--rounds", "1"],
}
"""Per script: the arguments that make it a smoke run."""
LIMIT_S = 600.0


def main(argv: list[str]) -> int:
    names = argv or sorted(SMOKE)
    unknown = [n for n in names if n not in SMOKE]
    if unknown:
        print(f"no smoke run for {unknown}; known: {sorted(SMOKE)}", file=sys.stderr)
        return 2
    missing = sorted(
        p.stem for p in BENCH.glob("[a-z]*.py") if p.stem not in SMOKE and p.stem != "smoke"
    )
    if missing and not argv:
        print(f"bench scripts with no smoke run: {missing}", file=sys.stderr)
        return 2
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    failed = []
    for name in names:
        cmd = [sys.executable, str(BENCH / f"{name}.py"), *SMOKE[name]]
        t0 = time.monotonic()
        try:
            r = subprocess.run(
                cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=LIMIT_S
            )
            rc, out = r.returncode, r.stdout + r.stderr
        except subprocess.TimeoutExpired as e:
            rc, out = -1, f"timed out after {LIMIT_S:.0f} s\n{e.stdout or ''}{e.stderr or ''}"
        took = time.monotonic() - t0
        print(
            f"bench/{name}.py: {'ok' if rc == 0 else f'FAILED ({rc})'} in {took:.1f} s", flush=True
        )
        if rc != 0:
            failed.append(name)
            print("\n".join(str(out).splitlines()[-40:]), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
