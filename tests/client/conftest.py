"""Fixtures for the client tests: fronts (tests/client/front.py) and real ``tieredbuf
serve`` processes, several on one buffer, each with its own stage."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.client.front import Front
from tests.service.server import Server, start_server


@pytest.fixture
def front() -> Iterator[Callable[..., Front]]:
    """``front(upstream=None, default=PASS)``: closed at teardown."""
    made: list[Front] = []

    def _make(upstream: Server | None = None, **kw: Any) -> Front:
        f = Front((upstream.host, upstream.port) if upstream is not None else None, **kw)
        made.append(f)
        return f

    yield _make
    for f in made:
        f.close()


@pytest.fixture
def instances(tmp_path: Path) -> Iterator[Callable[..., Server]]:
    """``instances(url, *args, **kw)``: one more ``tieredbuf serve`` on ``url``, with a
    stage of its own (a stage belongs to its instance); ``where=old.stage.parent``
    restarts a stopped one on its stage.  SIGTERM at teardown (a killed one is only
    reaped)."""
    started: list[Server] = []
    counter = itertools.count()

    def _start(url: str, *args: str, where: Path | None = None, **kw: Any) -> Server:
        if where is None:
            where = tmp_path / f"instance-{next(counter)}"
            where.mkdir()
        s = start_server(url, where, *args, **kw)
        started.append(s)
        return s

    yield _start
    for s in started:
        if s.proc.poll() is None:
            s.terminate()
        else:
            s.proc.wait()
