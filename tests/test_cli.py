"""The ``tieredbuf`` command: demo, produce, consume, inspect, gc, exit codes."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tieredbuf.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE, main


def _run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    code = main(list(argv), out=out)
    return code, out.getvalue()


def test_demo_runs_as_the_installed_console_script(tmp_path: Path) -> None:
    exe = shutil.which("tieredbuf") or str(Path(sys.executable).with_name("tieredbuf"))
    r = subprocess.run([exe, "demo"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "consumed 500 records" in r.stdout
    assert "queue depth now 0" in r.stdout
    assert any((tmp_path / "demo-buffer" / "data").iterdir())


def test_produce_consume_inspect_gc_round_trip(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/b"
    src = tmp_path / "in.txt"
    src.write_text("".join(f"line {i}\n" for i in range(25)))
    code, text = _run("produce", url, str(src), "--batch", "10", "--flush-interval", "1ms")
    assert code == EXIT_OK and "produced 25 records in 3 calls" in text
    code, text = _run("inspect", url, "--json")
    info = json.loads(text)
    assert info["depth"] >= 1 and info["queued_bytes"] > 0 and info["missing_objects"] == 0
    code, text = _run("consume", url)
    assert code == EXIT_OK
    assert text.splitlines() == [f"line {i}" for i in range(25)]
    assert json.loads(_run("inspect", url, "--json")[1])["depth"] == 0
    code, text = _run("gc", url, "--grace", "0s", "--json")
    assert code == EXIT_OK and json.loads(text)["deleted"] == info["stored_objects"]


def test_consume_to_files_writes_one_file_per_batch(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/b"
    src = tmp_path / "in.txt"
    src.write_text("a\nb\n")
    _run("produce", url, str(src))
    code, _ = _run("consume", url, "--out", str(tmp_path / "out"))
    assert code == EXIT_OK
    (f,) = (tmp_path / "out").iterdir()
    from tieredbuf.format.batch import decode_batch

    assert decode_batch(f.read_bytes()) == [b"a", b"b"]


def test_bad_usage_and_bad_urls_have_distinct_exit_codes(tmp_path: Path) -> None:
    assert _run("inspect", "ftp://nope/x")[0] == EXIT_USAGE
    with pytest.raises(SystemExit) as e:
        main(["gc", "memory://", "--grace", "ten minutes"])
    assert e.value.code == 2
    # a corrupt manifest is a failure of the data, exit 3
    root = tmp_path / "b" / "queue"
    root.mkdir(parents=True)
    (root / "manifest").write_bytes(b"\x00" * 30)
    assert _run("inspect", f"file://{tmp_path}/b")[0] == EXIT_FAILED
