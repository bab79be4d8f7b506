"""``tieredbuf.open(url)``: one buffer = one store root + its queue manifest."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from pathlib import Path
from typing import Any

from tieredbuf.config import ConsumerConfig, ProducerConfig
from tieredbuf.consumer import Consumer, fetch_object
from tieredbuf.errors import ConfigError
from tieredbuf.format.manifest import ManifestEntry
from tieredbuf.queue.manifest_queue import ManifestQueue, Snapshot
from tieredbuf.store import open_store
from tieredbuf.store.base import Store


def _build(cls: Any, kind: str, options: dict[str, Any]) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - names)
    if unknown:
        raise ConfigError(f"unknown {kind} option(s) {unknown}; known: {sorted(names)}")
    return cls(**options)


class Buffer:
    """A tiered buffer rooted at one URL (``s3://``, ``file://``, ``memory://``)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.queue = ManifestQueue(store)

    @property
    def url(self) -> str:
        return self.store.url

    def producer(self, staging_dir: str | Path | None = None, **config: Any) -> Any:
        """A producer.  ``staging_dir=None``: stateless (REMOTE acks only).

        Keyword arguments are :class:`ProducerConfig` fields (and, with a staging
        directory, the local tier's fields), e.g. ``flush_interval=timedelta(ms=100)``.
        """
        if staging_dir is None:
            from tieredbuf.producer import Producer

            return Producer(self.store, self.queue, _build(ProducerConfig, "producer", config))
        from tieredbuf.staged import StagedProducer  # type: ignore[import-not-found]

        return StagedProducer(self, Path(staging_dir), **config)

    def consumer(self, **config: Any) -> Consumer:
        """A consumer; call ``initialize()`` on it (that fences older consumers)."""
        return Consumer(self.store, self.queue, _build(ConsumerConfig, "consumer", config))

    def snapshot(self) -> Snapshot:
        """One read of the queue manifest (no fencing; read-only)."""
        return self.queue.read()

    def entries(self) -> list[ManifestEntry]:
        return self.snapshot().entries()

    def read_object(self, entry: ManifestEntry) -> bytes:
        """The data object an entry points at (DataLossError when it is missing)."""
        return fetch_object(self.store, entry)

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> Buffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open(url: str, **options: Any) -> Buffer:
    """Open the buffer at ``url``; ``options`` are store options (endpoint, region, ...)."""
    return Buffer(open_store(url, **options))


__all__ = ["Buffer", "open", "timedelta"]
