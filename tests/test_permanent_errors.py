"""Permanent errors are not retried as transient: a store directory no file system
will create, and a corrupt root, fail a command at once naming the cause, instead of
being retried until ``--timeout``."""

from __future__ import annotations

from pathlib import Path

import tieredbuf
from tests.test_cli_first_hour import no_traceback, tb


def test_a_store_directory_the_file_system_refuses_is_permanent(tmp_path: Path) -> None:
    r = tb(["produce", "file:///proc/tieredbuf-nope", "--timeout", "20s"], tmp_path, stdin="a\n")
    no_traceback(r)
    assert r.returncode == 3, r.stderr
    assert "still failed after --timeout" not in r.stderr, "retried as transient: " + r.stderr
    assert "PermanentStoreError" in r.stderr and "/proc/tieredbuf-nope" in r.stderr, r.stderr
    assert "retrying" not in r.stderr, r.stderr


def test_I7_produce_to_a_corrupt_root_fails_at_once_naming_it(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/b"
    r = tb(["produce", url], tmp_path, stdin="a\n")
    assert r.returncode == 0, r.stderr
    (tmp_path / "b" / "queue" / "manifest").write_bytes(b"not a manifest at all")
    assert tieredbuf.open(url).exists()
    r = tb(["produce", url, "--timeout", "10s"], tmp_path, stdin="b\n")
    no_traceback(r)
    assert r.returncode == 3, r.stderr
    assert "corrupt" in r.stderr and "still failed after --timeout" not in r.stderr, r.stderr
