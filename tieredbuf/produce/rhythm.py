"""When a fan-in watcher looks for the holder's next commit (pure: times in, times out).

A watcher (a hub that does not hold the commit lease, :mod:`tieredbuf.produce.fanin`)
learns that the holder committed only by reading the root.  The holder sends its commits
a little over an interval apart (:func:`gap`), so one poll an interval after the poll
that saw the last commit finds the next one -- unless that commit came late (a slow
CAS, a busy holder), and then a few short retries do.  Each poll brackets the change it
sees: after the previous poll was sent, before this one was.

Two times come out of that bracket:

* :attr:`Rhythm.next_poll`, from its upper end (this poll's send time): a commit seen
  by a poll sent at ``t`` landed before ``t`` (plus half a round trip), so the next one,
  sent at least :func:`gap` later, has landed when a poll sent at ``t + gap`` arrives,
  unless it was late.  A poll aimed at the bracket's lower end missed nearly every time
  (the holder's period is never shorter than the gap): two reads a commit instead of one
  (the cost benchmark's trace, docs/benchmarks.md).  Times are send times, not answer
  times: timing from the answer moved every poll later by a round trip, and at S3's
  round trips commits were seen up to an interval late.
* :attr:`Rhythm.changed_at`, from its lower end: when the root changed, as early as the
  watcher can tell -- where its producers cut their batches so that the announcement
  beats the holder's LIST (``CommitHub.next_commit_in``).

A holder that runs late commit after commit (16 processes on two cores: about once a
second at a budget of five) would cost every watcher the retries each time, six or seven
polls a commit, most of them 304s.  Its commits say how far apart they come: each renews
its lease by the same length, so two lease expiry times seen in a row are as far apart
as their commits were (the holder's clock; only differences are used, so clock skew does
not matter).  After the poll on the beat finds nothing, the retry waits until the
holder's commits have been coming (:attr:`Rhythm.spacing`), then the short retries go on.
A holder on time changes nothing: its spacing is the gap.
"""

from __future__ import annotations

from dataclasses import dataclass

from tieredbuf.runtime.stats import ewma

RETRY_S = 0.05
"""A poll that found no commit where one was due looks again this much later (at most a
quarter interval; a 304), then twice as long each time up to 8 times (at most an
interval, or 0.4 s where that is shorter): a holder running late (a slow or saturated
store, a busy machine) costs a few polls, not one every 50 ms.  Doubling only every
second retry cost the cost benchmark's 16 processes on two cores, whose holder's
commits come late and irregularly, 15 % more requests in all, and bought no latency
(docs/benchmarks.md)."""
RETRY_MAX_S = 0.4


def gap(interval: float) -> float:
    """Seconds between two commits as the holder sends them: a little over the interval
    (building one varies by a few ms, and a per-key limited store counts every write)."""
    return interval * 1.02 + 0.005


@dataclass
class Rhythm:
    """A watcher's view of the holder's commits, in ``time.monotonic()`` seconds."""

    changed_at: float = 0.0
    """The root's last change seen, as early as the polls bound it."""
    next_poll: float = 0.0
    """When the poll for the next commit is due (0: now)."""
    polled_at: float = 0.0
    """When the last poll was sent."""
    misses: int = 0
    """Polls since the one due found no commit."""
    seen_at: float = 0.0
    """When the poll that saw the last commit was sent (or this hub's own commit)."""
    spacing: float = 0.0
    """The holder's commits, seconds apart, as their leases' expiry times say (0: not
    known yet)."""
    stamp: int | None = None
    """The lease expiry of the last commit seen (the holder's clock, ms)."""

    def changed(self, at: float, interval: float) -> None:
        """The root changed at ``at`` (this hub's own commit, or a read that saw one)."""
        self.changed_at = self.seen_at = at
        self.next_poll = at + gap(interval)
        self.misses = 0  # a retry as a watcher again starts short
        self.stamp, self.spacing = None, 0.0  # our own lease: the next holder's is new

    def due(self, interval: float, since: float) -> float:
        """When to send the next poll, for groups waiting since ``since`` (the oldest).  Not
        polled for the expected commit yet: at its time -- or, when that commit came before
        the groups did (nobody waited on it), at the first one after them on the holder's
        beat.  Polled for it and not found: a short retry after the last poll."""
        if self.next_poll > self.polled_at:
            period = gap(interval)
            if self.next_poll < since:
                self.next_poll += -((self.next_poll - since) // period) * period
            return self.next_poll
        retry = max(min(interval / 4, RETRY_S), 0.02) * (1 << min(max(self.misses - 1, 0), 3))
        at = self.polled_at + min(retry, max(interval, RETRY_MAX_S))
        # a holder whose commits come late, one after another (a busy machine): after the
        # poll on its beat, look again when its commits have been coming, not every 50 ms
        return max(at, self.seen_at + 0.9 * self.spacing)

    def polled(self, sent: float, moved: bool, interval: float, stamp: int | None = None) -> None:
        """A poll sent at ``sent`` found the root ``moved`` (or not); ``stamp``: the
        lease expiry of the commit it found (a holder renews its lease by the same
        length each commit, so two of them are as far apart as the commits were), None
        when the lease changed hands (the spacing starts again)."""
        before, self.polled_at = self.polled_at, sent
        self.misses = 0 if moved or self.next_poll > sent else self.misses + 1
        if moved:
            self.changed_at = max(before, sent - interval)
            self.seen_at = sent
            self.next_poll = sent + gap(interval)
            self._space(stamp, interval)

    def _space(self, stamp: int | None, interval: float) -> None:
        last, self.stamp = self.stamp, stamp
        if stamp is None:  # no lease, or another holder's: its spacing is not known yet
            self.spacing = 0.0
            return
        if last is None or stamp <= last:
            return
        d = (stamp - last) / 1000
        if d > 10 * max(gap(interval), self.spacing):
            return  # another lease length (or holder), not a spacing
        if self.spacing:  # two commits in one bracket count as one spacing, not two
            d = min(d, 2 * self.spacing)
        self.spacing = ewma(self.spacing, d)
