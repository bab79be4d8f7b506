"""When a fan-in watcher polls for the holder's next commit (tieredbuf/produce/rhythm.py).

Pure timing: commits and polls are simulated on a virtual clock, so these tests are
exact (no sleeps, no wall clock)."""

from __future__ import annotations

import pytest

from tieredbuf.produce.rhythm import RETRY_MAX_S, RETRY_S, Rhythm, gap

INTERVAL = 0.2  # the default budget: 5 commits/s


def simulate(
    late_ms: float,
    commits: int = 200,
    rtt: float = 0.0,
    lease_ms: int = 5000,
    settle: int = 0,
    stamped: bool = True,
    slow_first: int = 0,
) -> tuple[int, float]:
    """A holder whose commits land ``gap + late_ms`` apart, each renewing its lease for
    ``lease_ms`` (the watcher sees those stamps unless not ``stamped``); a watcher that
    waits on every one.  Returns the polls sent and the worst delay between a commit
    landing and a poll seeing it (from commit ``settle`` on; with ``slow_first``, of
    every commit, also those a poll saw together).  A poll sent at ``t`` reaches the
    store at ``t + rtt / 2``.  ``slow_first``: the first that many commits come a second
    apart, the rest as above (a holder that speeds up)."""
    period = gap(INTERVAL) + late_ms / 1000
    landed = [1.0 + k * period for k in range(commits)]
    if slow_first:
        landed = [
            1.0 + min(k, slow_first) + max(k - slow_first, 0) * period for k in range(commits)
        ]
    stamps = [round(t * 1000) + lease_ms for t in landed]
    r = Rhythm()
    now = 0.9
    seen = -1
    polls = 0
    worst = 0.0
    while seen < commits - 1:
        now = max(now, r.due(INTERVAL, since=0.0))
        polls += 1
        arrives = now + rtt / 2
        newest = max((k for k, t in enumerate(landed) if t <= arrives), default=-1)
        moved = newest > seen
        if moved:
            if slow_first:
                worst = max(
                    [worst]
                    + [arrives - landed[k] for k in range(max(seen + 1, settle), newest + 1)]
                )
            elif newest == seen + 1 and newest >= settle:
                worst = max(worst, arrives - landed[newest])
            seen = newest
        r.polled(now, moved, INTERVAL, stamps[newest] if moved and stamped else None)
        now += rtt  # the answer comes back; the next poll is timed from the send
    return polls, worst


@pytest.mark.parametrize("late_ms", [0.5, 2.0, 5.0])
@pytest.mark.parametrize("rtt", [0.001, 0.03])
def test_a_watcher_finds_a_commit_on_time_with_about_one_poll(late_ms: float, rtt: float) -> None:
    polls, worst = simulate(late_ms, rtt=rtt)
    assert polls <= 200 * 1.15  # a commit a poll, bar the odd retry when one came late
    assert worst <= RETRY_S + late_ms / 1000 + rtt  # and seen at most a retry late


def test_a_commit_that_came_late_is_looked_for_again_a_short_retry_later() -> None:
    r = Rhythm()
    r.polled(10.0, True, INTERVAL)
    assert r.due(INTERVAL, since=0.0) == pytest.approx(10.0 + gap(INTERVAL))
    r.polled(10.0 + gap(INTERVAL), False, INTERVAL)  # not there yet
    assert r.due(INTERVAL, since=0.0) == pytest.approx(10.0 + gap(INTERVAL) + RETRY_S)


def test_after_an_idle_spell_the_poll_waits_for_the_holders_next_beat() -> None:
    """Groups that came after the expected commit cannot be in it: the poll goes on the
    holder's beat after them, not at once (a poll that would only find that commit)."""
    r = Rhythm()
    r.changed(10.0, INTERVAL)
    p = gap(INTERVAL)
    since = 10.0 + 3.4 * p
    assert r.due(INTERVAL, since=since) == pytest.approx(10.0 + 4 * p)
    # groups that came before the expected commit: polled for at its time
    r2 = Rhythm()
    r2.changed(10.0, INTERVAL)
    assert r2.due(INTERVAL, since=10.0 + 0.5 * p) == pytest.approx(10.0 + p)


def test_the_change_is_placed_no_earlier_than_the_poll_before_it() -> None:
    """``changed_at`` is the bracket's lower end (where producers cut their batches)."""
    r = Rhythm()
    r.polled(10.0, False, INTERVAL)
    r.polled(10.05, True, INTERVAL)
    assert r.changed_at == pytest.approx(10.0)
    r.polled(11.0, True, INTERVAL)  # a poll long after: at most an interval before it
    assert r.changed_at == pytest.approx(11.0 - INTERVAL)


@pytest.mark.parametrize("rtt", [0.001, 0.03])
def test_a_holder_late_commit_after_commit_is_looked_for_when_its_commits_come(
    rtt: float,
) -> None:
    """A holder on a saturated machine (16 processes on two cores) committed about once a
    second at a budget of five: after the poll on its beat, retries 50-400 ms apart cost
    its watchers six or seven polls a commit, most of them 304s (the cost benchmark's
    trace).  Its leases' expiry times say how far apart its commits come: about three
    polls a commit now, and once two spacings are known each commit is seen within a
    retry and a round trip (the retries alone saw them up to 0.4 s late)."""
    late = 1000 - gap(INTERVAL) * 1000
    polls, worst = simulate(late_ms=late, commits=60, rtt=rtt, settle=4)
    assert polls <= 60 * 3.1
    assert worst <= 2 * RETRY_S + rtt


def test_a_holder_that_speeds_up_is_seen_on_its_beat_again() -> None:
    """A holder a second late for sixty commits, then on time: the poll on its beat
    finds the next commit, so the stamps of two commits in a row teach the watcher the
    new spacing.  Polling first at 0.9 of the spacing seen (tried, and reverted) never
    learned it: each poll saw several commits at once, their stamps a second apart,
    and every commit after the speed-up was seen up to 0.55 s late."""
    _, worst = simulate(late_ms=0.0, commits=200, slow_first=60, settle=80)
    assert worst <= RETRY_S + 0.001


def test_commits_late_without_lease_stamps_still_cost_the_retries() -> None:
    """The same holder seen without stamps (the spacing unknown): the retries alone,
    which is what the estimate saves."""
    late = 1000 - gap(INTERVAL) * 1000
    polls, _ = simulate(late_ms=late, commits=20, stamped=False)
    stamped, _ = simulate(late_ms=late, commits=20)
    assert polls >= 20 * 4.5
    assert stamped < 0.8 * polls


def test_a_new_holder_starts_with_no_spacing() -> None:
    """The late holder's spacing does not hold back the polls for the next holder's
    commits (nor this hub's own turn as holder)."""
    r = Rhythm()
    for k in range(4):
        r.polled(10.0 + k, True, INTERVAL, 20_000 + 1000 * k)
    assert r.spacing == pytest.approx(1.0)
    r.polled(14.0, True, INTERVAL, None)  # the lease changed hands
    assert r.spacing == 0.0
    r.polled(14.0 + gap(INTERVAL), False, INTERVAL)
    assert r.due(INTERVAL, since=0.0) == pytest.approx(14.0 + gap(INTERVAL) + RETRY_S)
    for k in range(4):
        r.polled(20.0 + k, True, INTERVAL, 40_000 + 1000 * k)
    r.changed(25.0, INTERVAL)  # our own commit
    assert r.spacing == 0.0


@pytest.mark.parametrize(("late_s", "most"), [(1.0, 6), (3.0, 11)])
def test_a_holder_running_late_costs_a_few_polls_not_one_every_retry(
    late_s: float, most: int
) -> None:
    """A commit one or three seconds late (a slow or saturated store, a busy machine):
    the retries double from 50 ms to 0.4 s, so 6 and 11 polls find it where a poll
    every 50 ms took 21 and 61 (and doubling every second retry 8 and 13), and it is
    seen at most 0.4 s late."""
    r = Rhythm()
    r.polled(10.0, True, INTERVAL)
    lands = 10.0 + gap(INTERVAL) + late_s
    polls = 0
    while True:
        t = r.due(INTERVAL, since=0.0)
        polls += 1
        if t >= lands:
            break
        r.polled(t, False, INTERVAL)
    assert polls <= most
    assert t - lands <= RETRY_MAX_S


def test_a_hub_that_committed_itself_starts_its_next_retries_short() -> None:
    """A watcher that missed a late commit many times, then held the lease and
    committed, and then watched again: its first retry is the short one, not the
    0.4 s it had backed off to."""
    r = Rhythm()
    r.polled(10.0, True, INTERVAL)
    t = 10.0
    for _ in range(6):  # a late holder: the retries back off
        t = r.due(INTERVAL, since=0.0)
        r.polled(t, False, INTERVAL)
    assert r.due(INTERVAL, since=0.0) - t == pytest.approx(RETRY_MAX_S)
    r.changed(20.0, INTERVAL)  # our own commit
    r.polled(20.0 + gap(INTERVAL), False, INTERVAL)  # as a watcher: the beat missed
    assert r.due(INTERVAL, since=0.0) == pytest.approx(20.0 + gap(INTERVAL) + RETRY_S)
