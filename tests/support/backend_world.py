"""A storage over ``<tmp>/dfs`` and the keyed backends of one operator over it, for backend tests.

Each backend gets its own local directory; ``close`` closes them all, then the storage.
"""

from __future__ import annotations

from pathlib import Path

from backend.state.keyed_backend import ChangelogKeyedStateBackend
from dstl import ChangelogConfig, KeyGroupRange, StateChangelogStorage


class BackendWorld:
    def __init__(self, tmp: Path, config: ChangelogConfig, max_parallelism: int) -> None:
        self.tmp = tmp
        self.dfs = tmp / "dfs"
        self.max_parallelism = max_parallelism
        self.storage = StateChangelogStorage(config)
        self.backends: list[ChangelogKeyedStateBackend] = []

    def backend(self) -> ChangelogKeyedStateBackend:
        b = ChangelogKeyedStateBackend(
            "op",
            KeyGroupRange(0, self.max_parallelism - 1),
            self.tmp / f"local-{len(self.backends)}",
            storage=self.storage,
            max_parallelism=self.max_parallelism,
        )
        self.backends.append(b)
        return b

    def close(self) -> None:
        for b in self.backends:
            b.close()
        self.storage.close()
