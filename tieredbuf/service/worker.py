"""A worker process of ``tieredbuf serve``: one event loop, one staged producer.

    python -m tieredbuf.service.worker CONFIG_JSON LISTEN_FD INDEX

The supervisor binds the listening socket and passes it down; every worker accepts
on it.  SIGTERM (or SIGINT, or the supervisor dying) stops accepting, lets in-flight
requests finish, seals and exports the stage, then exits: 0 when the stage is empty,
1 when the drain timed out (the rest stays staged, LOCAL, for the next start).
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
from tieredbuf.service.app import build_app
from tieredbuf.service.config import ServiceConfig

log = logging.getLogger("tieredbuf.service")
PARENT_POLL_S = 1.0


async def _watch_parent(parent: int, stop: asyncio.Event) -> None:
    while os.getppid() == parent:
        await asyncio.sleep(PARENT_POLL_S)
    log.warning("supervisor %d went away: draining", parent)
    stop.set()


async def run_worker(config: ServiceConfig, sock: socket.socket, index: int) -> int:
    app = build_app(config, index)
    runner = web.AppRunner(app, handle_signals=False, access_log=None,
                           shutdown_timeout=config.shutdown_timeout_s)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    site = web.SockSite(runner, sock)
    await site.start()
    watcher = asyncio.create_task(_watch_parent(os.getppid(), stop))
    await stop.wait()
    watcher.cancel()
    log.info("worker %d: stopping (drain)", index)
    await runner.cleanup()
    return 1 if app.get("drain_incomplete") else 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    config = ServiceConfig.from_json(args[0])
    fd, index = int(args[1]), int(args[2])
    logging.basicConfig(
        level=os.environ.get("TIEREDBUF_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s worker-{index} %(levelname)s %(name)s: %(message)s",
    )
    sock = socket.socket(fileno=fd)
    try:
        return asyncio.run(run_worker(config, sock, index))
    except ConfigError as e:
        log.error("configuration error: %s", e)
        return 2
    except TieredBufError as e:
        log.error("%s: %s", type(e).__name__, e)
        return 3


if __name__ == "__main__":
    sys.exit(main())
