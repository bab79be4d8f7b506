"""Dead-letter redrive: a shared work queue's rejected entries made claimable again
(SQS's dead-letter redrive), or dropped.

A rejected entry -- by ``reject()``, or by ``max_deliveries`` -- is a *dead letter*: it
stays listed in the queue's progress object (the most recent 256) and, while it is
``KEPT``, the queue's needed position (:func:`tieredbuf.format.progress.needed`, what it
publishes into the root) stays at it, so the buffer keeps its entry.  :func:`redrive`
is one CAS of the progress object (:func:`tieredbuf.queue.shared.redrive` decides):
each kept dead letter asked for becomes claimable at once with its delivery count reset
(and leaves the list), or, with ``drop``, stops holding its entry (it stays listed).
A dead letter that retention already unlinked cannot come back: it is reported, never
skipped silently.  Workers see the change at their next CAS.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

from ulid import ULID

from tieredbuf.errors import BufferNotFoundError, ConfigError
from tieredbuf.format import progress as fp
from tieredbuf.format import registry as freg
from tieredbuf.queue import cas, shared
from tieredbuf.queue import subscribers as subs
from tieredbuf.queue.manifest_queue import ManifestQueue
from tieredbuf.queue.subscription import NamedSubscription


@dataclasses.dataclass(frozen=True, slots=True)
class RedriveResult:
    """What a redrive did, by sequence."""

    redriven: tuple[int, ...] = ()
    """Claimable again, delivery count 0."""
    dropped: tuple[int, ...] = ()
    """No longer holding their entries (``drop``)."""
    unlinked: tuple[int, ...] = ()
    """Retention unlinked their entries first: they cannot be redriven."""
    not_found: tuple[int, ...] = ()
    """Not a kept dead letter of this queue (never rejected, already redriven or dropped,
    or older than the 256 the list keeps)."""


def _result(r: shared.Redriven) -> RedriveResult:
    return RedriveResult(tuple(r.redriven), tuple(r.dropped), tuple(r.unlinked), tuple(r.not_found))


def redrive(
    queue: ManifestQueue,
    name: str,
    sequences: Collection[int] | None = None,
    *,
    drop: bool = False,
) -> RedriveResult:
    """Redrive (or ``drop``) the kept dead letters ``sequences`` (all when None) of the
    shared work queue ``name``: one CAS of its progress object, then one root CAS if its
    published position must come back below a redriven entry."""
    snap = queue.read()
    if not snap.exists:
        raise BufferNotFoundError(queue.store.url)
    reg = snap.registry.get(freg.check_name(name))
    if reg is None or not reg.shared:
        raise ConfigError(f"{name!r} is not a work queue of this buffer")
    sub = NamedSubscription(queue, name, shared=True, owner=f"redrive-{ULID()}")
    sub.register()
    token = ULID().bytes

    def decide(
        p: fp.Progress, attempt: int
    ) -> tuple[fp.Progress, shared.Redriven] | cas.Skip[shared.Redriven]:
        try:
            r = shared.redrive(
                p, sequences, token=token, now_ms=sub.clock_ms(), low=snap.low, drop=drop
            )
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if not (r.redriven or r.dropped):
            return cas.Skip(r)
        return r.progress, r

    def landed(p: fp.Progress, tried: Sequence[shared.Redriven]) -> shared.Redriven | None:
        last = tried[-1]
        kept = {r.seq for r in p.rejected if r.flags & fp.KEPT}
        if drop and not kept & set(last.dropped):
            return dataclasses.replace(last, progress=p)
        if not drop and any(x.token == token for x in p.leases):
            return dataclasses.replace(last, progress=p)
        return None

    got = sub.cas(decide, lambda r: r, landed, blind=False)
    if got.redriven and sub.reg_id is not None:
        subs.set_published(queue, name, sub.reg_id, fp.needed(got.progress))
    return _result(got)
