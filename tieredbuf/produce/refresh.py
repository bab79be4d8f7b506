"""The GC grace rule, as a writer keeps it: data that waited too long for its commit is
uploaded again under fresh keys before it is appended (I5).

A committer holds back any data object older than half the buffer's GC grace period by
its own clock (:mod:`tieredbuf.queue.commit`: GC, which deletes unreferenced objects
past the whole grace period, may judge it garbage).  A writer does not wait to be held
back: once an upload of its is :data:`REFRESH_AT` of that half old by the writer's own
clock, the writer uploads it again and announces (or commits) the fresh object, so a
committer whose clock is up to the rest of that half ahead still takes it
(docs/architecture.md, "Clocks").  A commit that held back one of its own hub's groups
refreshes it too.  The old object is an orphan for GC.
"""

from __future__ import annotations

import logging

from tieredbuf.produce.hub_state import Group, HubState
from tieredbuf.queue.commit import age_ms

log = logging.getLogger(__name__)

REFRESH_AT = 0.8
"""A writer refreshes its data at this part of half the grace period (0.4 of the grace
period: 4 minutes of the default 10): a committer's clock may be ahead of the writer's by
the rest (a minute at the default) before a fresh upload waits for a second one."""


def refresh(st: HubState, g: Group, why: str) -> bool:
    """Upload ``g``'s data objects again under fresh keys, to be announced (or committed)
    again; False when its writer cannot (a writer that does not refresh)."""
    if g.refresh is None:
        return False
    fresh = g.refresh(g.entries)
    st.stats.incr("reannounced_for_grace")
    log.warning(
        "%s: appends waited too long for their commit (%s); uploaded again", g.producer_id, why
    )
    with st.cond:
        g.refreshed(fresh)
    return True


def refresh_aging(st: HubState) -> None:
    """Refresh every waiting group whose oldest upload is :data:`REFRESH_AT` of half the
    grace period old by this process's clock (no request while none is)."""
    view = st.view
    if view is None:
        return
    limit = int(st.max_age_ms(view) * REFRESH_AT)
    now = st.wall_ms()
    with st.cond:
        aging = [
            g
            for g in st.groups()
            if g.refresh is not None and any(age_ms(e.location, now) > limit for e in g.entries)
        ]
    for g in aging:
        refresh(st, g, f"older than {limit / 1000:.0f} s by this process's clock")
