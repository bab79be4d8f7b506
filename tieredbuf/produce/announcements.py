"""The committer's reader of ``queue/pending/``: each announcement read once, cached
until it is gone, and the committed (or never committable) ones deleted together, at
most once a second.

An announcement is a hub's hand-over of its writers' uploaded appends
(:mod:`tieredbuf.format.announce`); the commit hub holding the lease
(:mod:`tieredbuf.produce.fanin`) reads every one listed -- from its key, without a GET,
when the key spells it out (:mod:`tieredbuf.format.spelled`: one writer's appends of
up to about 50 ``produce()`` calls, the common case).
A damaged announcement (I7) cannot be committed.  Its writers' later appends do not go
in past it: each run names the append it follows, and the commit's chain rule
(:mod:`tieredbuf.queue.commit`) holds a run back until that one is in; the writers'
hub announces the damaged one's groups again (:mod:`tieredbuf.produce.watch_turn`).  A
damaged announcement is deleted once it has been listed for :data:`DAMAGED_KEEP_S` (at
once by the hub that wrote it: it commits its own groups from memory).
Announcements of an older tieredbuf (forms 1 and 2, body version 2) name no append they
follow: none of those is committed past a damaged announcement of the same announcer,
and that damaged one is kept while any of them is listed.

A committed announcement (the watermarks cover it) is deleted with the others of the
last second in one request, not one request a commit: its LISTs skip it meanwhile (it
is never read or committed again), and the hub deletes every one before it gives the
lease up (:meth:`AnnouncementReader.sweep`).  One left behind by a holder that died is
read once more by the next holder, found covered and deleted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

from tieredbuf import errors, keys
from tieredbuf.format import announce as fa
from tieredbuf.format.manifest import Watermark
from tieredbuf.format.spelled import FORM_3, runs_of
from tieredbuf.queue.commit import age_ms
from tieredbuf.runtime.stats import Stats
from tieredbuf.store.base import ObjectMeta, Store

log = logging.getLogger(__name__)

DAMAGED_KEEP_S = 60.0
"""A damaged announcement is deleted once listed this long (its writers' hub announces
their groups again within a few commits)."""
PARALLEL = 32
"""Announcements read at once (8 fell behind at S3's round trips)."""
SWEEP_EVERY_S = 1.0
"""Committed announcements are deleted together at most this often (one DELETE a commit
was as many requests as the commits themselves)."""

Runs = tuple[fa.Announcement, ...]
"""An announcement's runs (a writer's appends each)."""


class AnnouncementReader:
    """Reads what a LIST of ``queue/pending/`` found, for one commit hub."""

    def __init__(
        self,
        store: Store,
        stats: Stats,
        clock: Callable[[], float] = time.monotonic,
        own: str | None = None,
    ) -> None:
        self.store = store
        self.stats = stats
        self.clock = clock
        self.own = own
        """This hub's announcer id: its own announcements it commits from memory, so a
        damaged one of its own is deleted at once."""
        self._cache: dict[str, tuple[object, Runs | None, bool, float]] = {}
        """key: (version as listed, runs, legacy, first listed); runs None: damaged (read
        again only once its version changes); legacy: an older tieredbuf's (no ``after``)."""
        self._pool = ThreadPoolExecutor(PARALLEL, thread_name_prefix="tb-fanin")
        self._committed: dict[str, None] = {}  # covered, not deleted yet (in order)
        self._swept = clock()
        self._failed = False

    def read(self, listed: list[ObjectMeta]) -> dict[str, Runs]:
        """The announcements listed that may be committed, by key (each version GET once;
        none committed already; no older tieredbuf's after a damaged one of its
        announcer).  A damaged one listed for :data:`DAMAGED_KEEP_S` is retired."""
        live = {m.key: (m.etag, m.size, m.last_modified) for m in listed}
        for k in [k for k, c in self._cache.items() if live.get(k) != c[0]]:
            del self._cache[k]
        self._committed = {k: None for k in self._committed if k in self._cache}
        now = self.clock()
        new = []
        for k in live:
            if k in self._cache or not keys.parse_pending_key(k):
                continue
            if (spelled := self._spelled(k, live[k][1])) is not None:
                self._cache[k] = (live[k], spelled[0], spelled[1], now)
            else:
                new.append(k)
        if new:
            for k, (found, runs, legacy) in zip(new, self._pool.map(self._get, new), strict=True):
                if found:
                    self._cache[k] = (live[k], runs, legacy, now)
        damaged: dict[str, int] = {}
        for k, (_, runs, _, _) in self._cache.items():
            if runs is None and (parsed := keys.parse_pending_key(k)) is not None:
                damaged[parsed[0]] = min(parsed[1], damaged.get(parsed[0], parsed[1]))
        out = {}
        legacy_after: set[str] = set()
        for k, (_, runs, legacy, _) in self._cache.items():
            parsed = keys.parse_pending_key(k)
            if runs is None or parsed is None or k in self._committed:
                continue
            if legacy and parsed[0] in damaged and parsed[1] > damaged[parsed[0]]:
                self.stats.incr("announcements_held_back")
                legacy_after.add(parsed[0])
                continue
            out[k] = runs
        for k, (_, runs, _, seen) in self._cache.items():
            parsed = keys.parse_pending_key(k)
            own = parsed is not None and parsed[0] == self.own
            if (
                runs is None
                and parsed is not None
                and parsed[0] not in legacy_after
                and (own or now - seen >= DAMAGED_KEEP_S)
                and k not in self._committed
            ):
                self._committed[k] = None
                self.stats.incr("announcements_damaged_deleted")
                log.warning(
                    "%s: a damaged announcement listed for %.0f s; deleted (its "
                    "writers' hub announces their groups again)",
                    k,
                    now - seen,
                )
        return out

    def retire(
        self,
        anns: dict[str, Runs],
        watermarks: Mapping[str, Watermark],
        now_ms: int,
        expired_after_ms: int,
    ) -> dict[str, Runs]:
        """The announcements whose every run ``watermarks`` (a root as written) cover, or
        names a data object older than ``expired_after_ms`` (the whole grace period: GC
        may have deleted that, so it can never be committed; a live writer uploads its
        data again well before, :mod:`tieredbuf.produce.refresh`, and no writer is told
        REMOTE without its own entry, I10), are skipped from now on and deleted by the
        next :meth:`sweep` that is due; returns the others."""
        rest = {}
        for k, runs in anns.items():
            expired = []
            for a in runs:
                wm = watermarks.get(a.producer_id)
                if wm is not None and a.last_seq <= wm.producer_seq:
                    continue
                if not any(age_ms(e.location, now_ms) > expired_after_ms for e in a.entries):
                    break
                expired.append(a.producer_id)
            else:
                self._committed[k] = None
                if expired:
                    self.stats.incr("announcements_expired")
                    log.warning(
                        "%s: an announcement of %s names data older than the GC grace period "
                        "(GC may have deleted it): it can never be committed; deleted (a live "
                        "writer has uploaded its data again and announced it again)",
                        k,
                        ", ".join(expired),
                    )
                continue
            rest[k] = runs
        self.sweep()
        return rest

    def sweep(self, force: bool = False) -> None:
        """Delete the committed announcements in one request, at most once every
        :data:`SWEEP_EVERY_S` unless ``force`` (the hub gives the lease up, or lost it;
        after a failed delete it waits that long too).  A key that failed stays to be
        deleted by the next sweep; one deleted elsewhere meanwhile leaves the LIST, and
        :meth:`read` forgets it."""
        now = self.clock()
        wait = not force or self._failed
        if not self._committed or (wait and now - self._swept < SWEEP_EVERY_S):
            return
        done = list(self._committed)
        self._swept = now
        try:
            failed = {k for k, _ in self.store.delete_many(done)}
        except errors.StoreError as e:  # a cleanup: never the writers' failure
            failed = set(done)
            log.warning("could not delete %d committed announcement(s): %s", len(done), e)
        else:
            if failed:
                log.warning(
                    "could not delete %d committed announcement(s), e.g. %s",
                    len(failed),
                    min(failed),
                )
        self._failed = bool(failed)
        self.stats.incr("announcements_deleted", len(done) - len(failed))
        for k in done:
            if k not in failed:
                self._committed.pop(k, None)
                self._cache.pop(k, None)

    def _spelled(self, key: str, size: int) -> tuple[Runs, bool] | None:
        """The runs ``key`` spells out (its key form: no GET) and whether an older
        tieredbuf spelled them (no ``after``), or None: it has none, or one whose CRC or
        length (``size``, as listed) is not its body's (then the body is read)."""
        text = keys.pending_key_form(key)
        if text is None:
            return None
        try:
            runs = runs_of(text, size, obj=key)
        except errors.CorruptError as e:
            log.warning("%s: %s; reading its body", key, e)
            return None
        self.stats.incr("announcements_read")
        self.stats.incr("announcements_read_from_key")
        return runs, not text.startswith(FORM_3)

    def _get(self, key: str) -> tuple[bool, Runs | None, bool]:
        """(False, None, False) when gone (committed and deleted since); else its runs
        (None when damaged) and whether an older tieredbuf wrote it (no ``after``)."""
        try:
            raw = self.store.get(key).data
        except errors.ObjectNotFoundError:
            return False, None, False
        self.stats.incr("announcements_read")
        try:
            runs = fa.decode(raw, obj=key)
        except errors.CorruptError as e:
            log.error(
                "the announcement %s is damaged (%s): it is never committed, nor anything of "
                "its writers past it; their hub announces them again",
                key,
                e,
            )
            self.stats.incr("announcements_corrupt")
            return True, None, False
        return True, runs, fa.version_of(raw) < fa.VERSION
