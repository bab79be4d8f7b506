"""ServiceConfig: what ``tieredbuf serve`` passes to each worker process (as JSON)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from tieredbuf.config import SECRET_OPTIONS
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
    """Larger bodies get 413: as sent, after any Content-Encoding, and (Arrow) decoded."""
    max_records: int = 100_000
    """More records (ndjson lines, octet-stream frames) in one request get 413: each
    costs a Python object while it is parsed and staged (docs/operations.md)."""
    header_timeout_s: float = 10.0
    """A connection must send a whole request head within this long of connecting (or
    of its next request's first byte); a TLS handshake too.  Then it is closed."""
    body_timeout_s: float = 60.0
    """A request body must arrive whole within this long of its head (then 408)."""
    idle_timeout_s: float = 75.0
    """A kept-alive connection idle this long between requests is closed."""
    max_connections: int = 512
    """Open connections per worker; a new one past it is answered 503 and closed."""
    backpressure_wait_s: float = 0.5
    """How long a request waits at a stage cap before it gets 503 + Retry-After."""
    retry_after_s: int = 1
    idempotency_window_s: float = 600.0
    """How long this worker remembers a keyed request (``Idempotency-Key``): a retry within
    it is answered with the first request's result (service/idempotency.py)."""
    idempotency_keys: int = 200_000
    """At most this many keyed requests remembered (the oldest go first; about 0.5 KB each)."""
    remote_timeout_s: float = 30.0
    """How long a ``durability=remote`` request waits for its export (then 504)."""
    shutdown_timeout_s: float = 30.0
    """On SIGTERM: how long in-flight requests may take to finish."""
    drain_timeout_s: float = 300.0
    """On SIGTERM: how long sealing and exporting the stage may take (the rest stays staged)."""
    store_check_s: float = 30.0
    """A worker checks its store (one LIST under queue/) at start and then, while /readyz
    is asked, at most this often: a permanent store error (a missing bucket, rejected
    credentials, no permission) makes /readyz 503 and /healthz 500 until a check or an
    export works again.  A service nobody asks makes no request (idle is free)."""
    threads: int = 16
    """Threads per worker for parsing and staging (blocking work off the event loop)."""
    token_file: str | None = None
    """Bearer tokens, one per line (re-read on change and on SIGHUP); without it, tokens
    come from ``$TIEREDBUF_SERVICE_TOKENS``; with neither, no authentication."""
    protect_metrics: bool = False
    """Require a token on ``/metrics`` too (``/v1/produce`` always needs one)."""
    protect_health: bool = False
    """Require a token on ``/healthz`` and ``/readyz`` too."""
    tls_cert: str | None = None
    """PEM certificate chain: serve HTTPS (with :attr:`tls_key`)."""
    tls_key: str | None = None
    insecure: bool = False
    """Allow a non-loopback host without tokens (explicit opt-out; see check_exposure)."""

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ConfigError(f"workers must be >= 1, got {self.workers}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"bad port {self.port}")
        for name in ("max_body_bytes", "max_records", "max_connections"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        for name in (
            "backpressure_wait_s",
            "remote_timeout_s",
            "shutdown_timeout_s",
            "drain_timeout_s",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0")
        for name in ("header_timeout_s", "body_timeout_s", "idle_timeout_s", "store_check_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0 (no connection may be held forever)")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("--tls-cert and --tls-key go together")
        secret = sorted(set(self.store_options) & set(SECRET_OPTIONS))
        if secret:
            # the config travels to the workers on their command line, visible in ps
            raise ConfigError(
                f"pass {', '.join(secret)} in the AWS_* environment, not as service options"
            )

    @property
    def open_paths(self) -> frozenset[str]:
        """Paths answered without a token."""
        paths = set()
        if not self.protect_metrics:
            paths.add("/metrics")
        if not self.protect_health:
            paths |= {"/healthz", "/readyz"}
        return frozenset(paths)

    @property
    def scheme(self) -> str:
        return "https" if self.tls_cert else "http"

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
