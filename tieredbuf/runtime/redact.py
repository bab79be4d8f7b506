"""Keep secrets out of everything tieredbuf emits: errors, log lines, HTTP answers.

Credentials are registered where they enter (the S3 options and ``AWS_*`` variables a
store is opened with, the service's bearer tokens) and :func:`redact` replaces every
occurrence of a registered value in a text with ``***``.  Value-based on purpose: an
object store's error text may quote a request (S3's ``SignatureDoesNotMatch`` body
carries the access key id and the canonical request with the session token) or a
debug dump of the client's configuration, in formats nobody controls.

Every store error is :func:`scrub`-bed (both S3 clients' error mapping) and chained
to a :func:`redacted_copy` of the client's exception, so a traceback cannot print the
raw text either; the service's log handlers use :class:`RedactingFormatter` as a
second line of defence.  Logs name a token by :func:`fingerprint` only.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from typing import TypeVar

MIN_SECRET_LEN = 8
"""Shorter values are not registered: redacting "x" everywhere would garble every
message, and no real key or token is that short."""

MASK = "***"

_lock = threading.Lock()
_secrets: tuple[str, ...] = ()


def register(*values: str | None) -> None:
    """Remember ``values`` (None, and values shorter than :data:`MIN_SECRET_LEN`, are
    ignored) so that :func:`redact` hides them from now on, in this process."""
    global _secrets
    new = {v for v in values if isinstance(v, str) and len(v) >= MIN_SECRET_LEN}
    if not new:
        return
    with _lock:
        # longest first, so a secret that contains another is masked whole
        _secrets = tuple(sorted(set(_secrets) | new, key=len, reverse=True))


def redact(text: str) -> str:
    """``text`` with every registered secret replaced by ``***``."""
    for s in _secrets:
        if s in text:
            text = text.replace(s, MASK)
    return text


E = TypeVar("E", bound=BaseException)


def scrub(e: E) -> E:
    """``e`` with every text argument (its message) :func:`redact`-ed, in place."""
    e.args = tuple(redact(a) if isinstance(a, str) else a for a in e.args)
    return e


def redacted_copy(e: BaseException) -> BaseException:
    """What to chain a mapped error to: an exception of ``e``'s type whose text is
    redacted (chaining ``e`` itself would print its raw text in every traceback); a
    RuntimeError naming the type when the type cannot be built from a message."""
    try:
        return type(e)(redact(str(e)))
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {redact(str(e))}")


def fingerprint(secret: str) -> str:
    """A short, stable name for a secret that reveals nothing usable (for log lines)."""
    return "sha256:" + hashlib.sha256(secret.encode()).hexdigest()[:12]


class RedactingFormatter(logging.Formatter):
    """A formatter whose output (message, arguments and traceback) is :func:`redact`-ed."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


def install(level: str | int | None = None, fmt: str | None = None) -> None:
    """For a process tieredbuf runs (the CLI, a service worker): log to stderr at
    ``level`` through a redacting formatter.  Does nothing when the root logger already
    has handlers (an embedding application configured its own logging)."""
    root = logging.getLogger()
    if root.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(RedactingFormatter(fmt or logging.BASIC_FORMAT))
    root.addHandler(handler)
    root.setLevel(level or logging.INFO)
