"""``tieredbuf produce http(s)://host:port ...``: the command writes through the service
with the service producer."""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.client.front import DROP, Front, Status
from tests.client.test_service_client import TOKEN, entries_by_sequence
from tests.service.server import Server
from tests.service.util import FAST
from tieredbuf.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE, main

Start = Callable[..., Server]


def _run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    code = main(list(argv), out=out)
    return code, out.getvalue()


@pytest.mark.slow
def test_produce_to_a_service_url_prints_the_sequences_and_lands(
    tmp_path: Path, instances: Start
) -> None:
    url = f"file://{tmp_path}/buf"
    srv = instances(url, *FAST, env={"TIEREDBUF_SERVICE_TOKENS": TOKEN}, token=TOKEN)
    (tmp_path / "token").write_text(TOKEN + "\n")
    src = tmp_path / "in.txt"
    src.write_text("".join(f"line {i}\n" for i in range(25)))
    code, text = _run(
        "produce",
        f"http://127.0.0.1:{srv.port}",
        str(src),
        "--batch",
        "10",
        "--metadata",
        "from the cli",
        "--token-file",
        str(tmp_path / "token"),
    )
    assert code == EXIT_OK, text
    assert "produced 25 records in 3 calls -> sequences " in text
    got = [r for b in entries_by_sequence(url).values() for r in b.entries]
    assert got == [f"line {i}".encode() for i in range(25)]


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--staging", "st"], "--staging do(es) not apply to a service URL"),
        (["--endpoint", "http://127.0.0.1:9000"], "--endpoint do(es) not apply"),
        (["--metadata", "a\tb"], "--metadata: metadata holds control character 0x09"),
    ],
)
def test_what_does_not_apply_to_a_service_url_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], says: str
) -> None:
    src = tmp_path / "in.txt"
    src.write_text("a\n")
    code, _ = _run("produce", "http://127.0.0.1:9", str(src), *extra)
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and says in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_a_service_that_never_answers_gives_up_at_timeout_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], front: Callable[..., Front]
) -> None:
    f = front()
    port = f.port
    f.close()  # nothing listens there now
    src = tmp_path / "in.txt"
    src.write_text("a\nb\n")
    code, _ = _run("produce", f"http://127.0.0.1:{port}", str(src), "--timeout", "1s")
    err = capsys.readouterr().err
    assert code == EXIT_FAILED
    assert "the service still failed after --timeout 1s" in err and "cannot connect" in err
    assert "2 of 2 records not stored and dropped" in err


@pytest.mark.slow
def test_records_whose_outcome_is_unknown_are_reported_as_maybe_stored(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], front: Callable[..., Front]
) -> None:
    """The answer was lost and no instance can tell (409): at --timeout the command says
    the records may have been stored, not that they were dropped."""
    f = front(default=Status(409, "0", "a request with this Idempotency-Key may be in flight"))
    f.script(DROP)
    src = tmp_path / "in.txt"
    src.write_text("a\nb\n")
    code, _ = _run("produce", f.url, str(src), "--timeout", "1s")
    err = capsys.readouterr().err
    assert code == EXIT_FAILED
    assert "2 records not confirmed: the service may have stored them (once at most)" in err
    assert "dropped" not in err
