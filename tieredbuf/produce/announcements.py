"""The committer's reader of ``queue/pending/``: each announcement read once, cached
until it is gone, none committed past a damaged one of the same announcer, and the
committed ones deleted together, at most once a second.

An announcement is a hub's hand-over of its writers' uploaded appends
(:mod:`tieredbuf.format.announce`); the commit hub holding the lease
(:mod:`tieredbuf.produce.fanin`) reads every one listed -- from its key, without a GET,
when the key spells it out (:mod:`tieredbuf.format.spelled`: one writer's appends of
up to about 50 ``produce()`` calls, the common case).
A damaged announcement (I7) cannot be committed, and neither can any later one of its
announcer: those may carry the same writers' later appends, and a watermark moved past
the damaged one's appends would cover them -- their writers would be told REMOTE for
records never appended.  So the announcer's writers wait (and time out, loudly) instead.

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
from tieredbuf.format.spelled import runs_of
from tieredbuf.queue.commit import age_ms
from tieredbuf.runtime.stats import Stats
from tieredbuf.store.base import ObjectMeta, Store

log = logging.getLogger(__name__)

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
        self, store: Store, stats: Stats, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.store = store
        self.stats = stats
        self.clock = clock
        self._cache: dict[str, tuple[object, Runs | None]] = {}  # key: (version, runs)
        """None: damaged (read again only once its version changes)."""
        self._pool = ThreadPoolExecutor(PARALLEL, thread_name_prefix="tb-fanin")
        self._committed: dict[str, None] = {}  # covered, not deleted yet (in order)
        self._swept = clock()
        self._failed = False

    def read(self, listed: list[ObjectMeta]) -> dict[str, Runs]:
        """The announcements listed that may be committed, by key (each version GET once;
        none of an announcer after a damaged one of its own, none committed already)."""
        live = {m.key: (m.etag, m.size, m.last_modified) for m in listed}
        for k in [k for k, (v, _) in self._cache.items() if live.get(k) != v]:
            del self._cache[k]
        self._committed = {k: None for k in self._committed if k in self._cache}
        new = []
        for k in live:
            if k in self._cache or not keys.parse_pending_key(k):
                continue
            if (spelled := self._spelled(k, live[k][1])) is not None:
                self._cache[k] = (live[k], spelled)
            else:
                new.append(k)
        if new:
            for k, (found, runs) in zip(new, self._pool.map(self._get, new), strict=True):
                if found:
                    self._cache[k] = (live[k], runs)
        damaged: dict[str, int] = {}
        for k, (_, runs) in self._cache.items():
            if runs is None and (parsed := keys.parse_pending_key(k)) is not None:
                damaged[parsed[0]] = min(parsed[1], damaged.get(parsed[0], parsed[1]))
        out = {}
        for k, (_, runs) in self._cache.items():
            parsed = keys.parse_pending_key(k)
            if runs is None or parsed is None or k in self._committed:
                continue
            if parsed[0] in damaged and parsed[1] > damaged[parsed[0]]:
                self.stats.incr("announcements_held_back")
                continue
            out[k] = runs
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
        may have deleted that, and a live writer would have uploaded it again and
        re-announced by half the grace period -- its writer died, and never got an ack
        for it), are skipped from now on and deleted by the next :meth:`sweep` that is
        due; returns the others."""
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
                        "%s: an announcement of %s outlived the GC grace period "
                        "unrefreshed (its writer is gone); deleted",
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

    def _spelled(self, key: str, size: int) -> Runs | None:
        """The runs ``key`` spells out (its key form: no GET), or None: it has none, or
        one whose CRC or length (``size``, as listed) is not its body's (then the body
        is read)."""
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
        return runs

    def _get(self, key: str) -> tuple[bool, Runs | None]:
        """(False, None) when gone (committed and deleted since); else its runs, None when
        damaged."""
        try:
            raw = self.store.get(key).data
        except errors.ObjectNotFoundError:
            return False, None
        self.stats.incr("announcements_read")
        try:
            return True, fa.decode(raw, obj=key)
        except errors.CorruptError as e:
            log.error(
                "the announcement %s is damaged (%s): neither it nor any later announcement of "
                "its announcer is committed; their writers wait and time out",
                key,
                e,
            )
            self.stats.incr("announcements_corrupt")
            return True, None
