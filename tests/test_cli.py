"""The ``tieredbuf`` command: demo, produce, consume, inspect, gc, exit codes."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

import tieredbuf
from tieredbuf.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE, main

# a pass over an unchanged buffer: the root read by the subscribers' publication and by
# the snapshot, and the three listings; no group is read again
UNCHANGED_PASS = {"get/root": 2, "list/data": 1, "list/group": 1, "list/subscriber": 1}


def _run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    code = main(list(argv), out=out)
    return code, out.getvalue()


@pytest.mark.slow
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
    # a shorter --grace than the buffer's is not honoured: nothing is deleted yet
    code, text = _run("gc", url, "--grace", "0s", "--json")
    report = json.loads(text)
    assert code == EXIT_OK and report["deleted"] == 0 and report["grace_override_ignored"]
    assert report["grace_ms"] == 600_000
    # shortening the buffer's own grace period (in its root) is what lets GC delete sooner
    assert _run("grace", url, "0s")[0] == EXIT_USAGE  # under 2 x link deadline: refused
    code, text = _run("grace", url, "0s", "--force")
    assert code == EXIT_OK and text.strip() == "0:00:00"
    code, text = _run("gc", url, "--json")
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


def test_parse_size_and_duration() -> None:
    from tieredbuf.cli import parse_duration, parse_size

    assert parse_size("1048576") == 1 << 20
    assert parse_size("64k") == parse_size("64KiB") == 64 << 10
    assert parse_size("16MiB") == parse_size("16m") == 16 << 20
    assert parse_size("1.5G") == 3 << 29
    assert parse_duration("50ms").total_seconds() == 0.05
    import argparse

    with pytest.raises(argparse.ArgumentTypeError):
        parse_size("lots")


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_line_draws_only_on_a_tty_and_erases_itself() -> None:
    from tieredbuf.cli import Progress

    plain = io.StringIO()
    with Progress("gc", stream=plain, interval=0) as bar:
        bar.update(5)
    assert plain.getvalue() == ""
    tty = _Tty()
    with Progress("drain", total=4, stream=tty, interval=0) as bar:
        bar.update(1, "data/x.batch")
        bar.update(3)
    text = tty.getvalue()
    assert "drain [#####" in text and "1/4  data/x.batch" in text and "4/4" in text
    assert text.endswith("\r") and text.count("\n") == 0


def test_inspect_shows_depth_tree_levels_epoch_and_oldest_age(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/b"
    src = tmp_path / "in.txt"
    src.write_text("".join(f"r{i}\n" for i in range(30)))
    t0_ms = time.time_ns() // 1_000_000
    _run("produce", url, str(src), "--batch", "10", "--flush-interval", "1ms")
    buf = tieredbuf.open(url)
    snap = buf.snapshot()
    entries = list(snap.iter_from(snap.head))
    oldest = min(md.ingestion_time_ms for md in entries[0].metadata)  # the head entry
    before_ms = time.time_ns() // 1_000_000
    info = json.loads(_run("inspect", url, "--json")[1])
    after_ms = time.time_ns() // 1_000_000
    assert info["depth"] == len(entries) >= 1 and info["tree_levels"] == 1
    assert info["tree"] == {"root_entries": len(entries)} and info["epoch"] == 0
    assert info["stored_objects"] == len(entries) and info["missing_objects"] == 0
    # the oldest record's age as inspect saw it: between the two clock reads around it
    assert t0_ms <= oldest
    assert (before_ms - oldest) / 1000 - 0.001 <= info["oldest_age_s"]
    assert info["oldest_age_s"] <= (after_ms - oldest) / 1000 + 0.001
    quick = json.loads(_run("inspect", url, "--json", "--quick")[1])
    assert "missing_objects" not in quick and quick["depth"] == info["depth"]
    code, text = _run("inspect", url)
    assert code == EXIT_OK and "tree_levels" in text and "root_entries" in text


def test_inspect_json_reports_the_requests_it_sent(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/b"
    src = tmp_path / "in.txt"
    src.write_text("".join(f"r{i}\n" for i in range(30)))
    _run("produce", url, str(src), "--batch", "10", "--flush-interval", "1ms")
    full = json.loads(_run("inspect", url, "--json")[1])["requests"]
    # one root GET and one LIST of data/ (one page); nothing written
    assert full["requests"] == {"get": {"root": 1}, "list": {"data": 1}}
    assert full["total"] == 2 and full["conflicts"] == {}
    quick = json.loads(_run("inspect", url, "--json", "--quick")[1])["requests"]
    assert quick["requests"] == {"get": {"root": 1}} and quick["by_kind"] == {"root": 1}
    code, text = _run("inspect", url, "--quick")
    assert code == EXIT_OK and "requests" in text and "total 1, get 1" in text


def test_gc_runs_concurrently_with_itself_and_writes_metrics(tmp_path: Path) -> None:
    import threading

    url = f"file://{tmp_path}/b"
    src = tmp_path / "in.txt"
    src.write_text("a\nb\nc\n")
    _run("produce", url, str(src), "--batch", "1", "--flush-interval", "1ms")
    _run("consume", url)  # all acked and dequeued: the objects are garbage
    tieredbuf.open(url).set_gc_grace_period(timedelta(0), force=True)
    results: list[tuple[int, str]] = []
    threads = [
        threading.Thread(target=lambda: results.append(_run("gc", url, "--json"))) for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(code == EXIT_OK for code, _ in results), results
    deleted = {k for _, text in results for k in json.loads(text)["deleted_keys"]}
    assert deleted and not list((tmp_path / "b" / "data").iterdir())
    prom = tmp_path / "gc.prom"
    code, text = _run("gc", url, "--json", "--metrics-file", str(prom))
    assert code == EXIT_OK and json.loads(text)["deleted"] == 0
    body = prom.read_text()
    assert "tieredbuf_gc_runs_total 1.0" in body
    assert "tieredbuf_gc_deleted_objects_total 0.0" in body
    assert "tieredbuf_gc_last_run_timestamp_seconds" in body
    assert f"tieredbuf_gc_requests_total {sum(UNCHANGED_PASS.values())}.0" in body


@pytest.mark.slow
def test_gc_loop_caches_groups_across_passes_and_stops_on_sigterm(tmp_path: Path) -> None:
    import signal

    from tieredbuf.config import TreeConfig

    url = f"file://{tmp_path}/b"
    with tieredbuf.open(url, tree=TreeConfig(m=2)).producer(  # m=2: the root links groups
        flush_interval=timedelta(milliseconds=1)
    ) as p:
        for i in range(12):
            p.produce([b"r%d" % i]).wait(timeout=60)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tieredbuf.cli", "gc", url, "--loop", "100ms", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        reports = [json.loads(proc.stdout.readline()) for _ in range(3)]
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == EXIT_OK, proc.stderr.read() if proc.stderr else ""
    assert all(r["referenced"] == reports[0]["referenced"] > 0 for r in reports)
    assert reports[0]["groups_read"] == reports[0]["requests"]["get/group"] > 0
    for later in reports[1:]:  # nothing changed: the root and the two listings only
        assert later["groups_read"] == 0
        assert later["requests"] == UNCHANGED_PASS


@pytest.mark.slow
def test_drain_takes_over_every_worker_stage_of_a_dead_service(tmp_path: Path) -> None:
    import os
    import signal

    import tieredbuf

    url = f"file://{tmp_path}/b"
    root = tmp_path / "stage"
    worker = Path(__file__).with_name("staged_worker.py")
    acked: list[str] = []
    for i in range(2):  # two "workers", each killed -9 after a few LOCAL acks
        proc = subprocess.Popen(
            [sys.executable, str(worker), url, str(root / f"worker-{i}"), str(i)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            acked.append(line[4:].strip())
            if len(acked) >= 5 * (i + 1):
                break
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        proc.stdout.close()
    code, text = _run("drain", str(root), url)
    assert code == EXIT_OK and text.count("stage empty") == 2, text
    c = tieredbuf.open(url).consumer()
    c.initialize()
    seen = []
    while (b := c.next_batch()) is not None:
        seen.extend(r.decode() for r in b.entries)
    assert set(acked) <= set(seen) and len(seen) == len(set(seen))


def test_serve_with_a_bad_url_is_a_usage_error(tmp_path: Path) -> None:
    code, _ = _run("serve", "ftp://nope/x", "--staging", str(tmp_path / "s"), "--port", "0")
    assert code == EXIT_USAGE
