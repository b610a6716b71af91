"""The shared-state registry's memory of deleted files is bounded over a long run, and still
refuses a checkpoint that names a file given up with a subsumed checkpoint.

Each checkpoint names one new chunk; with one retained checkpoint, every completion subsumes the
previous checkpoint and deletes its chunk, as a long-running job does with its materializations.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from backend.checkpointing.coordinator import CheckpointCoordinator
from backend.checkpointing.registry import REMEMBERED_COMPLETIONS
from backend.core.errors import CheckpointError
from dstl import ChangelogConfig, StateChangelogStorage
from tests.backend.checkpointing.workloads import chunk_handle

ROUNDS = 60


@pytest.fixture
def storage(tmp_path: Path) -> Iterator[StateChangelogStorage]:
    storage = StateChangelogStorage(ChangelogConfig.local(tmp_path / "job"))
    try:
        yield storage
    finally:
        storage.close()


@pytest.fixture
def coordinator(storage: StateChangelogStorage) -> CheckpointCoordinator:
    c = CheckpointCoordinator(storage.files, num_retained=1)
    c.recover()
    return c


def checkpoint_naming(coordinator: CheckpointCoordinator, path: str) -> int:
    cid = coordinator.trigger()
    coordinator.acknowledge(cid, "op", 0, chunk_handle(path))
    coordinator.complete(cid)
    return cid


def run(coordinator: CheckpointCoordinator, rounds: int) -> None:
    for i in range(rounds):
        path = f"shared/{i}.chunk"
        coordinator.files.put(path, b"x")
        checkpoint_naming(coordinator, path)


def test_the_memory_of_deleted_files_stays_bounded_over_a_long_run(
    coordinator: CheckpointCoordinator, storage: StateChangelogStorage, tmp_path: Path
) -> None:
    run(coordinator, ROUNDS)
    storage.flush()  # subsumption deletes in the background
    assert sorted(p.name for p in (tmp_path / "job" / "shared").iterdir()) == [f"{ROUNDS - 1}.chunk"]
    assert coordinator.registry.deleted.unsettled == 0
    assert len(coordinator.registry.deleted) <= REMEMBERED_COMPLETIONS < ROUNDS - 1


def test_a_file_given_up_recently_or_long_ago_is_never_named_again(coordinator: CheckpointCoordinator) -> None:
    run(coordinator, ROUNDS)
    with pytest.raises(CheckpointError, match="deleted with a subsumed checkpoint"):
        checkpoint_naming(coordinator, f"shared/{ROUNDS - 2}.chunk")  # given up by the last completion
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint_naming(coordinator, "shared/0.chunk")  # given up ROUNDS completions ago
    assert [m.checkpoint_id for m in coordinator.completed] == [ROUNDS]
