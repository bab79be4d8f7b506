"""What a newcomer meets on the command line: a stage belongs to one buffer, a
read-only consume never fences, a typo never makes or reads an empty buffer, and
consume handles Arrow bundles.  Each test runs the real ``tieredbuf`` executable."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest

import tieredbuf
from tieredbuf.cli import EXIT_OK, EXIT_USAGE

EXE = shutil.which("tieredbuf") or str(Path(sys.executable).with_name("tieredbuf"))
WORKER = Path(__file__).with_name("staged_worker.py")


def tb(
    *argv: str, cwd: Path | None = None, timeout: float = 120, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [EXE, *argv], cwd=cwd, capture_output=True, text=True, timeout=timeout, input=stdin
    )


def _kill_after_local_acks(url: str, stage: Path, run: str, n: int) -> list[str]:
    """A staged producer process, SIGKILLed once ``n`` records are LOCAL-acked."""
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), url, str(stage), run], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    acked = []
    for line in proc.stdout:
        acked.append(line[4:].strip())
        if len(acked) >= n:
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
    proc.stdout.close()
    return acked


def _read_all(url: str) -> list[str]:
    buf = tieredbuf.open(url)
    if not buf.exists():
        return []
    return [
        r.decode()
        for e in buf.reader()
        for r in tieredbuf.ConsumedBatch(
            e.sequence, e.location, e.metadata, buf.read_object(e)
        ).entries
    ]


# --- 1. a stage belongs to one buffer ----------------------------------------------------


@pytest.mark.slow
def test_I1_a_killed_producers_stage_is_refused_for_another_buffer(tmp_path: Path) -> None:
    a, b = f"file://{tmp_path}/A", f"file://{tmp_path}/B"
    stage = tmp_path / "stage"
    acked = _kill_after_local_acks(a, stage, "r", 5)
    r = tb("drain", str(stage), b)
    assert r.returncode == EXIT_USAGE, r.stdout + r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "holds records for" in err[0] and str(tmp_path / "A") in err[0]
    assert f"not for the buffer at file://{tmp_path / 'B'}:" in err[0], err
    assert _read_all(b) == []  # nothing went to B
    # a staged producer opened for B is refused too, before it exports anything
    code = (
        "import sys, tieredbuf\n"
        "try:\n"
        f"    tieredbuf.open({b!r}).producer(staging_dir={str(stage)!r})\n"
        "except tieredbuf.errors.StageBufferMismatchError as e:\n"
        "    print('refused:', e); sys.exit(7)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 7 and "refused" in p.stdout, p.stdout + p.stderr
    assert _read_all(b) == []
    # drained into its own buffer, and drain says where
    r = tb("drain", str(stage), a)
    assert r.returncode == EXIT_OK, r.stderr
    assert f"into file://{tmp_path}/A" in r.stdout and "stage empty" in r.stdout
    got = _read_all(a)
    assert set(acked) <= set(got) and len(got) == len(set(got))


def test_an_empty_stage_is_rebound_to_the_next_buffer(tmp_path: Path) -> None:
    a, b = f"file://{tmp_path}/A", f"file://{tmp_path}/B"
    stage = tmp_path / "stage"
    for url, rec in ((a, "x"), (b, "y")):
        code = (
            "import tieredbuf\n"
            f"with tieredbuf.open({url!r}).producer(staging_dir={str(stage)!r}) as p:\n"
            f"    p.produce([b{rec!r}])\n"
        )
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
    assert _read_all(a) == ["x"] and _read_all(b) == ["y"]


def test_the_stage_binding_names_the_buffer_id_once_the_buffer_has_one(tmp_path: Path) -> None:
    a = f"file://{tmp_path}/A"
    stage = tmp_path / "stage"
    _kill_after_local_acks(a, stage, "r", 2)
    r = tb("drain", str(stage), a)
    assert r.returncode == EXIT_OK, r.stderr
    (bound,) = stage.glob("*/buffer.json")
    got = json.loads(bound.read_text())
    assert got["url"] == a
    assert got["buffer_id"] == tieredbuf.open(a).snapshot().buffer_id is not None


def test_a_staged_producer_opens_and_acks_local_while_the_store_is_unreachable(
    tmp_path: Path,
) -> None:
    """The binding check needs no store at open: a stage with records, reopened for
    its own (unreachable) buffer, still opens and acks LOCAL."""
    url = "s3://bucket/prefix"
    stage = tmp_path / "stage"
    opts = (
        "endpoint='http://127.0.0.1:9', region='us-east-1', access_key_id='k', "
        "secret_access_key='s'"
    )
    code = (
        "import tieredbuf\n"
        f"buf = tieredbuf.open({url!r}, {opts})\n"
        f"p = buf.producer(staging_dir={str(stage)!r})\n"
        "p.produce([b'x']).wait(tieredbuf.Durability.LOCAL, timeout=30)\n"
        "print('LOCAL', flush=True)\n"
        "import os; os._exit(0)\n"
    )
    for _ in range(2):  # the second open finds records in the stage
        p = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
        )
        assert p.returncode == 0 and "LOCAL" in p.stdout, p.stderr


@pytest.mark.slow
def test_a_buffer_recreated_at_the_same_url_is_another_buffer(tmp_path: Path) -> None:
    """The stage learns its buffer's id at its first export (opening a stage never
    needs the store); from then on a re-created buffer at the same URL is refused."""
    a = f"file://{tmp_path}/A"
    stage = tmp_path / "stage"
    code = (
        "import tieredbuf\n"
        f"with tieredbuf.open({a!r}).producer(staging_dir={str(stage)!r}) as p:\n"
        "    p.produce([b'seed'])\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    (bound,) = stage.glob("*/buffer.json")
    assert json.loads(bound.read_text())["buffer_id"] == tieredbuf.open(a).snapshot().buffer_id
    _kill_after_local_acks(a, stage, "r", 3)
    shutil.rmtree(tmp_path / "A")
    assert tb("produce", a, stdin="new\n").returncode == 0  # a new buffer, a new id
    r = tb("drain", str(stage), a)
    assert r.returncode == EXIT_USAGE and "holds records for buffer" in r.stderr, r.stderr
    assert _read_all(a) == ["new"]


@pytest.mark.slow
def test_the_demos_default_stage_is_per_url(tmp_path: Path) -> None:
    r1 = tb("demo", "--calls", "5", cwd=tmp_path)
    r2 = tb("demo", "file://./other", "--calls", "5", cwd=tmp_path)
    assert r1.returncode == 0 and r2.returncode == 0, r1.stderr + r2.stderr
    assert "stage: ./demo-stage " in r1.stdout.replace("\n", " ")
    assert "stage: ./demo-stage-" in r2.stdout
    stages = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("demo-stage"))
    assert len(stages) == 2


# --- 2. consume --no-ack is a plain reader ------------------------------------------------


def _produce(url: str, lines: list[str]) -> None:
    r = tb("produce", url, "--flush-interval", "1ms", stdin="".join(f"{x}\n" for x in lines))
    assert r.returncode == 0, r.stderr


@pytest.mark.slow
def test_I4_consume_no_ack_never_fences_the_live_consumer(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/b"
    _produce(url, ["a", "b"])
    _produce(url, ["c"])
    live = tieredbuf.open(url).consumer()
    live.initialize()
    epoch = tieredbuf.open(url).snapshot().footer.epoch
    r = tb("consume", url, "--no-ack")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["a", "b", "c"]
    assert "read (no ack)" in r.stderr
    assert tieredbuf.open(url).snapshot().footer.epoch == epoch
    b = live.next_batch()  # the live consumer is not fenced
    assert b is not None
    live.ack(b.sequence)
    live.flush()
    live.close()
    r = tb("consume", url, "--no-ack", "--from", "1")
    assert r.stdout.splitlines() == ["c"]
    assert tb("consume", url, "--no-ack", "--from", "latest").stdout == ""
    r = tb("consume", url, "--no-ack", "--from", "0")  # dequeued by the live consumer
    assert r.returncode == 3 and "before the first retained sequence 1" in r.stderr
    r = tb("consume", url, "--from", "1")
    assert r.returncode == EXIT_USAGE and "--no-ack" in r.stderr
    assert "never fences" in tb("consume", "--help").stdout.replace("\n", " ")


def _lines_until(stream: object, want: int, deadline: float) -> list[str]:
    got: list[str] = []
    while len(got) < want:
        assert time.monotonic() < deadline, f"only {got}"
        line = stream.readline()  # type: ignore[attr-defined]
        if not line:
            break
        got.append(line.rstrip("\n"))
    return got


@pytest.mark.slow
@pytest.mark.parametrize("ack", [False, True], ids=["no-ack", "ack"])
def test_consume_follow_tails_the_queue_and_ctrl_c_prints_a_summary(
    tmp_path: Path, ack: bool
) -> None:
    url = f"file://{tmp_path}/b"
    _produce(url, ["one"])
    argv = [EXE, "consume", url, "--follow", "--poll-max", "100ms"]
    if not ack:
        argv.append("--no-ack")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        assert _lines_until(proc.stdout, 1, deadline) == ["one"]
        _produce(url, ["two", "three"])
        assert _lines_until(proc.stdout, 2, deadline) == ["two", "three"]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "interrupted: consumed 2 batches, 3 records" in err
    snap = tieredbuf.open(url).snapshot()
    if ack:
        assert "acked through sequence 1" in err and snap.footer.entry_count == 0
    else:
        assert "read (no ack)" in err and snap.footer.entry_count == 2


# --- 3. typos never create or read empty buffers ------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["consume", "{url}"],
        ["consume", "{url}", "--no-ack"],
        ["inspect", "{url}"],
        ["inspect", "{url}", "--json"],
        ["gc", "{url}"],
        ["grace", "{url}"],
    ],
)
def test_reading_a_url_with_no_buffer_is_exit_2_naming_it(tmp_path: Path, argv: list[str]) -> None:
    url = f"file://{tmp_path}/nonexistent"
    r = tb(*(a.format(url=url) for a in argv))
    assert r.returncode == EXIT_USAGE, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and url in lines[0] and "no tieredbuf buffer" in lines[0]
    assert not (tmp_path / "nonexistent").exists()


def test_only_produce_or_an_explicit_create_makes_a_buffer(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/b"
    r = tb("consume", url, "--create")
    assert r.returncode == 0, r.stderr
    assert tieredbuf.open(url).exists()
    url2 = f"file://{tmp_path}/c"
    _produce(url2, ["x"])
    assert tieredbuf.open(url2).exists()


# --- 4. consume handles Arrow bundles -----------------------------------------------------


def _ingest(url: str, stage: Path) -> list[pa.RecordBatch]:
    batches = [
        pa.record_batch(
            {"id": pa.array([i, i + 1], pa.int64()), "name": pa.array([f"n{i}", f"n{i + 1}"])}
        )
        for i in (0, 2)
    ]
    with tieredbuf.open(url).producer(staging_dir=stage) as p:
        for b in batches:
            p.ingest({0: b})
            p.flush()
    return batches


@pytest.mark.slow
def test_consume_prints_bundles_as_json_rows(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/b"
    _ingest(url, tmp_path / "stage")
    r = tb("consume", url, "--no-ack")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in r.stdout.splitlines()]
    assert [x["value"] for x in rows] == [{"id": i, "name": f"n{i}"} for i in range(4)]
    assert all(x["slot"] == 0 and x["ingestion_time_ms"] for x in rows)
    r = tb("consume", url)  # the acking consumer too, and it dequeues
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 4, r.stderr
    assert tieredbuf.open(url).snapshot().footer.entry_count == 0


@pytest.mark.parametrize("suffix", [".parquet", ".arrow"])
def test_consume_writes_bundles_as_parquet_or_arrow_ipc(tmp_path: Path, suffix: str) -> None:
    url = f"file://{tmp_path}/b"
    batches = _ingest(url, tmp_path / "stage")
    out = tmp_path / f"rows{suffix}"
    r = tb("consume", url, "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "consumed 2 batches, 4 records; acked through sequence 1" in r.stderr
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(out)
    else:
        with pa.ipc.open_file(out) as f:
            table = f.read_all()
    assert table.to_pylist() == pa.Table.from_batches(batches).to_pylist()
    assert tieredbuf.open(url).snapshot().footer.entry_count == 0


@pytest.mark.slow
def test_consume_json_and_parquet_for_records(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/b"
    r = tb("produce", url, "--metadata", "m1", stdin="a\n\xff\n")
    assert r.returncode == 0, r.stderr
    r = tb("consume", url, "--no-ack", "--json")
    rows = [json.loads(x) for x in r.stdout.splitlines()]
    assert [(x["sequence"], x["index"], x["metadata"]) for x in rows] == [
        (0, 0, "m1"),
        (0, 1, "m1"),
    ]
    assert rows[0]["value"] == "a" and rows[1]["value"] == "\xff"
    assert all(x["ingestion_time_ms"] > 0 for x in rows)
    out = tmp_path / "r.parquet"
    assert tb("consume", url, "--no-ack", "--out", str(out)).returncode == 0
    import pyarrow.parquet as pq

    t = pq.read_table(out)
    assert t.column("value").to_pylist() == [b"a", "\xff".encode()]
    assert t.column("metadata").to_pylist() == [b"m1", b"m1"]
    assert tieredbuf.open(url).snapshot().footer.entry_count == 1  # --no-ack: still queued


# --- entries and retention -------------------------------------------------------------


@pytest.mark.slow
def test_entries_lists_the_queue_without_fencing_and_retention_shows_and_sets(
    tmp_path: Path,
) -> None:
    url = f"file://{tmp_path}/b"
    for i in range(3):
        r = tb("produce", url, "--metadata", f"m{i}", stdin=f"r{i}\n")
        assert r.returncode == 0, r.stderr
    epoch = tieredbuf.open(url).snapshot().footer.epoch
    r = tb("entries", url, "--json")
    rows = [json.loads(x) for x in r.stdout.splitlines()]
    assert [(x["sequence"], x["metadata"][0]["payload"]) for x in rows] == [
        (0, "m0"),
        (1, "m1"),
        (2, "m2"),
    ]
    assert all(x["location"].startswith("data/") and x["ingestion_time_ms"] for x in rows)
    r = tb("entries", url, "--from", "1", "--limit", "1")
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 2  # header + one entry
    assert r.stdout.splitlines()[1].split()[0] == "1"
    assert tieredbuf.open(url).snapshot().footer.epoch == epoch
    assert tb("consume", url, "--max-batches", "1").returncode == 0
    r = tb("entries", url, "--json")  # sequence 0 was dequeued: it is not listed
    assert [json.loads(x)["sequence"] for x in r.stdout.splitlines()] == [1, 2]
    r = tb("entries", url, "--from", "0")
    assert "sequences 0..0 are no longer in the queue" in r.stderr
    assert tb("retention", url).stdout.startswith("none")
    assert tb("retention", url, "--max-age", "7d").stdout.strip() == "max-age 7 days, 0:00:00"
    r = tb("retention", url, "--max-bytes", "1GiB")  # the other limit is kept
    assert r.stdout.strip() == f"max-age 7 days, 0:00:00, max-bytes {1 << 30}"
    pol = tieredbuf.open(url).retention
    assert pol is not None and pol.max_age_ms == 7 * 86_400_000 and pol.max_bytes == 1 << 30
    assert tb("retention", url, "--none").stdout.startswith("none")
    for cmd in ("entries", "retention"):
        r = tb(cmd, f"file://{tmp_path}/typo")
        assert r.returncode == EXIT_USAGE and "no tieredbuf buffer" in r.stderr


# --- progress: stderr, only on a terminal, never mixed with records -----------------------


def _on_a_terminal(argv: list[str], both: bool) -> tuple[bytes, bytes]:
    """Run with stderr on a pseudo-terminal (and stdout too when ``both``)."""
    import pty

    master, slave = pty.openpty()
    out_r, out_w = os.pipe()
    p = subprocess.Popen(
        [EXE, *argv], stdin=subprocess.DEVNULL, stdout=slave if both else out_w, stderr=slave
    )
    os.close(slave)
    os.close(out_w)
    term = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        term += chunk
    p.wait(60)
    os.close(master)
    with os.fdopen(out_r, "rb") as f:
        piped = f.read()
    return term, piped


@pytest.mark.slow
def test_progress_is_drawn_on_a_terminal_stderr_and_never_among_records(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/b"
    _produce(url, ["a", "b"])
    _produce(url, ["c"])
    term, piped = _on_a_terminal(["consume", url, "--no-ack"], both=True)
    assert b"a\r\nb\r\nc\r\n" in term and b"consume [" not in term and b"\rconsume" not in term
    term, piped = _on_a_terminal(
        ["consume", url, "--no-ack", "--out", str(tmp_path / "d")], both=False
    )
    assert b"\rconsume" in term and piped == b""  # the bar: on the terminal's stderr only
    r = tb("consume", url, "--no-ack", "--out", str(tmp_path / "e"))  # not a terminal
    assert "\r" not in r.stderr and r.stderr.startswith("consumed 2 batches")


@pytest.mark.slow
def test_consume_as_a_named_subscriber_leaves_the_default_consumer_alone(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/b"
    _produce(url, ["a"])
    assert tb("consume", url, "--max-batches", "0").returncode == 0  # "default" starts here
    r = tb("consume", url, "--subscriber", "etl")
    assert r.returncode == 0 and r.stdout == "a\n", r.stderr
    assert tb("consume", url, "--subscriber", "etl").stdout == ""  # etl is past it
    assert tb("consume", url).stdout == "a\n"  # the default subscriber still had it


@pytest.mark.parametrize("suffix", [".parquet", ".arrow"])
@pytest.mark.slow
def test_consume_out_file_refuses_records_and_bundles_together_before_any_ack(
    tmp_path: Path, suffix: str
) -> None:
    """Records and slot-0 bundles would share one output file: refused before any ack,
    and no unreadable file is left behind (an ack never follows unreadable output)."""
    url = f"file://{tmp_path}/b"
    assert tb("produce", url, stdin="a\nb\n").returncode == 0
    _ingest(url, tmp_path / "stage")
    out = tmp_path / f"rows{suffix}"
    r = tb("consume", url, "--out", str(out))
    assert r.returncode != 0
    assert "--out DIR" in r.stderr and "acked" not in r.stderr
    assert not out.exists()  # nothing half-written under the name a reader would open
    assert list(tmp_path.glob(f"rows*{suffix}*")) == []
    # nothing was acked: the acking consumer still finds all three entries
    assert tieredbuf.open(url).snapshot().footer.entry_count == 3
    r = tb("consume", url, "--out", str(tmp_path / "dir"))
    assert r.returncode == 0, r.stderr
    assert "acked through sequence 2" in r.stderr
