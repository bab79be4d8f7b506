"""The bearer tokens ``tieredbuf serve`` accepts, and where they come from.

Tokens come from ``--token-file`` (one per line; blank lines and ``#`` comments
skipped) or from the environment variable :data:`TOKENS_ENV` (separated by commas or
whitespace).  Several tokens may be valid at once, which is how a token is rotated:
add the new one, move the clients, remove the old one.  The file is re-read when it
changes (checked at most every :data:`RELOAD_CHECK_S` seconds, on the next request)
and on SIGHUP; a file that cannot be read or holds no token keeps the tokens in use
(a half-written file never locks everyone out) and logs an error, once for each
version of the bad file.  Tokens from the environment are fixed for the life of the
process.

The supervisor keeps the last good tokens of the file in a snapshot under the stage
root (owner-only, replaced by rename), checked as often as its loop turns and on
SIGHUP.  A worker that starts while the file is unusable -- restarted in the middle
of an edit -- serves with that snapshot and says so, instead of exiting (three such
exits in a row stopped the whole service).  It takes the file again at its next
change.  The snapshot can lag the file by one turn of the supervisor's loop.

No token is ever logged or echoed: log lines name tokens by
:func:`tieredbuf.runtime.redact.fingerprint`, and every token is registered with
:mod:`tieredbuf.runtime.redact`.  Standard library only: the supervisor imports this
module and never the worker's web stack.
"""

from __future__ import annotations

import hmac
import logging
import os
import re
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tieredbuf.errors import ConfigError
from tieredbuf.runtime import redact
from tieredbuf.runtime.fsutil import write_private

log = logging.getLogger("tieredbuf.service.auth")

TOKENS_ENV = "TIEREDBUF_SERVICE_TOKENS"
"""Environment variable holding the service's bearer tokens (comma/space separated)."""
RELOAD_CHECK_S = 1.0
MIN_TOKEN_LEN = 16
_TOKEN_RE = re.compile(r"^[A-Za-z0-9\-._~+/]+=*$")  # RFC 6750 b64token


@dataclass(frozen=True, slots=True)
class Decision:
    status: int  # 200 (allowed), 401 or 403
    reason: str


def parse_tokens(text: str, where: str) -> tuple[str, ...]:
    """The tokens in ``text`` (one or more per line, ``#`` comments); ConfigError for a
    token that is too short or not RFC 6750 token characters (never echoing it)."""
    out: list[str] = []
    for n, line in enumerate(text.splitlines(), start=1):
        for tok in re.split(r"[\s,]+", line.split("#", 1)[0].strip()):
            if not tok:
                continue
            if len(tok) < MIN_TOKEN_LEN or not _TOKEN_RE.match(tok):
                raise ConfigError(
                    f"{where} line {n}: a token must be at least {MIN_TOKEN_LEN} characters "
                    "of A-Z a-z 0-9 - . _ ~ + / (then = padding)"
                )
            out.append(tok)
    return tuple(dict.fromkeys(out))


SNAPSHOT_NAME = ".tokens"
"""The supervisor's snapshot of the last good token file, under the stage root."""


def snapshot_path(staging_root: str | Path) -> Path:
    return Path(staging_root) / SNAPSHOT_NAME


def _signature(st: os.stat_result) -> tuple[int, int, int]:
    """What tells a changed token file: its modification time, size and inode."""
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def _describe(tokens: tuple[str, ...]) -> str:
    return ", ".join(redact.fingerprint(t) for t in tokens)


class TokenSet:
    """The tokens accepted now; thread-safe; reloads its file."""

    def __init__(
        self, token_file: str | None = None, env: str | None = None, *, fallback: Path | None = None
    ) -> None:
        """``fallback``: a snapshot of the supervisor's, taken when the file is unusable
        (a worker started in the middle of an edit); without one, ConfigError."""
        if token_file and env:
            raise ConfigError(f"tokens from both --token-file and ${TOKENS_ENV}: use one")
        self._file = Path(token_file) if token_file else None
        self._lock = threading.Lock()
        self._signature: tuple[int, int, int] | None = None
        self._bad: tuple[int, int, int] | None = None  # the unusable file last logged
        self._next_check = 0.0
        self.reloads = 0
        if self._file is not None:
            try:
                tokens, self._signature = self._file_tokens()
                source = f"file {self._file}"
            except ConfigError as e:
                if fallback is None or not fallback.exists():
                    raise
                tokens = parse_tokens(fallback.read_text(encoding="utf-8"), f"{fallback}")
                if not tokens:
                    raise
                self._bad = self._stat_signature()
                log.error(
                    "%s: serving with the %d token(s) the supervisor last checked, until "
                    "the file changes",
                    e,
                    len(tokens),
                )
                source = f"the supervisor's snapshot {fallback}"
        elif env:
            tokens = parse_tokens(env, f"${TOKENS_ENV}")
            if not tokens:
                raise ConfigError(f"${TOKENS_ENV} holds no token")
            source = f"${TOKENS_ENV}"
        else:
            raise ConfigError(f"no tokens: give --token-file or set ${TOKENS_ENV}")
        redact.register(*tokens)
        self._tokens = tokens
        log.info(
            "bearer authentication: %d token(s) from %s (%s)",
            len(tokens),
            source,
            _describe(tokens),
        )

    @classmethod
    def from_config(cls, token_file: str | None, fallback: Path | None = None) -> TokenSet | None:
        """The service's tokens, or None when neither source is set (no auth)."""
        env = os.environ.get(TOKENS_ENV) or None
        if not token_file and not env:
            return None
        return cls(token_file, env, fallback=fallback)

    @property
    def count(self) -> int:
        return len(self._tokens)

    def _read_file(self) -> tuple[tuple[str, ...], tuple[int, int, int]]:
        assert self._file is not None
        try:
            st = self._file.stat()
            text = self._file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read token file {self._file}: {type(e).__name__}") from None
        if st.st_mode & stat.S_IROTH:
            log.warning("token file %s is readable by every user (chmod 600 it)", self._file)
        return parse_tokens(text, f"token file {self._file}"), _signature(st)

    def _file_tokens(self) -> tuple[tuple[str, ...], tuple[int, int, int]]:
        tokens, sig = self._read_file()
        if not tokens:
            raise ConfigError(f"token file {self._file} holds no token")
        return tokens, sig

    def _stat_signature(self) -> tuple[int, int, int]:
        assert self._file is not None
        try:
            st = self._file.stat()
        except OSError:
            return (0, 0, 0)  # no file: one signature for as long as it stays away
        return _signature(st)

    def reload(self, *, force: bool = True) -> bool:
        """Re-read the token file if it changed (always, with ``force``); True when the
        tokens were replaced.  Keeps the current tokens if the file is unusable, and
        logs that once for each version of the bad file."""
        if self._file is None:
            return False
        with self._lock:
            sig = self._stat_signature()
            if not force and sig in (self._signature, self._bad):
                return False
            try:
                tokens, sig = self._file_tokens()
            except ConfigError as e:
                self._bad = sig
                log.error(
                    "token file not reloaded, keeping the %d token(s) in use: %s",
                    len(self._tokens),
                    e,
                )
                return False
            self._bad = None
            redact.register(*tokens)
            changed = tokens != self._tokens
            self._tokens, self._signature = tokens, sig
            self.reloads += 1
        if changed:
            log.info(
                "bearer tokens reloaded from %s: %d token(s) (%s)",
                self._file,
                len(tokens),
                _describe(tokens),
            )
        return changed

    def maybe_reload(self) -> bool:
        """Re-read the file if its mtime, size or inode changed (at most every second);
        True when the tokens were replaced."""
        now = time.monotonic()
        if self._file is None or now < self._next_check:
            return False
        self._next_check = now + RELOAD_CHECK_S
        return self.reload(force=False)

    def save(self, path: Path) -> None:
        """Write the tokens in use to ``path`` (owner-only, replaced by rename): the
        supervisor's snapshot for workers that start while the file is unusable."""
        tmp = path.with_name(path.name + ".tmp")
        text = "# tieredbuf serve: the last good tokens of --token-file\n"
        write_private(tmp, (text + "".join(f"{t}\n" for t in self._tokens)).encode())
        os.replace(tmp, path)

    def check(self, authorization: str | None) -> Decision:
        """401 without (well-formed) bearer credentials, 403 for a token that matches none."""
        if not authorization:
            return Decision(401, "missing")
        scheme, _, cred = authorization.strip().partition(" ")
        cred = cred.strip()
        if scheme.lower() != "bearer" or not cred:
            return Decision(401, "not bearer")
        self.maybe_reload()
        given = cred.encode("utf-8", "surrogateescape")
        ok = False
        for t in self._tokens:  # no early exit: every token is compared
            ok |= hmac.compare_digest(given, t.encode())
        return Decision(200, "ok") if ok else Decision(403, "wrong token")
