"""ServiceConfig: what ``tieredbuf serve`` passes to each worker process (as JSON)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from tieredbuf.errors import ConfigError

DURATION_OPTIONS = frozenset({"flush_interval", "max_open_duration", "backpressure_timeout"})
"""Producer options given in seconds on the wire and passed on as timedelta."""


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    url: str
    staging_dir: str
    host: str = "127.0.0.1"
    port: int = 8080
    workers: int = 1
    store_options: dict[str, Any] = field(default_factory=dict)
    producer_options: dict[str, Any] = field(default_factory=dict)
    """Staged producer options (durations in seconds), e.g. ``max_open_duration``."""
    max_body_bytes: int = 16 << 20
    """Larger bodies get 413."""
    backpressure_wait_s: float = 0.5
    """How long a request waits at a stage cap before it gets 503 + Retry-After."""
    retry_after_s: int = 1
    remote_timeout_s: float = 30.0
    """How long a ``durability=remote`` request waits for its export (then 504)."""
    shutdown_timeout_s: float = 30.0
    """On SIGTERM: how long in-flight requests may take to finish."""
    drain_timeout_s: float = 300.0
    """On SIGTERM: how long sealing and exporting the stage may take (the rest stays staged)."""
    threads: int = 16
    """Threads per worker for parsing and staging (blocking work off the event loop)."""

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ConfigError(f"workers must be >= 1, got {self.workers}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"bad port {self.port}")
        if self.max_body_bytes < 1:
            raise ConfigError("max_body_bytes must be positive")
        for name in ("backpressure_wait_s", "remote_timeout_s", "shutdown_timeout_s",
                     "drain_timeout_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0")

    def worker_stage(self, index: int) -> Path:
        """Worker ``index``'s staging directory: its producer id lives inside, stable."""
        return Path(self.staging_dir) / f"worker-{index}"

    def producer_kwargs(self) -> dict[str, Any]:
        return {
            k: timedelta(seconds=float(v)) if k in DURATION_OPTIONS else v
            for k, v in self.producer_options.items()
        }

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ServiceConfig:
        return cls(**json.loads(text))
