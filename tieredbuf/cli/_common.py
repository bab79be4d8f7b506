"""What every ``tieredbuf`` command shares: exit codes, duration and size arguments,
the progress line, the S3 options and how a command opens its buffer."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import os
import re
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, TextIO

import tieredbuf
from tieredbuf.config import AZURE_OPTION_ENV, S3_OPTION_ENV
from tieredbuf.errors import ConfigError, OutputClosedError, OutputError, TieredBufError
from tieredbuf.store.azure import is_azure_url

EXIT_OK, EXIT_PARTIAL, EXIT_USAGE, EXIT_FAILED = 0, 1, 2, 3
EXIT_INTERRUPTED = 130
EXIT_PIPE = 128 + 13
"""A reader closed the output pipe: the exit status of ``cat`` killed by SIGPIPE."""
_NEGATIVE = re.compile(r"^-\.?\d")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)\s*$")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """``1048576``, ``64k``, ``16MiB``, ``4G`` (binary units)."""
    m = _SIZE.match(text)
    if m is None:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: use e.g. 64k, 16MiB, 4G")
    unit = m.group(2).lower().rstrip("b").rstrip("i")
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


class Progress:
    """One self-erasing status line on stderr, drawn only when stderr is a terminal."""

    def __init__(
        self,
        label: str,
        total: int | None = None,
        stream: TextIO | None = None,
        interval: float = 0.1,
    ) -> None:
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty()
        self.label, self.total, self.interval = label, total, interval
        self.done = 0
        self.extra = ""
        self._drawn = 0.0
        self._width = 0

    def update(self, n: int = 1, extra: str | None = None) -> None:
        self.done += n
        if extra is not None:
            self.extra = extra
        now = time.monotonic()
        if self.enabled and now - self._drawn >= self.interval:
            self._drawn = now
            self._draw()

    def _draw(self) -> None:
        if self.total:
            frac = min(1.0, self.done / self.total)
            bar = "#" * int(frac * 20)
            text = f"{self.label} [{bar:<20}] {self.done}/{self.total}"
        else:
            text = f"{self.label} {self.done}"
        if self.extra:
            text += f"  {self.extra}"
        pad = max(0, self._width - len(text))
        self._width = len(text)
        self.stream.write("\r" + text + " " * pad)
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class GuardedOutput:
    """A command's standard output, where a write either goes through whole or raises.

    Python's text layer drops the rest of a large write that the pipe took only in part
    (its reader closed mid-write: ``write()`` returns a short count and the text layer
    ignores it), so a command would ack records that never reached the pipe.  Here the
    bytes go to the binary layer in a loop that checks each count.  A closed pipe
    raises :class:`OutputClosedError`, any other failure (a full disk) :class:`OutputError`
    naming the output."""

    def __init__(self, stream: TextIO, name: str = "standard output") -> None:
        self.stream, self.name = stream, name
        binary = getattr(stream, "buffer", None)
        self._bin: Any = binary if hasattr(binary, "write") else None
        self._encoding = getattr(stream, "encoding", None) or "utf-8"
        self._errors = getattr(stream, "errors", None) or "strict"
        self._lines = bool(getattr(stream, "line_buffering", False))
        if self._bin is not None:
            with self._guard():
                stream.flush()  # whatever was printed before goes first

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        try:
            yield
        except BrokenPipeError as e:
            raise OutputClosedError(f"{self.name} was closed by its reader") from e
        except OSError as e:
            if isinstance(e, TieredBufError):
                raise
            raise OutputError(f"cannot write to {self.name}: {e.strerror or e}") from e

    def write(self, text: str) -> int:
        with self._guard():
            if self._bin is None:
                self.stream.write(text)
                return len(text)
            view = memoryview(text.encode(self._encoding, self._errors))
            while view:
                n = self._bin.write(view)
                if not n:  # the pipe takes nothing more: its reader is gone
                    raise BrokenPipeError(errno.EPIPE, "short write")
                view = view[n:]
            if self._lines and "\n" in text:
                self._bin.flush()
        return len(text)

    def flush(self) -> None:
        with self._guard():
            (self._bin or self.stream).flush()

    def isatty(self) -> bool:
        return bool(self.stream.isatty())

    def silence(self) -> None:
        """After a failure: point the real stdout at /dev/null, so the interpreter's own
        flush at exit does not fail again (``Exception ignored ... BrokenPipeError``)."""
        if self.stream is not sys.__stdout__:
            return  # a stream a caller handed in (tests) is theirs
        try:
            fd = self.stream.fileno()
        except (OSError, ValueError, AttributeError):
            return
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, fd)
        finally:
            os.close(null)


@contextlib.contextmanager
def writing(path: object) -> Iterator[None]:
    """An ``--out`` file or folder: an OSError while making or writing it becomes one
    :class:`OutputError` naming it (a full disk, a folder nobody may write)."""
    try:
        yield
    except OSError as e:
        if isinstance(e, TieredBufError):
            raise
        raise OutputError(f"cannot write {path}: {e.strerror or e}") from e


def parse_duration(text: str) -> timedelta:
    """``500ms``, ``30s``, ``10m``, ``2h``, ``1d``."""
    if text.strip() == "0":  # zero needs no unit
        return timedelta(0)
    m = _DURATION.match(text)
    if m is None:
        if text.strip().startswith("-"):
            raise argparse.ArgumentTypeError(
                f"bad duration {text!r}: a duration is not negative; use e.g. 500ms, 30s, 10m"
            )
        raise argparse.ArgumentTypeError(f"bad duration {text!r}: use e.g. 500ms, 30s, 10m, 2h")
    return timedelta(seconds=float(m.group(1)) * _UNITS[m.group(2)])


def parse_timeout(text: str) -> timedelta:
    """A ``--timeout``: how long the store may keep failing before a command gives up;
    more than 0 (a store that never fails never starts that clock)."""
    try:
        d = parse_duration(text)
    except argparse.ArgumentTypeError:
        d = None
    if d is None or d <= timedelta(0):
        raise argparse.ArgumentTypeError(
            f"{text!r}: must be more than 0, e.g. 500ms, 30s, 5m (how long the store may "
            f"keep failing before the command gives up)"
        )
    return d


def attach_negative_values(argv: list[str], takes_value: set[str]) -> list[str]:
    """``--timeout -5s`` as ``--timeout=-5s``: argparse takes a value that starts with
    ``-`` (and is not a plain negative number) for an option, and says "expected one
    argument"; attached, the value reaches the option's own check and its message."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if a in takes_value and nxt is not None and _NEGATIVE.match(nxt):
            out.append(f"{a}={nxt}")
            i += 2
            continue
        out.append(a)
        i += 1
    return out


def store_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "store options (default: the AWS_* environment or a ~/.aws profile for s3://, the "
        "AZURE_STORAGE_* environment for az://, the GOOGLE_* environment or Application "
        "Default Credentials for gs://; credentials come only from those)"
    )
    g.add_argument(
        "--endpoint",
        metavar="URL",
        help="S3 endpoint URL, e.g. http://127.0.0.1:9000 for MinIO (default: "
        "AWS_ENDPOINT_URL, else AWS); for az:// the Blob endpoint, e.g. "
        "http://127.0.0.1:10000/devstoreaccount1 for Azurite "
        "(AZURE_STORAGE_ENDPOINT); for gs:// the JSON API's, e.g. http://127.0.0.1:4443 "
        "for fake-gcs-server (STORAGE_EMULATOR_HOST)",
    )
    g.add_argument("--region", help="S3 region (default: AWS_REGION / AWS_DEFAULT_REGION)")
    g.add_argument(
        "--allow-http",
        action="store_true",
        default=None,
        help="allow plain HTTP (implied by an http:// endpoint; AWS_ALLOW_HTTP)",
    )
    g.add_argument(
        "--instance-metadata",
        action="store_true",
        default=None,
        help="take credentials from the cloud instance metadata service (EC2 role)",
    )
    g.add_argument(
        "--skip-signature",
        action="store_true",
        default=None,
        help="send unsigned requests (a public bucket)",
    )


DEFAULT_TIMEOUT = timedelta(seconds=30)


def timeout_arg(p: argparse.ArgumentParser, what: str = "the store keeps failing") -> None:
    """``--timeout``: how long a command that writes waits while ``what``, then exits 3."""
    p.add_argument(
        "--timeout",
        type=parse_timeout,
        default=DEFAULT_TIMEOUT,
        metavar="DURATION",
        help=f"give up (exit 3, saying what was not written) when {what} this "
        f"long, e.g. 30s, 5m (default {fmt_duration(DEFAULT_TIMEOUT)})",
    )


def local_path(url: str) -> str | None:
    """The directory a ``file://`` URL or a bare path names (None for other schemes)."""
    if url.startswith("file://"):
        rest = url[len("file://") :]
        return rest if rest.startswith(("/", "./", "../")) else None
    return None if "://" in url else url


def open_buffer(args: argparse.Namespace) -> tieredbuf.Buffer:
    """The buffer at ``args.url``.  A local path that is a regular file is not a store
    (exit 2: usually the URL was left out and an input file taken for it); a command with
    ``--timeout`` gives up its store retries after that long."""
    path = local_path(args.url)
    if path is not None and os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(
            f"{args.url} is a file, not a buffer: a buffer is a directory, file://DIR or "
            f"s3://bucket/prefix (did you leave out the URL? "
            f"tieredbuf {args.command} URL ...)"
        )
    buf = tieredbuf.open(args.url, **store_opts(args))
    timeout = getattr(args, "timeout", None)
    if isinstance(timeout, timedelta) and timeout > timedelta(0):
        buf.queue.retry = dataclasses.replace(buf.queue.retry, give_up_after=timeout)
    return buf


def open_existing(args: argparse.Namespace) -> tieredbuf.Buffer:
    """A buffer that must exist: a mistyped URL is BufferNotFoundError (exit 2), never
    an empty buffer read (or created) in its place."""
    buf = open_buffer(args)
    require_buffer(buf, offer_create=False)
    return buf


_S3_FLAGS = ("endpoint", "region", "allow_http", "instance_metadata", "skip_signature")


_AZURE_FLAGS = ("endpoint", "allow_http")


_GCS_FLAGS = ("endpoint",)


def s3_opts(args: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(args, k) for k in _S3_FLAGS if getattr(args, k, None) is not None}


def store_opts(args: argparse.Namespace) -> dict[str, Any]:
    """The store options the flags give for ``args.url``: the S3 flags for s3://, the
    endpoint and --allow-http for Azure URLs, the endpoint for gs:// (an S3-only flag
    there is a usage error), none for file:// and memory://."""
    if args.url.startswith("s3://"):
        return s3_opts(args)
    if is_azure_url(args.url):
        given = s3_opts(args)
        s3_only = sorted(set(given) - set(_AZURE_FLAGS))
        if s3_only:
            flags = ", ".join("--" + f.replace("_", "-") for f in s3_only)
            raise ConfigError(f"{flags}: S3 option(s), not for the Azure URL {args.url}")
        return given
    if args.url.startswith("gs://"):
        given = s3_opts(args)
        s3_only = sorted(set(given) - set(_GCS_FLAGS))
        if s3_only:
            flags = ", ".join("--" + f.replace("_", "-") for f in s3_only)
            raise ConfigError(f"{flags}: S3 option(s), not for the GCS URL {args.url}")
        return given
    return {}


def fmt_duration(d: timedelta) -> str:
    s = d.total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if s >= size and s % size == 0:
            return f"{int(s // size)}{unit}"
    return f"{round(s * 1000)}ms"


_SPECIFIC_TERMS = (
    (
        "(or pass access_key_id= / secret_access_key=)",
        "(or a profile in ~/.aws/credentials or ~/.aws/config, chosen by AWS_PROFILE)",
    ),
    (
        "use access_key_id / secret_access_key or the AWS_* environment",
        "use AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or a profile in ~/.aws",
    ),
    (
        "(or the access_key_id / secret_access_key options)",
        "(or a profile in ~/.aws, chosen by AWS_PROFILE)",
    ),
    (" (or the account_key / sas_token options)", ""),
    (
        "managed_identity=True (TIEREDBUF_AZURE_MANAGED_IDENTITY=1)",
        "TIEREDBUF_AZURE_MANAGED_IDENTITY=1",
    ),
    ("but allow_http is false", "but AWS_ALLOW_HTTP is false"),
    ("or drop allow_http=false", "or unset AWS_ALLOW_HTTP"),
    ("call initialize() again to take it back", "run the command again to take it back"),
    (
        "pass probe=False only if you know better",
        "only the Python API can skip this check (probe=False)",
    ),
    ("pass probe=False ", "only the Python API can skip this check (probe=False) "),
)
_PASS = re.compile(r" \(or pass [a-z_]+=(?: / [a-z_]+=)*\)")
_KEYWORD = re.compile(r"\b([a-z][a-z_]*)=(True|False|true|false)?(?![\w(])")


def cli_terms(text: str, flags: frozenset[str] | set[str]) -> str:
    """A library message in the command line's terms: ``force=True`` becomes ``--force``
    and ``instance_metadata=True`` ``--instance-metadata`` where the command has that flag
    (``flags``: option destinations), an S3 option without a flag its environment
    variable (``access_key_id=`` -> ``AWS_ACCESS_KEY_ID``)."""
    for old, new in _SPECIFIC_TERMS:
        text = text.replace(old, new)
    text = _PASS.sub("", text)  # "(or pass account_name=)": the variable is named already

    def term(m: re.Match[str]) -> str:
        name, value = m.group(1), m.group(2)
        if name in flags and value in (None, "True", "true"):
            return "--" + name.replace("_", "-")
        env = S3_OPTION_ENV.get(name) or AZURE_OPTION_ENV.get(name)
        if env is not None:
            return env[0] + ("" if value is None else f"={value.lower()}")
        return m.group(0)

    return _KEYWORD.sub(term, text)


def one_line(e: BaseException) -> str:
    text = " ".join(str(e).split("\n\nDebug source:", 1)[0].split())
    return text or type(e).__name__


def plural(n: int, word: str) -> str:
    """``word`` for one, its plural otherwise."""
    if n == 1:
        return word
    if word.endswith("y"):
        return word[:-1] + "ies"
    return word + ("es" if word.endswith(("s", "ch", "sh", "x")) else "s")


def require_buffer(
    buf: tieredbuf.Buffer, *, create: bool = False, offer_create: bool = True
) -> None:
    """A reader never creates a buffer: a URL with none is BufferNotFoundError (exit 2),
    unless ``create`` (an explicit ``--create``; ``offer_create``: the command has it)."""
    if buf.exists():
        return
    if not create:
        how = "--create makes an empty one" if offer_create else "tieredbuf produce makes one"
        raise tieredbuf.BufferNotFoundError(buf.url, f"a reader never creates one; {how}")
    make = getattr(buf, "create", None)
    if make is not None:
        make()
    else:  # before Buffer.create(): the first epoch bump writes the root
        buf.queue.initialize(f"create/{time.time_ns()}")
