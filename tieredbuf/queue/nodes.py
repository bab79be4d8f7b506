"""Thin I/O for immutable tree nodes: cached, retried GETs and create-if-absent PUTs.

A transient error fetching a node is retried (with backoff), never read as an
empty node: rabbitmq-stream-s3 once resolved a failed group read as "no data".
A missing node raises :class:`ObjectNotFoundError`; the caller re-reads the root
to tell "unlinked by retention and reaped" from "lost".
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from ulid import ULID

from tieredbuf import keys
from tieredbuf.config import RetryConfig
from tieredbuf.errors import (
    AlreadyExistsError,
    CorruptError,
    ObjectNotFoundError,
    PermanentStoreError,
    StoreError,
)
from tieredbuf.format import tree as ft
from tieredbuf.runtime.retry import backoff_delay
from tieredbuf.runtime.stats import Stats
from tieredbuf.store.base import Store


def node_key(ref: ft.Ref) -> str:
    return keys.group_key(ref.first, ULID.from_bytes(ref.ulid), ref.kind)


class NodeStore:
    """Loads nodes by ref (an LRU of decoded nodes: they never change) and writes new ones."""

    def __init__(
        self,
        store: Store,
        *,
        retry: RetryConfig | None = None,
        clock_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
        sleep: Callable[[float], None] = time.sleep,
        max_attempts: int = 8,
        cache_nodes: int = 64,
        stats: Stats | None = None,
    ) -> None:
        self.store = store
        self.retry = retry or RetryConfig()
        self.clock_ms = clock_ms
        self.sleep = sleep
        self.max_attempts = max_attempts
        self.cache_nodes = cache_nodes
        self.stats = stats or Stats()
        self._cache: OrderedDict[str, ft.Node] = OrderedDict()
        self._lock = threading.Lock()

    def load(self, ref: ft.Ref) -> ft.Node:
        key = node_key(ref)
        with self._lock:
            node = self._cache.get(key)
            if node is not None:
                self._cache.move_to_end(key)
                return node
        attempt = 0
        while True:
            try:
                raw = self.store.get(key).data
                break
            except (ObjectNotFoundError, PermanentStoreError):
                raise
            except StoreError:
                self.stats.incr("node_read_retries")
                attempt += 1
                if attempt >= self.max_attempts:
                    raise
                self.sleep(backoff_delay(self.retry, attempt - 1))
        self.stats.incr("node_reads")
        node = ft.decode_node(raw, obj=key)
        if node.level != ref.level or node.first != ref.first or node.last != ref.last:
            raise CorruptError(ft.WHAT_NODE, key, 0, "node does not match its reference")
        with self._lock:
            self._cache[key] = node
            while len(self._cache) > self.cache_nodes:
                self._cache.popitem(last=False)
        return node

    def put(self, level: int, first: int, data: bytes) -> bytes:
        """Write a node under a fresh ULID key (create-if-absent); returns the ULID bytes.

        AlreadyExists means our own earlier attempt landed (80 random bits); any other
        store error propagates and the CAS loop retries from a fresh read.
        """
        ulid = ULID.from_timestamp(self.clock_ms() / 1000)
        key = keys.group_key(first, ulid, ft.KINDS[level])
        with contextlib.suppress(AlreadyExistsError):
            self.store.put(key, data, mode="create")
        self.stats.incr("nodes_written")
        return ulid.bytes
