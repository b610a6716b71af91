"""The shared-state registry: per shared file, how many retained completed checkpoints name it.

Why counts over files rather than ownership by a checkpoint: a log file can hold changes of many
writers and checkpoints, and an unchanged chunk is named again by every later materialization,
so a file may be deleted only when no *retained* checkpoint names it any more.

``deleted`` remembers what was given up, so a new checkpoint naming such a file is refused
instead of written (it could not be restored). It remembers only the files given up during the
last ``REMEMBERED_COMPLETIONS`` completions (``RecentlyDeleted``), because a long run gives up
files without end and the guarantee does not need more:

- A snapshot that could name a given-up file was taken before the file was given up, so it
  belongs to a checkpoint that was pending then; such a checkpoint completes within the next few
  completions or is aborted (a completion aborts every older pending checkpoint), while its
  path is still remembered.
- Any other completing checkpoint (say, of a task attempt that restored from an old checkpoint)
  is still checked against the DFS: ``CompletedCheckpointStore.check_references`` refuses a file
  no retained checkpoint names unless it exists. That check is sound only once the file's
  deletion has settled: a DELETE that timed out may still land, after a new checkpoint was
  checked and committed. So a file given up is also remembered until its deletion is known to have
  succeeded (``settle``); one whose deletion failed or never ran is remembered until the next
  recovery (a new registry), which keeps every file a retained checkpoint names. Those are few:
  only deletions that failed on every attempt (``len`` counts them with the rest).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable

from backend.core.errors import CheckpointError
from dstl.errors import ConfigurationError

__all__ = ["REMEMBERED_COMPLETIONS", "RecentlyDeleted", "SharedStateRegistry"]

#: completions whose given-up files ``deleted`` remembers: the one that gave them up, and enough
#: after it for checkpoints that were pending then (a few run concurrently) to complete
REMEMBERED_COMPLETIONS = 4


class RecentlyDeleted:
    """The files given up during the last ``completions`` completions, and those whose deletion has
    not settled (see the module doc). ``settle`` may be called from another thread (the storage's
    loop): the set operations it races with are atomic."""

    def __init__(self, completions: int = REMEMBERED_COMPLETIONS) -> None:
        if completions < 1:
            raise ConfigurationError(f"completions must be >= 1, got {completions}")
        self._generations: deque[set[str]] = deque([set()], maxlen=completions)
        self._unsettled: set[str] = set()

    def next_completion(self) -> None:
        """A checkpoint completed: what it gives up from now on is remembered anew; the oldest
        completion's files are forgotten (unless their deletion has not settled)."""
        self._generations.append(set())

    def add(self, path: str) -> None:
        self._generations[-1].add(path)
        self._unsettled.add(path)

    def update(self, paths: Iterable[str]) -> None:
        paths = list(paths)
        self._generations[-1].update(paths)
        self._unsettled.update(paths)

    def settle(self, path: str) -> None:
        """``path`` is known to be deleted: a late duplicate of its DELETE finds nothing to delete."""
        self._unsettled.discard(path)

    @property
    def unsettled(self) -> int:
        """Files given up whose deletion is in flight or failed."""
        return len(self._unsettled)

    def __contains__(self, path: object) -> bool:
        return path in self._unsettled or any(path in generation for generation in self._generations)

    def __len__(self) -> int:
        return len(self._unsettled.union(*self._generations))


class SharedStateRegistry:
    """Per shared file, the number of retained completed checkpoints that reference it."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._by_checkpoint: dict[int, frozenset[str]] = {}
        self.deleted = RecentlyDeleted()

    def register(self, checkpoint_id: int, files: Iterable[str]) -> None:
        files = frozenset(files)
        if checkpoint_id in self._by_checkpoint:
            raise CheckpointError(f"checkpoint {checkpoint_id} is registered already")
        self._by_checkpoint[checkpoint_id] = files
        self._counts.update(files)
        self.deleted.next_completion()

    def unregister(self, checkpoint_id: int) -> list[str]:
        """Drop a checkpoint's references; returns the files nothing references any more."""
        unused = []
        for path in self._by_checkpoint.pop(checkpoint_id, frozenset()):
            self._counts[path] -= 1
            if self._counts[path] <= 0:
                del self._counts[path]
                unused.append(path)
        return sorted(unused)

    def count(self, path: str) -> int:
        return self._counts.get(path, 0)

    def files(self) -> set[str]:
        return set(self._counts)

    def checkpoints(self) -> list[int]:
        return sorted(self._by_checkpoint)
