"""Fixtures for the service tests: a real ``tieredbuf serve`` process per test."""

from __future__ import annotations

import ssl
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.service.server import Server, start_server


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., Server]]:
    """``serve(url, *args, workers=1)`` starts the service; stopped (SIGTERM) at teardown."""
    started: list[Server] = []

    def _start(
        url: str,
        *args: str,
        workers: int = 1,
        env: dict[str, str] | None = None,
        token: str | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> Server:
        s = start_server(url, tmp_path, *args, workers=workers, env=env, token=token, tls=tls)
        started.append(s)
        return s

    yield _start
    for s in started:
        if s.proc.poll() is None:
            s.terminate()
