"""The log's interfaces under FLIP-158's names: the writer, and the storage as its writers see it.

FLIP-158 (and Flink's ``flink-dstl``) puts ``StateChangelogWriter`` in the runtime, apart from its
DFS implementation, so that state backends depend on the interface only. The same line runs here:
``StateChangelogWriter`` is what the keyed backend and the materializer call, ``WriterStorage`` is
the little a ``ChangelogWriter`` needs from the storage that created it (its upload scheduler,
in-flight bytes and file registry). The writer depends on this module, not on
``dstl.storage``, which composes the implementations and hands itself to its writers.

Both are structural (``typing.Protocol``): implementations do not inherit from them.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Collection
from typing import Any, Protocol

from dstl.config import ChangelogConfig
from dstl.scheduler import UploadEntry
from dstl.types import ChangelogHandle, KeyGroupRange, Note, SegmentRef, SequenceNumber

__all__ = ["StateChangelogWriter", "WriterStorage"]


class StateChangelogWriter(Protocol):
    """One operator subtask's log: appends per key group, SQNs, durable handles (FLIP-158).

    SQN conventions are in ``dstl.types``: ``last_appended_sqn`` returns ``s`` with every change so
    far at or below ``s``; ``persist_durably(after)`` covers SQNs above ``after``;
    ``truncate(before)`` drops SQNs below ``before``.
    """

    @property
    def log_id(self) -> str: ...
    @property
    def key_group_range(self) -> KeyGroupRange: ...
    @property
    def closed(self) -> bool: ...

    def append(self, key_group: int, data: bytes) -> None: ...
    def append_many(self, pairs: list[Any]) -> None: ...
    def last_appended_sqn(self) -> SequenceNumber: ...
    def persist_durably(self, after: int, note: Note | None = None) -> concurrent.futures.Future[ChangelogHandle]: ...
    def truncate(self, before: int) -> None: ...
    def expect_persist(self) -> None: ...
    @property
    def usable(self) -> bool: ...
    def confirm(self, handle: ChangelogHandle) -> None: ...
    def release(self, handle: ChangelogHandle) -> None: ...
    def close(self) -> None: ...


class WriterStorage(Protocol):
    """What a writer calls on its storage. Calls come from the writer's (operator) thread, except
    where the storage's loop thread drives the writer (pre-emptive persists, backpressure)."""

    @property
    def config(self) -> ChangelogConfig: ...
    @property
    def lock(self) -> threading.Lock:
        """Guards the writer's ``entries`` and their upload state against the loop thread."""
        ...

    def wait_for_capacity(self, writer: StateChangelogWriter) -> None:
        """Block an append of ``writer`` while more bytes than the bound are not yet durable."""
        ...

    def reserve_in_flight(self, writer: StateChangelogWriter, size: int, retried: int) -> None:
        """Count ``size`` new bytes about to be uploaded, first waiting while they would pass the
        bound, and ``retried`` bytes of failed uploads as uploading again."""
        ...

    def submit_persist(
        self,
        writer: StateChangelogWriter,
        entries: list[UploadEntry],
        new: list[UploadEntry],
        after: int,
        upto: int,
        note: Note | None = None,
    ) -> concurrent.futures.Future[list[SegmentRef]]:
        """Upload ``new`` (a subset of ``entries``, SQNs ``after < sqn <= upto``); the future
        yields the segments of ``entries`` once every one of them is durable, and the file
        carrying ``note`` too (it is resolved on the storage's loop thread)."""
        ...

    def truncate_entries(self, entries: dict[int, UploadEntry], before: int) -> None:
        """Drop the entries with SQN < ``before`` from ``entries``, releasing their files."""
        ...

    def expect_persist(self, writer: StateChangelogWriter) -> None:
        """``writer`` will persist soon: flushes may wait for it (``dstl.scheduler``, rule c)."""
        ...

    def hold_files(self, paths: Collection[str]) -> str | None:
        """A reference to each of ``paths`` (a handle's, one per segment), all or none: the first
        path already released is returned and nothing is held."""
        ...

    def release_files(self, paths: Collection[str]) -> None:
        """Drop the references ``hold_files`` took."""
        ...

    def hand_over_files(self, paths: Collection[str]) -> None:
        """These files belong to a checkpoint now (or may): never deleted by this storage."""
        ...

    def close_writer(self, writer: StateChangelogWriter) -> None:
        """Forget the writer: it truncated its entries and handed over its held handles' files."""
        ...
