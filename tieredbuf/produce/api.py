"""What every producer offers, stateless or staged: :class:`RecordProducer`."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from tieredbuf.produce.handles import WriteHandle


@runtime_checkable
class RecordProducer(Protocol):
    """``buf.producer()`` (stateless) and ``buf.producer(staging_dir=...)`` (staged) both:
    ``produce`` a call's records, ``flush`` what is pending, ``close`` (flush and stop),
    a ``with`` block that closes, and ``commit_health`` (what keeps its writes from their
    commits now, or None)."""

    def produce(
        self,
        entries: object,
        metadata: bytes = b"",
        *,
        timeout: float | None = None,
        idempotency_key: str | None = None,
        fingerprint: bytes | None = None,
    ) -> WriteHandle: ...

    def flush(self, timeout: float | None = None) -> None: ...

    def close(self, timeout: float | None = None) -> None: ...

    def commit_health(self) -> str | None: ...

    def __enter__(self) -> RecordProducer: ...

    def __exit__(self, *exc: object) -> None: ...
