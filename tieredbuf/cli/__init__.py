"""The ``tieredbuf`` command.

    tieredbuf demo [URL]                 produce, land as objects + manifest entries, consume back
    tieredbuf produce URL [FILE ...]     one record per input line (stdin when no FILE);
                                         --format json: the items of one JSON array;
                                         URL http(s)://host:port: through `tieredbuf serve`
    tieredbuf consume URL [--no-ack] [--follow] [--json] [--out DIR|F.arrow|F.parquet]
                                         print records and bundles (or write them), then ack
    tieredbuf work URL QUEUE -- CMD [ARG ...]   run CMD once per entry of the work queue
                                         QUEUE (records on stdin): exit 0 acks it
    tieredbuf inspect URL [--json]       sequence range, depth, bytes, epoch, oldest age
    tieredbuf entries URL [--from SEQ] [--limit N] [--json]   list the queue (read-only)
    tieredbuf retention URL [--max-age D] [--max-bytes S | --none]   show or set retention
    tieredbuf subscribers URL [--json]   each subscriber's position, lag, epoch; rejected entries
    tieredbuf subscribers remove URL NAME   unregister one (releases what it held)
    tieredbuf subscribers redrive URL QUEUE  send a work queue's dead letters back
    tieredbuf gc URL [--grace 1h] [--dry-run] [--json] [--loop 5m]  (grace: the buffer's
                                         unless longer; --loop: a pass every 5m)
    tieredbuf grace URL [DURATION] [--force]  show (or set) the buffer's GC grace period
    tieredbuf create-container az://CONTAINER/PREFIX   create an Azure container (obstore cannot)
    tieredbuf verify URL [--from SEQ] [--json]   read every live object and check it:
                                         missing, damaged, unreferenced (exit 3 on any)
    tieredbuf drain STAGE_DIR URL [--timeout 15m]   take over a dead producer's stage: replay,
                                         export, empty it
    tieredbuf serve URL --staging DIR    HTTP ingest service (POST /v1/produce), N worker processes
                                         [--token-file F] [--tls-cert C --tls-key K] [--insecure]

Options and positionals may come in any order.  Every command that writes gives up after
``--timeout`` (30s by default) while the store keeps failing.

Exit codes: 0 success; 1 partial failure (gc: some deletes failed, retried next run, or
its metrics could not be written or pushed; drain: a live producer holds a stage); 2 bad
usage or configuration (a wrong URL or scheme, missing credentials, no buffer at a URL
that is read, a file given as the URL, no stage in the directory, a stage that belongs
to another buffer, a port in use, a missing input file, input that is not one record per
line); 3 the store or the data failed (credentials rejected, access denied, missing
bucket, still unreachable at --timeout, corrupt, fenced, the output could not be
written); 130 interrupted (Ctrl-C); 141 the output's reader went away (``| head``: a quiet
stop, as ``cat`` makes, after acking only what was written).
Every failure is one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import typing
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, TextIO

import tieredbuf
from tieredbuf.cli._common import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_PARTIAL,
    EXIT_PIPE,
    EXIT_USAGE,
    GuardedOutput,
    Progress,
    attach_negative_values,
    cli_terms,
    fmt_duration,
    one_line,
    parse_duration,
    parse_size,
    parse_timeout,
    store_args,
    timeout_arg,
)
from tieredbuf.cli.admin import (
    cmd_create_container,
    cmd_gc,
    cmd_grace,
    cmd_inspect,
    inspect_buffer,
)
from tieredbuf.cli.consume import add_parser as add_consume
from tieredbuf.cli.produce import DEMO_STAGE, DEMO_URL, cmd_demo, cmd_drain, cmd_produce
from tieredbuf.cli.queue import add_parsers as add_queue
from tieredbuf.cli.serve import add_parser as add_serve
from tieredbuf.cli.subscribers import cmd as cmd_subscribers
from tieredbuf.cli.verify import add_parser as add_verify
from tieredbuf.cli.work import add_parser as add_work
from tieredbuf.cli.work import split_command
from tieredbuf.errors import (
    BufferNotFoundError,
    ConfigError,
    OutputClosedError,
    OutputError,
    TieredBufError,
)
from tieredbuf.runtime.redact import redact


class _Help(argparse.RawDescriptionHelpFormatter):
    """Every option's help shows its default unless it already says one.  Descriptions
    are wrapped line by line; indented lines are kept as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        import textwrap

        return "\n".join(
            indent + line
            if not line or line[0].isspace()
            else textwrap.fill(line, width, initial_indent=indent, subsequent_indent=indent)
            for line in text.splitlines()
        )

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        d = action.default
        if (
            "default" in text
            or d is None
            or d is False
            or d is argparse.SUPPRESS
            or not action.option_strings
        ):
            return text
        if isinstance(d, timedelta):
            d = fmt_duration(d)
        return f"{text} (default {d})" if text else f"(default {d})"


class _Parser(argparse.ArgumentParser):
    """Usage errors are one line (and exit 2), naming where to find the usage.  A command's
    options and positionals may come in any order (``grace URL --endpoint X 1m``)."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        kw.setdefault("formatter_class", _Help)
        super().__init__(*a, **kw)
        self.intermixed = False
        self._parsing = False

    def error(self, message: str) -> typing.NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_known_args(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        namespace: argparse.Namespace | None = None,
    ) -> tuple[argparse.Namespace, list[str]]:
        if not self.intermixed or self._parsing:
            return super().parse_known_args(args, namespace)
        self._parsing = True  # parse_known_intermixed_args calls back in here, twice
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._parsing = False


class _Commands(argparse._SubParsersAction):  # type: ignore[type-arg]
    """Each command's ``--help`` starts with a description (its one-line help unless it
    has a longer one), and parses options and positionals intermixed."""

    def add_parser(self, name: str, **kw: Any) -> _Parser:
        if "help" in kw:
            kw.setdefault("description", kw["help"][:1].upper() + kw["help"][1:] + ".")
        parser: _Parser = super().add_parser(name, **kw)
        parser.intermixed = True
        return parser


DESCRIPTION = (
    "tieredbuf: a durable buffer between data producers and object storage (S3, MinIO, "
    "Cloudflare R2, Azure Blob, Google Cloud Storage, a local directory).  A buffer is a "
    "URL: s3://bucket/prefix, az://container/prefix, gs://bucket/prefix, file://./dir or a "
    "directory.  Run 'tieredbuf COMMAND --help' "
    "for a command's options; options and positionals may come in any order."
)
EPILOG = (
    "Exit codes: 0 success; 1 partial failure; 2 bad usage or configuration (a wrong URL, "
    "missing credentials, no buffer at a URL that is read); 3 the store or the data failed "
    "(credentials rejected, a missing bucket, still unreachable at --timeout, corrupt, "
    "fenced, output that cannot be written); 130 interrupted; 141 the output's reader went "
    "away (| head: only what was written is acked).  S3 settings (keys, region, "
    "endpoint_url, services sections) come from the flags, the AWS_* environment or a "
    "profile in ~/.aws (AWS_PROFILE), as the aws CLI reads them; Azure settings from the "
    "flags and the AZURE_STORAGE_* environment; GCS's from GOOGLE_APPLICATION_CREDENTIALS "
    "(or the machine's own account).  Every failure is one line on stderr."
)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="tieredbuf", description=DESCRIPTION, epilog=EPILOG)
    p.register("action", "parsers", _Commands)
    p.add_argument("--version", action="version", version=f"tieredbuf {tieredbuf.__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")

    d = sub.add_parser("demo", help="stage, export, consume on a local directory")
    d.add_argument("url", nargs="?", default=DEMO_URL, help=f"the buffer (default {DEMO_URL})")
    d.add_argument(
        "--staging",
        help=f"the producer's staging directory (default {DEMO_STAGE} "
        f"for the default URL, {DEMO_STAGE}-<hash of the URL> for another)",
    )
    d.add_argument(
        "--calls",
        type=int,
        default=50,
        help="produce() calls of 10 records each, in 5 waves (default 50)",
    )
    d.set_defaults(fn=cmd_demo)

    pr = sub.add_parser(
        "produce",
        help="produce one record per input line",
        description="Produce records to the buffer at URL (creating it if there is none): "
        "one record per line of each FILE, or of stdin when no FILE is given.  "
        "Input that is pretty-printed JSON is refused (it is not one record per "
        "line): give --format json to produce the items of one JSON array (or one "
        "object) as records, or compact it with jq -c.  Prints the sequences the "
        "records got once they are in the store and the queue; when the store "
        "keeps failing it gives up after --timeout and exits 3, saying how many "
        "records were not stored.",
    )
    pr.add_argument(
        "url",
        help="the buffer: s3://bucket/prefix, file://./dir or a directory; or a "
        "`tieredbuf serve` to write through: http(s)://host:port[,host2:port2]",
    )
    pr.add_argument(
        "files",
        nargs="*",
        metavar="FILE",
        help="input files, one record per line ('-' or none: stdin)",
    )
    pr.add_argument(
        "--format",
        choices=("lines", "json"),
        default=None,
        help="lines: one record per line, as is (no JSON check); json: the input "
        "is one JSON value, an array's items (or the value itself) become "
        "records, compacted (default: lines, refusing pretty-printed JSON)",
    )
    timeout_arg(pr)
    pr.add_argument(
        "--batch", type=int, default=1000, metavar="N", help="records per produce() call"
    )
    pr.add_argument(
        "--metadata",
        default="",
        metavar="TEXT",
        help="metadata payload for every call (default: empty)",
    )
    pr.add_argument(
        "--flush-interval",
        type=parse_duration,
        default=timedelta(milliseconds=100),
        metavar="DURATION",
        help="the stateless producer's batching window, e.g. 100ms, 1s",
    )
    pr.add_argument(
        "--staging",
        metavar="DIR",
        help="stage the records in DIR first (fsynced there before they are "
        "sent): what the store did not take by --timeout stays there, and "
        "'tieredbuf drain DIR URL' exports it later (default: none, records "
        "not stored by --timeout are dropped)",
    )
    svc = pr.add_argument_group("through the service (an http(s):// URL)")
    svc.add_argument(
        "--token-file",
        metavar="FILE",
        help="the bearer token the service wants (its first line; default: none)",
    )
    svc.add_argument(
        "--ca-file",
        metavar="FILE",
        help="PEM authorities an https:// service's certificate is checked against "
        "(default: the system's)",
    )
    store_args(pr)
    pr.set_defaults(fn=cmd_produce)

    add_consume(sub)
    timeout_arg(sub.choices["consume"], "the store keeps failing an ack")
    add_work(sub)
    add_queue(sub)
    add_verify(sub)
    timeout_arg(sub.choices["retention"])

    ins = sub.add_parser("inspect", help="queue depth, sequence range, bytes, epoch, age")
    ins.add_argument("url")
    ins.add_argument("--json", action="store_true", help="one JSON object")
    ins.add_argument(
        "--quick",
        action="store_true",
        help="skip listing data/ (no stored_objects / missing_objects)",
    )
    store_args(ins)
    ins.set_defaults(fn=cmd_inspect)

    su = sub.add_parser(
        "subscribers",
        help="list subscribers (or: remove URL NAME, redrive URL QUEUE)",
        usage="tieredbuf subscribers URL [--json] | tieredbuf subscribers remove URL NAME | "
        "tieredbuf subscribers redrive URL QUEUE [--sequences 3,7-9] [--drop]",
    )
    su.add_argument("words", nargs="+", metavar="URL | remove URL NAME | redrive URL QUEUE")
    su.add_argument("--json", action="store_true", help="one JSON array")
    su.add_argument(
        "--sequences",
        metavar="LIST",
        help="redrive: only these dead letters, e.g. 3,7-9 (default: all kept ones)",
    )
    su.add_argument(
        "--drop",
        action="store_true",
        help="redrive: drop the dead letters instead (listed still; the buffer may unlink them)",
    )
    timeout_arg(su)
    store_args(su)
    su.set_defaults(fn=cmd_subscribers)

    g = sub.add_parser("gc", help="delete data objects nothing refers to (run from cron)")
    g.add_argument("url")
    g.add_argument(
        "--grace",
        type=parse_duration,
        metavar="DURATION",
        help="e.g. 30m, 2h; honoured only if longer than the buffer's own grace "
        "period (default: the buffer's, see tieredbuf grace)",
    )
    g.add_argument("--dry-run", action="store_true", help="count, delete nothing")
    g.add_argument("--json", action="store_true", help="the report as one JSON object")
    g.add_argument(
        "--loop",
        type=parse_duration,
        metavar="INTERVAL",
        help="run a pass every INTERVAL until SIGTERM, caching the groups it read",
    )
    g.add_argument(
        "--metrics-file",
        metavar="FILE",
        help="write Prometheus metrics here (node_exporter textfile); if it "
        "cannot be written the summary still prints and gc exits 1",
    )
    g.add_argument(
        "--pushgateway",
        metavar="HOST:PORT",
        help="push Prometheus metrics to this Pushgateway; if it is unreachable "
        "the summary still prints and gc exits 1",
    )
    timeout_arg(g)
    store_args(g)
    g.set_defaults(fn=cmd_gc)

    gr = sub.add_parser("grace", help="show or set the buffer's GC grace period (in its root)")
    gr.add_argument("url")
    gr.add_argument(
        "duration",
        nargs="?",
        type=parse_duration,
        metavar="DURATION",
        help="set it (e.g. 10m, 2h; 0 with --force); omit to show it",
    )
    gr.add_argument(
        "--force",
        action="store_true",
        help="allow one under 2 x the link deadline (4m by default), with a warning",
    )
    timeout_arg(gr)
    store_args(gr)
    gr.set_defaults(fn=cmd_grace)

    cc = sub.add_parser(
        "create-container",
        help="create the Azure container of an az:// URL (obstore cannot)",
        description="Create the Azure Blob container an az:// URL names, with the account "
        "key, SAS token or bearer token of the AZURE_STORAGE_* environment (on Azurite: "
        "the well-known development account, see docs/operations.md).  A container "
        "that exists already is fine (exit 0).",
    )
    cc.add_argument("url", help="az://container/prefix (the prefix is ignored)")
    timeout_arg(cc, "the endpoint does not answer")
    store_args(cc)
    cc.set_defaults(fn=cmd_create_container)

    dr = sub.add_parser("drain", help="export a dead producer's stage (another machine's disk)")
    dr.add_argument("stage_dir", help="a staging directory (or a tieredbuf serve stage root)")
    dr.add_argument("url", help="the buffer to export into; must be the stage's own")
    dr.add_argument(
        "--producer-id", metavar="ID", help="only this producer's stage (default: every one)"
    )
    dr.add_argument(
        "--timeout",
        type=parse_timeout,
        default=timedelta(minutes=15),
        metavar="DURATION",
        help="give up (exit 3, saying what is still staged) after this long "
        "while the store keeps failing transiently (default 15m)",
    )
    store_args(dr)
    dr.set_defaults(fn=cmd_drain)

    add_serve(sub)
    return p


class _StderrLog(logging.Handler):
    """tieredbuf's warnings as ``tieredbuf: ...`` lines on the current stderr (retries of
    a store that is down, once per interval), redacted (:mod:`tieredbuf.runtime.redact`).
    Errors that are also raised to the command are skipped: main() prints those once."""

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "tb_raised", False):
            return
        try:
            sys.stderr.write(redact(f"tieredbuf: {record.getMessage()}\n"))
        except Exception:
            self.handleError(record)


def _log_to_stderr() -> None:
    """WARNING and up (``TIEREDBUF_LOG_LEVEL`` to change) from tieredbuf's loggers."""
    logger = logging.getLogger("tieredbuf")
    if not any(isinstance(h, _StderrLog) for h in logger.handlers):
        level = os.environ.get("TIEREDBUF_LOG_LEVEL", "").upper()
        if level not in logging.getLevelNamesMapping():
            level = ""
        logger.addHandler(_StderrLog(level or logging.WARNING))
        if level:
            logger.setLevel(level)


def _gave_up(text: str, args: argparse.Namespace) -> str:
    """A store error a command gave up on names the flag that set how long it tried."""
    timeout = getattr(args, "timeout", None)
    if "gave up after" in text and isinstance(timeout, timedelta):
        return f"{text} (--timeout {fmt_duration(timeout)})"
    return text


def _value_options(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string, of the command and its subcommands, that takes one value."""
    out: set[str] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= _value_options(sub)
        elif action.option_strings and action.nargs is None:
            out.update(action.option_strings)
    return out


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    argv, command = split_command(argv)
    parser = build_parser()
    args = parser.parse_args(attach_negative_values(argv, _value_options(parser)))
    if command is not None:
        args.cmd = command
    _log_to_stderr()
    flags = frozenset(vars(args))

    def say(text: str) -> None:
        print(redact(cli_terms(_gave_up(text, args), flags)), file=sys.stderr)

    stdout = GuardedOutput(out or sys.stdout)
    try:
        code: int = args.fn(args, typing.cast(TextIO, stdout))
        stdout.flush()  # here, where a failure is reported, not at the interpreter's exit
        return code
    except OutputClosedError:  # `| head`: a quiet exit, as cat's
        stdout.silence()
        return EXIT_PIPE
    except OutputError as e:
        stdout.silence()
        say(f"tieredbuf: {one_line(e)}")
        return EXIT_FAILED
    except ConfigError as e:
        say(f"tieredbuf: configuration error: {one_line(e)}")
        return EXIT_USAGE
    except BufferNotFoundError as e:
        say(f"tieredbuf: {one_line(e)}")
        return EXIT_USAGE
    except TieredBufError as e:
        say(f"tieredbuf: {type(e).__name__}: {one_line(e)}")
        return EXIT_FAILED
    except KeyboardInterrupt:
        say("tieredbuf: interrupted")
        return EXIT_INTERRUPTED
    except Exception as e:
        if type(e).__module__.split(".")[0] != "obstore":
            raise
        from tieredbuf.store.obserrors import short

        say(f"tieredbuf: store error: {short(e)}")
        return EXIT_FAILED


def run() -> None:
    """The console script: :func:`main`, then exit.  After Ctrl-C the process exits at
    once (a thread still inside a store request must not hold it up)."""
    try:
        code = main()
    except KeyboardInterrupt:  # between main()'s handlers, or a second Ctrl-C
        print("tieredbuf: interrupted", file=sys.stderr)
        code = EXIT_INTERRUPTED
    if code == EXIT_INTERRUPTED:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


__all__ = [
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_PARTIAL",
    "EXIT_USAGE",
    "Progress",
    "build_parser",
    "inspect_buffer",
    "main",
    "parse_duration",
    "parse_size",
    "run",
]
