"""One read of the queue root (:class:`Snapshot`), split from :mod:`manifest_queue`."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from ulid import ULID

from tieredbuf.format import manifest as fm
from tieredbuf.format import registry as freg
from tieredbuf.queue import tree
from tieredbuf.queue.nodes import NodeStore


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One read of the root: its decoded view and tree, and the etag to CAS against.

    ``footer`` is the queue's logical footer: ``first_sequence`` is the head (first
    queued sequence) and ``entry_count`` the number queued, wherever they live in
    the tree.  ``view.footer`` is the raw root footer (entries held in the root).
    """

    view: fm.ManifestView
    etag: str | None
    root: tree.Root
    nodes: NodeStore

    @property
    def footer(self) -> fm.Footer:
        r = self.root
        return fm.Footer(r.next_seq - r.head, r.next_seq, r.epoch, fm.V2)

    @property
    def low(self) -> int:
        """First readable (retained) sequence."""
        return self.root.low

    @property
    def head(self) -> int:
        return self.root.head

    @property
    def total_bytes(self) -> int:
        return self.root.total_bytes

    @property
    def retention(self) -> fm.RetentionPolicy | None:
        """The root's retention policy (None: never set, no retention)."""
        return self.root.retention

    @property
    def exists(self) -> bool:
        """False when there is no root at all (nothing was ever written here)."""
        return self.etag is not None

    @property
    def buffer(self) -> fm.BufferInfo | None:
        """Section 6 (None: no writer of this version has written the root yet)."""
        return self.root.buffer

    @property
    def buffer_id(self) -> str | None:
        b = self.root.buffer
        return None if b is None else str(ULID.from_bytes(b.buffer_id))

    @property
    def gc_grace_ms(self) -> int | None:
        return None if self.root.buffer is None else self.root.buffer.gc_grace_ms

    @property
    def registry(self) -> dict[str, freg.Registration]:
        """Every registered subscriber (section 7, or implied by the epoch)."""
        return self.root.registry

    def entries(self) -> list[fm.ManifestEntry]:
        """The queued entries (head .. tail), in order; reads group objects as needed."""
        return list(self.iter_from(self.root.head))

    def iter_from(self, start: int) -> Iterator[fm.ManifestEntry]:
        """Linked entries with sequence >= max(start, low), loading one group at a time."""
        return tree.iter_from(self.root, max(start, self.root.low), self.nodes.load)

    def iter_sized_from(self, start: int) -> Iterator[tuple[fm.ManifestEntry, int]]:
        """:meth:`iter_from` with each data object's size in bytes (0: not recorded)."""
        return tree.iter_sized_from(self.root, max(start, self.root.low), self.nodes.load)

    def sized_entries(self) -> list[tuple[fm.ManifestEntry, int]]:
        """:meth:`entries` with each data object's size in bytes (0: not recorded)."""
        return list(tree.iter_sized_from(self.root, self.root.head, self.nodes.load))
