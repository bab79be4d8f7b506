"""A worker process of ``tieredbuf serve``: one event loop, one staged producer.

    python -c <supervisor.WORKER_BOOT> CONFIG_JSON LISTEN_FD INDEX
    python -m tieredbuf.service.worker CONFIG_JSON LISTEN_FD INDEX

The supervisor binds the listening socket and passes it down; every worker accepts
on it.  SIGTERM (or SIGINT, or the supervisor dying) stops accepting, lets in-flight
requests finish, seals and exports the stage, then exits: 0 when the stage is empty,
1 when the drain timed out (the rest stays staged, LOCAL, for the next start).
SIGHUP re-reads the token file and the TLS pair the supervisor last checked
(:mod:`tieredbuf.service.tls`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys

from aiohttp import web

from tieredbuf.errors import ConfigError, TieredBufError
from tieredbuf.runtime import redact
from tieredbuf.service.app import build_app
from tieredbuf.service.config import ServiceConfig
from tieredbuf.service.http import GuardedSite
from tieredbuf.service.tls import TlsContexts
from tieredbuf.service.tokens import TokenSet, snapshot_path

log = logging.getLogger("tieredbuf.service")
PARENT_POLL_S = 1.0


async def _watch_parent(parent: int, stop: asyncio.Event) -> None:
    while os.getppid() == parent:
        await asyncio.sleep(PARENT_POLL_S)
    log.warning("supervisor %d went away: draining", parent)
    stop.set()


def _reload(tokens: TokenSet | None, tls: TlsContexts | None, index: int) -> None:
    """SIGHUP: re-read the token file and the certificate chain (new connections use
    the new certificate; a failure keeps the old one)."""
    log.info("worker %d: SIGHUP, reloading tokens and certificate", index)
    if tokens is not None:
        tokens.reload()
    if tls is not None:
        try:
            tls.reload()
        except ConfigError as e:
            log.error("worker %d: certificate not reloaded, keeping the current one: %s", index, e)
        else:
            log.info("worker %d: certificate reloaded", index)


async def run_worker(
    config: ServiceConfig, sock: socket.socket, index: int, early: list[int] | None = None
) -> int:
    """Serve until SIGTERM/SIGINT (or ``early`` holds one caught before the loop ran),
    then drain."""
    tokens = TokenSet.from_config(config.token_file, snapshot_path(config.staging_dir))
    tls = TlsContexts(config.tls_cert) if config.tls_cert is not None else None
    app = build_app(config, index, tokens)
    runner = web.AppRunner(
        app, handle_signals=False, access_log=None, shutdown_timeout=config.shutdown_timeout_s
    )
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, _reload, tokens, tls, index)
    if early:  # stopped while starting: drain what the stage holds, serve nothing
        log.info("worker %d: stopped while starting", index)
        stop.set()
    else:
        await GuardedSite(
            runner,
            sock,
            ssl_context=tls.listening if tls is not None else None,
            head_timeout=config.header_timeout_s,
            idle_timeout=config.idle_timeout_s,
            max_connections=config.max_connections,
        ).start()
    watcher = asyncio.create_task(_watch_parent(os.getppid(), stop))
    await stop.wait()
    watcher.cancel()
    log.info("worker %d: stopping (drain)", index)
    await runner.cleanup()
    return 1 if app.get("drain_incomplete") else 0


def main(argv: list[str] | None = None, early: list[int] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    config = ServiceConfig.from_json(args[0])
    fd, index = int(args[1]), int(args[2])
    redact.install(
        os.environ.get("TIEREDBUF_LOG_LEVEL", "INFO"),
        f"%(asctime)s worker-{index} %(levelname)s %(name)s: %(message)s",
    )
    sock = socket.socket(fileno=fd)
    try:
        return asyncio.run(run_worker(config, sock, index, early))
    except ConfigError as e:
        log.error("configuration error: %s", e)
        return 2
    except TieredBufError as e:
        log.error("%s: %s", type(e).__name__, e)
        return 3


if __name__ == "__main__":
    sys.exit(main())
