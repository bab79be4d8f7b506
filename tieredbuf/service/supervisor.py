"""``tieredbuf serve``: bind once, run N worker processes, drain them on SIGTERM.

The supervisor stays small (it never imports aiohttp): it binds the listening socket,
starts ``N`` workers that all accept on it (the kernel spreads connections), restarts
a worker that dies (its stage is recovered by the new one: same directory, same
producer id), checks the TLS pair at start and on SIGHUP and passes SIGHUP on (the
workers reload the token file and the last good pair, :mod:`tieredbuf.service.tls`),
keeps the last good tokens of the token file for a worker that starts while it is
broken (:mod:`tieredbuf.service.tokens`),
and on SIGTERM/SIGINT passes SIGTERM to every worker and waits until
each has sealed and exported its stage.

Metrics: prometheus_client's multiprocess mode.  ``PROMETHEUS_MULTIPROC_DIR`` (default
a fresh temporary folder, removed at exit; never on the stage's disk, where a full disk
would kill a worker touching its mmapped values with SIGBUS; emptied at start) holds
each worker's values; any worker's
``/metrics`` answers for all of them.  A dead worker's gauges are dropped, its
counters kept, so totals never go backwards.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TextIO

from tieredbuf.errors import ConfigError
from tieredbuf.runtime.signals import SignalEvent
from tieredbuf.service.config import ServiceConfig
from tieredbuf.service.tls import TlsSnapshot
from tieredbuf.service.tokens import TokenSet, snapshot_path

log = logging.getLogger("tieredbuf.service")

_WORKER_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
WORKER_BOOT = (
    "import signal, sys\n"
    "early = []\n"
    "for s in (signal.SIGTERM, signal.SIGINT):\n"
    "    signal.signal(s, lambda n, f: early.append(n))\n"
    "signal.signal(signal.SIGHUP, signal.SIG_IGN)\n"
    "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT, "
    "signal.SIGHUP})\n"
    "from tieredbuf.service.worker import main\n"
    "sys.exit(main(sys.argv[1:], early))\n"
)
"""How a worker is started.  It is forked with SIGTERM, SIGINT and SIGHUP blocked (the
mask survives exec), and unblocks them only once its handlers are in place, before
anything heavy is imported: a stop signal that arrives while the worker is still
starting (interpreter start-up, imports, stage recovery) is held, then recorded, and
the worker drains and exits cleanly instead of dying half-way of -SIGTERM.  A SIGHUP
before it serves is dropped (it reads the newest tokens as it starts).  The supervisor
never imports the worker module (nor aiohttp), so the bootstrap lives here."""

FAST_FAILURE_S = 5.0
"""A worker that exits non-zero sooner than this after its start failed to start."""
MAX_FAST_FAILURES = 3


@dataclass
class _Worker:
    index: int
    proc: subprocess.Popen[bytes]
    started: float
    fast_failures: int = 0


def _metrics_dir(config: ServiceConfig) -> Path:
    env = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not env:
        return Path(tempfile.mkdtemp(prefix="tieredbuf-metrics-"))
    path = Path(env)
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def _mark_dead(pid: int, path: Path) -> None:
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid, str(path))  # type: ignore[no-untyped-call]


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host``: an IPv4 address, an IPv6 one (bracketed or not;
    ``::`` takes IPv4 connections too where the system allows a dual-stack socket),
    or a name (its IPv4 address, else its IPv6 one); ``""``: every IPv4 interface."""
    host = host.removeprefix("[").removesuffix("]")
    try:
        addr = ipaddress.ip_address(host) if host else None
    except ValueError:  # a name (socket.gaierror when it does not resolve)
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, *_, where = ([i for i in infos if i[0] == socket.AF_INET] or infos)[0]
        return socket.create_server(where, family=family, backlog=2048)
    if addr is None or addr.version == 4:
        return socket.create_server((host, port), backlog=2048)
    dual = addr.is_unspecified and socket.has_dualstack_ipv6()
    return socket.create_server(
        (host, port), family=socket.AF_INET6, backlog=2048, dualstack_ipv6=dual
    )


def _own_stage_root(path: Path) -> None:
    """Create the stage root owner-only (0700); warn when an existing one is not."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        log.warning(
            "stage root %s is mode %o: other users may read staged records "
            "(chmod 700 it; new stage files are 0600)",
            path,
            mode,
        )


def serve(config: ServiceConfig, out: TextIO | None = None, tokens: TokenSet | None = None) -> int:
    """Run the service until SIGTERM/SIGINT; 0 when every worker drained cleanly.
    ``tokens``: the token set already checked (read from ``config`` when not given)."""
    out = out or sys.stdout
    _own_stage_root(Path(config.staging_dir))
    # the last good tokens of --token-file, for a worker that starts while it is broken
    keep = snapshot_path(config.staging_dir) if config.token_file else None
    if keep is not None:
        tokens = tokens or TokenSet(config.token_file)
        tokens.save(keep)
    tls = None
    if config.tls_cert is not None and config.tls_key is not None:
        tls = TlsSnapshot(config.tls_cert, config.tls_key, Path(config.staging_dir))
        tls.refresh()  # ConfigError: exit 2 before anything binds
    mdir = _metrics_dir(config)
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(mdir)}
    try:
        sock = listen(config.host, config.port)
    except OSError as e:
        hint = (
            " (another process uses it; --port 0 picks a free one)"
            if (e.errno == errno.EADDRINUSE)
            else ""
        )
        why = os.strerror(e.errno) if e.errno and e.errno > 0 else (e.strerror or str(e))
        where = f"[{config.host}]" if ":" in config.host else config.host
        raise ConfigError(f"cannot listen on {where}:{config.port}: {why}{hint}") from None
    sock.set_inheritable(True)
    host, port = sock.getsockname()[:2]
    if ":" in host:
        host = f"[{host}]"
    # both are set by the signal handler: a threading.Event set there can deadlock the
    # main thread waiting on it (tieredbuf.runtime.signals)
    stop = SignalEvent()
    forced = SignalEvent()
    workers: list[_Worker] = []

    def on_signal(signum: int, frame: object) -> None:
        if not stop.is_set():
            stop.set()  # first: a second signal may arrive while this one prints
            if signum == signal.SIGINT:
                print(
                    "tieredbuf serve: stopping: the workers drain their stages "
                    "(Ctrl-C again to stop at once)",
                    file=sys.stderr,
                    flush=True,
                )
            return
        if signum != signal.SIGINT or forced.is_set():
            return
        forced.set()  # a second Ctrl-C: the operator will not wait for the drain
        print(
            "tieredbuf serve: second Ctrl-C: killing the workers; what they had not "
            "exported stays staged and is recovered at the next start (or by tieredbuf "
            "drain)",
            file=sys.stderr,
            flush=True,
        )
        for w in workers:
            if w.proc.poll() is None:
                w.proc.kill()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)

    hup: list[int] = []

    def on_hup(signum: int, frame: object) -> None:
        hup.append(signum)  # handled in the loop below (file I/O, TLS, logging)

    signal.signal(signal.SIGHUP, on_hup)

    def reload() -> None:
        # SIGHUP: check the TLS pair (a bad one keeps the snapshot), then the workers
        # re-read the token file and the snapshot
        hup.clear()
        if keep is not None and tokens is not None and tokens.reload():
            tokens.save(keep)
        if tls is not None:
            try:
                tls.refresh()
            except ConfigError as e:
                log.error("certificate not reloaded, keeping the current one: %s", e)
            else:
                print(
                    f"tieredbuf serve: certificate reloaded from {tls.cert}",
                    file=sys.stderr,
                    flush=True,
                )
        for w in workers:
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGHUP)

    payload = (
        replace(config, tls_cert=str(tls.path), tls_key=str(tls.path))
        if tls is not None
        else config
    ).to_json()

    def start(index: int) -> subprocess.Popen[bytes]:
        held = signal.pthread_sigmask(signal.SIG_BLOCK, _WORKER_SIGNALS)
        try:  # the child inherits the blocked mask; ours is restored at once
            return subprocess.Popen(
                [sys.executable, "-c", WORKER_BOOT, payload, str(sock.fileno()), str(index)],
                pass_fds=(sock.fileno(),),
                env=env,
                start_new_session=True,
            )
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)

    workers += [_Worker(i, start(i), time.monotonic()) for i in range(config.workers)]
    print(
        f"tieredbuf serve: listening on {config.scheme}://{host}:{port} with {config.workers} "
        f"worker{'' if config.workers == 1 else 's'}, staging under {config.staging_dir}",
        file=out,
        flush=True,
    )
    code = 0
    try:
        while not stop.wait(0.2):
            if hup:
                reload()
            if keep is not None and tokens is not None and tokens.maybe_reload():
                tokens.save(keep)
            for w in workers:
                rc = w.proc.poll()
                if rc is None:
                    continue
                _mark_dead(w.proc.pid, mdir)
                fast = rc != 0 and time.monotonic() - w.started < FAST_FAILURE_S
                w.fast_failures = w.fast_failures + 1 if fast else 0
                if w.fast_failures >= MAX_FAST_FAILURES:
                    log.error(
                        "worker %d failed to start %d times (exit %d): giving up",
                        w.index,
                        w.fast_failures,
                        rc,
                    )
                    code = 3
                    stop.set()
                    break
                log.warning(
                    "worker %d (pid %d) exited with %d: restarting", w.index, w.proc.pid, rc
                )
                w.proc, w.started = start(w.index), time.monotonic()
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGTERM)
        limit = config.shutdown_timeout_s + config.drain_timeout_s + 30
        deadline = time.monotonic() + limit
        for w in workers:
            try:
                rc = w.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error(
                    "worker %d did not stop in %.0f s: killing it (its stage stays; "
                    "it is recovered at the next start)",
                    w.index,
                    limit,
                )
                w.proc.kill()
                rc = w.proc.wait()
            _mark_dead(w.proc.pid, mdir)
            if rc != 0 and code == 0:
                code = 1
        sock.close()
        if keep is not None:
            keep.unlink(missing_ok=True)
    if forced.is_set():
        code = 130
    stop.close()
    forced.close()
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        shutil.rmtree(mdir, ignore_errors=True)
    print(f"tieredbuf serve: stopped (exit {code})", file=out, flush=True)
    return code
