"""The shared-state registry: per shared file, how many retained completed checkpoints name it.

Why counts over files rather than ownership by a checkpoint: a log file can hold changes of many
writers and checkpoints, and an unchanged chunk is named again by every later materialization,
so a file may be deleted only when no *retained* checkpoint names it any more. ``deleted``
remembers what was given up, so a new checkpoint naming such a file is refused instead of
written (it could not be restored).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from backend.core.errors import CheckpointError

__all__ = ["SharedStateRegistry"]


class SharedStateRegistry:
    """Per shared file, the number of retained completed checkpoints that reference it."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._by_checkpoint: dict[int, frozenset[str]] = {}
        self.deleted: set[str] = set()

    def register(self, checkpoint_id: int, files: Iterable[str]) -> None:
        files = frozenset(files)
        if checkpoint_id in self._by_checkpoint:
            raise CheckpointError(f"checkpoint {checkpoint_id} is registered already")
        self._by_checkpoint[checkpoint_id] = files
        self._counts.update(files)

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
