"""The log's interfaces under FLIP-158's names: the writer, the storage, and the files beside the log.

FLIP-158 (and Flink's ``flink-dstl``) puts ``StateChangelogWriter`` and ``StateChangelogStorage``
in the runtime, apart from their DFS implementation, so that state backends depend on the
interfaces only; Flink's ``StateChangeUploader`` is the file side apart from the storage. The same
lines run here, as three structural protocols (``typing.Protocol``: implementations do not
inherit from them) and no implementation import:

- ``StateChangelogWriter``: one operator subtask's log, what the keyed backend and the
  materializer call;
- ``ChangelogStorage``: a process's log, which creates writers and reads handles and notes back
  (``dstl.storage.StateChangelogStorage`` in the process, ``dstl.service.RemoteChangelogStorage``
  through the executor's changelog service); the keyed backend depends on it;
- ``DfsFiles``: the files under the storage's base path (chunks, ``_metadata``, claims, pending
  records, log files), ``storage.files``, with a deadline and retries on every call; checkpointing,
  the materializer and the tools need only these.

What a writer needs from the storage that created it is the writer's business
(``dstl.writer.WriterStorage``), not part of this module.
"""

from __future__ import annotations

import builtins
import concurrent.futures
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from dstl.config import ChangelogConfig
from dstl.metrics import ChangelogMetrics
from dstl.types import ChangelogHandle, KeyGroupRange, Note, NotedHandle, SequenceNumber

__all__ = ["ChangelogStorage", "DfsFiles", "StateChangelogWriter"]


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


class DfsFiles(Protocol):
    """The files under a storage's base path (Flink's ``StateChangeUploader`` side).

    Paths are relative to the base path; one leaving it raises ``ConfigurationError``. Each call
    has a deadline per attempt and retries (``dstl.retry``) and fails with a ``StorageError``
    naming the operation, the path and the attempts, except that a missing file stays
    ``FileNotFoundError``. ``timeout`` (seconds) bounds the caller's wait on top.
    """

    @property
    def base_path(self) -> str:
        """The URL or local path the paths are relative to (the storage's ``config.base_path``),
        for messages and locations."""
        ...

    @property
    def parallel_reads(self) -> int | None:
        """How many reads a caller reading many parts should keep in flight, or None: no limit of
        the store's own (an object store hides its latency behind many). A local directory says 1:
        its reads are copies from the page cache on the CPU, and more reading threads only wait for
        each other's turn at the interpreter lock. ``ChangelogConfig.parallel_reads`` overrides it."""
        ...

    def put(self, path: str, data: bytes, timeout: float | None = None) -> None:
        """Write a whole file."""
        ...

    def get(self, path: str, timeout: float | None = None) -> bytes:
        """Read a whole file; a missing file raises ``FileNotFoundError``."""
        ...

    def read_range(self, path: str, offset: int, length: int, timeout: float | None = None) -> bytes:
        """Read part of a file; a missing file raises ``FileNotFoundError``."""
        ...

    def read_ranges(self, path: str, ranges: Sequence[tuple[int, int]], timeout: float | None = None) -> list[bytes]:
        """Read parts ``(offset, length)`` of one file (ascending, not overlapping) in one call: of
        a local file only those bytes; of an object store one ranged request from the first to the
        last, cut (a request costs more than the bytes between them). A missing file raises
        ``FileNotFoundError``."""
        ...

    def delete(self, path: str, timeout: float | None = None) -> None:
        """Delete a file now (a missing one is not an error)."""
        ...

    def delete_later(self, path: str, on_done: Callable[[bool], None] | None = None) -> None:
        """Delete a file in the background, retried; never raises. ``flush`` and ``close`` of the
        storage wait for it; a failure is left to the orphan scan (``undeleted`` lists it).
        ``on_done(deleted)`` runs once the outcome is known; not when the storage is closing and
        skips the deletion."""
        ...

    def remove_empty_directory(self, path: str) -> bool:
        """Remove an empty directory (local base paths; object stores have none); whether it is
        gone now (False: it still holds something)."""
        ...

    def undeleted(self) -> builtins.list[str]:
        """Files whose background deletion failed for good, left to the next recovery's orphan scan."""
        ...

    def list(self, prefix: str = "") -> builtins.list[str]:
        """The paths of every file under ``prefix`` (every file if empty), sorted."""
        ...


class ChangelogStorage(Protocol):
    """A process's log (FLIP-158's ``StateChangelogStorage``): writers, reading back, its files."""

    @property
    def config(self) -> ChangelogConfig: ...
    @property
    def files(self) -> DfsFiles:
        """The files under the base path, the log's included."""
        ...

    @property
    def owns_files(self) -> bool:
        """Whether this storage deletes the log files its writers no longer need (False: another
        process, e.g. the Spark driver's registry, decides when files die)."""
        ...

    @property
    def metrics(self) -> ChangelogMetrics: ...

    def create_writer(self, operator_id: str, key_group_range: KeyGroupRange) -> StateChangelogWriter: ...

    def read(self, handle: ChangelogHandle, key_groups: KeyGroupRange | None = None) -> Iterator[tuple[int, bytes]]:
        """The changes of ``handle`` in SQN order, restricted to ``key_groups`` (all if None)."""
        ...

    def read_notes(self, path: str, timeout: float | None = None) -> list[NotedHandle]:
        """The notes of the changelog file at ``path`` with their persists' handles."""
        ...

    def flush(self, timeout: float | None = None) -> None:
        """Wait until what was handed over so far is done (uploads, background deletions)."""
        ...

    def close(self, timeout: float | None = 60.0) -> None: ...
