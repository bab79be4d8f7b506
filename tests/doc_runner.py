"""Run one page's snippets in order, as a reader types them: ``python doc_runner.py SPEC``.

SPEC is a JSON file ({"blocks": [{"id", "lang", "code", "continues"}], "timeout"})
written by tests/test_docs_snippets.py, which also sets the working directory and the
environment.  Like a reader's shell session:

* a ``python`` block runs in a fresh namespace (in this process, so a Spark session or
  a buffer a block made stays for the next one), or in the previous python block's
  namespace when ``continues``;
* a ``bash`` block runs under ``bash -euo pipefail``; what it exports (``export
  AWS_ENDPOINT_URL=...``) is in the environment of every later block, python ones
  included;
* a process a bash block leaves running in the background (``moto_server ... &``)
  keeps running for the later blocks, and is stopped when the page ends.

Exit status 0 when every block ran; otherwise 1, after the failing block's traceback
or output.  Only the standard library: this runs in a bare interpreter.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import traceback
from typing import Any

_SHELL_ONLY = {"PWD", "OLDPWD", "SHLVL", "_"}


def _stop(groups: list[int]) -> None:
    """Stop what the page left running: each bash block's process group."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pg in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pg, sig)
        if sig == signal.SIGTERM:
            _wait_gone(groups)


def _wait_gone(groups: list[int], seconds: float = 5.0) -> None:
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        alive = False
        for pg in groups:
            try:
                os.killpg(pg, 0)
                alive = True
            except (ProcessLookupError, PermissionError):
                pass
        if not alive:
            return
        time.sleep(0.05)  # polling for exits against a deadline


def _run_bash(block: dict[str, Any], groups: list[int], timeout: float) -> None:
    with tempfile.NamedTemporaryFile(prefix="doc-env-", delete=False) as f:
        env_file = f.name
    try:
        # the block, then its environment (to carry its exports to the next blocks)
        script = f"{block['code']}\nenv -0 > {env_file}\n"
        p = subprocess.Popen(["bash", "-euo", "pipefail", "-c", script], process_group=0)
        groups.append(p.pid)
        try:
            code = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"{block['id']}: still running after {timeout:.0f} s") from None
        if code != 0:
            raise SystemExit(f"{block['id']}: exited {code}")
        with open(env_file, "rb") as f:
            raw = f.read()
    finally:
        os.unlink(env_file)
    after = dict(kv.split("=", 1) for kv in raw.decode().split("\0") if "=" in kv)
    for name, value in after.items():
        if name not in _SHELL_ONLY and os.environ.get(name) != value:
            os.environ[name] = value


def main(spec_path: str) -> int:
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("doc_runner: terminated"))
    groups: list[int] = []
    ns: dict[str, Any] = {}
    try:
        for block in spec["blocks"]:
            print(f"\n--- {block['id']} ({block['lang']})", flush=True)
            if block["lang"] == "python":
                if not block["continues"]:
                    ns = {"__name__": "__main__"}
                exec(compile(block["code"], block["id"], "exec"), ns)
            else:
                _run_bash(block, groups, spec["timeout"])
            sys.stdout.flush()
            sys.stderr.flush()
    except SystemExit as e:
        print(f"doc_runner: {e.code}", file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        _stop(groups)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
