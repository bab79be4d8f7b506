"""How a worker paces its refills (pure: measurements in, numbers out).

A refill is one CAS of the progress object: 60-100 ms at S3's round trips, more when
several workers contend for it.  A worker measures how long its refills take and how
long its caller takes per entry, and from those two numbers decides

* :func:`claim_n` -- how many entries the next refill leases;
* :func:`low_water` -- how few entries may be left before the next refill starts ahead,
  in the background, so that ``claim()`` rarely waits for a CAS.
"""

from __future__ import annotations

import math


def claim_n(
    *,
    base: int,
    cap: int,
    refill_s: float | None,
    item_s: float | None,
    lease_s: float,
    ready: int,
    max_span: int,
    workers: int,
) -> int:
    """Entries to lease in the next refill: ``base`` (``claim_batch``), or more when a
    refill takes long against the caller's processing speed: about twice the refill
    time's worth of entries, at most ``cap`` (``max_claim_batch``), never more than the
    worker processes in half a lease counting the ``ready`` entries it already holds (so
    none lapses before its turn), and never more than a third of its share of
    ``max_span`` among the ``workers`` at work (each holds about three batches of the
    span: acked but not yet applied, ready, and the refill's), so that the span does not
    fill and stall them all."""
    if refill_s is None or not item_s:
        return base
    want = math.ceil(2 * refill_s / item_s)
    safe = int(lease_s / 2 / item_s) - ready
    share = max_span // (3 * max(1, workers))
    return max(1, min(max(base, want), cap, safe, share))


def low_water(refill_s: float | None, item_s: float | None, spread: float) -> int | None:
    """Entries left when the next refill starts ahead: what the worker hands out during
    one refill, times ``spread`` (a random 1-2: workers that run alike would otherwise
    refill at the same moments and conflict on the progress object).  None until both
    are measured: no refill ahead yet."""
    if refill_s is None or item_s is None:
        return None
    return max(1, math.ceil(refill_s / max(item_s, 1e-6) * spread))
