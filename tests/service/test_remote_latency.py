"""durability=remote is answered once the request's segment is exported: a waiting
request has it sealed at once (tieredbuf/produce/prompt_seal.py), whatever max_open_duration."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.service.server import Server
from tests.service.util import ndjson
from tieredbuf.service.bodies import NDJSON


@pytest.mark.slow
def test_the_service_answers_durability_remote_without_waiting_out_max_open(
    tmp_path: Path, serve: Callable[..., Server]
) -> None:
    srv = serve(f"file://{tmp_path}/buf", "--max-open-duration", "1h")
    r = srv.post(ndjson([{"i": 1}]), NDJSON, "remote")
    assert r.status == 200 and r.json()["sequence"] == 0
    assert srv.terminate() == 0


@pytest.mark.slow
def test_serve_takes_the_manifest_write_budget_and_refuses_a_negative_one(
    tmp_path: Path, serve: Callable[..., Server]
) -> None:
    import io

    from tieredbuf.cli import EXIT_USAGE, main

    srv = serve(f"file://{tmp_path}/buf", "--manifest-writes-per-s", "10")
    r = srv.post(ndjson([{"i": 1}]), NDJSON, "remote")
    assert r.status == 200 and r.json()["sequence"] == 0
    assert srv.terminate() == 0
    code = main(
        [
            "serve",
            f"file://{tmp_path}/buf",
            "--staging",
            str(tmp_path / "s2"),
            "--manifest-writes-per-s",
            "-1",
        ],
        out=io.StringIO(),
    )
    assert code == EXIT_USAGE
