"""A backend opened over a reused local directory never serves what an earlier backend left there.

The local LMDB tables are a cache of the durable state; only the caller can know that what a
directory holds is the state of the snapshot it continues from (``backend.spark`` keeps a marker
naming the batch and the handle, and then opens with ``reuse_local=True`` and calls
``adopt_local``). Any other open starts from empty tables: a restore loads exactly the handles, a
fresh start sees nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from backend.core.descriptors import ValueStateDescriptor
from backend.core.errors import StateRestoreError
from backend.core.handles import KeyedStateHandle
from backend.core.serializers import Int64Serializer
from backend.state.keyed_backend import ChangelogKeyedStateBackend
from dstl import KeyGroupRange, StateChangelogStorage

MAX_P = 8
FULL = KeyGroupRange(0, MAX_P - 1)
COUNT = ValueStateDescriptor("count", Int64Serializer())


@pytest.fixture
def opened(local_storage: StateChangelogStorage) -> Iterator[list[ChangelogKeyedStateBackend]]:
    backends: list[ChangelogKeyedStateBackend] = []
    yield backends
    for b in backends:
        b.close()


def open_backend(
    opened: list[ChangelogKeyedStateBackend],
    directory: Path,
    storage: StateChangelogStorage,
    reuse_local: bool = False,
) -> ChangelogKeyedStateBackend:
    b = ChangelogKeyedStateBackend(
        "op", FULL, directory, storage=storage, max_parallelism=MAX_P, reuse_local=reuse_local
    )
    opened.append(b)
    return b


def put(b: ChangelogKeyedStateBackend, key: int, value: int) -> None:
    b.set_current_key(key)
    b.get_state(COUNT).update(value)


def get(b: ChangelogKeyedStateBackend, key: int) -> int | None:
    b.set_current_key(key)
    value: int | None = b.get_state(COUNT).value()
    return value


def leave_post_checkpoint_state(
    opened: list[ChangelogKeyedStateBackend], directory: Path, storage: StateChangelogStorage
) -> KeyedStateHandle:
    """A backend checkpoints key 1, then writes key 1 again and key 2, flushes to LMDB and dies."""
    b = open_backend(opened, directory, storage)
    put(b, 1, 10)
    handle = b.snapshot(1).result(30)
    b.notify_checkpoint_complete(1)
    put(b, 1, 11)
    put(b, 2, 20)
    b.flush()
    opened.remove(b)
    b.close()
    return KeyedStateHandle.loads(handle.dumps())


def test_a_restore_over_a_reused_directory_serves_the_checkpoint_only(
    tmp_path: Path, local_storage: StateChangelogStorage, opened: list[ChangelogKeyedStateBackend]
) -> None:
    handle = leave_post_checkpoint_state(opened, tmp_path / "local", local_storage)
    b = open_backend(opened, tmp_path / "local", local_storage)
    b.restore([handle])
    assert (get(b, 1), get(b, 2)) == (10, None)


def test_a_fresh_backend_over_a_reused_directory_starts_empty(
    tmp_path: Path, local_storage: StateChangelogStorage, opened: list[ChangelogKeyedStateBackend]
) -> None:
    leave_post_checkpoint_state(opened, tmp_path / "local", local_storage)
    b = open_backend(opened, tmp_path / "local", local_storage)
    assert (get(b, 1), get(b, 2)) == (None, None)


def test_a_kept_directory_is_adopted_and_refuses_a_restore_on_top(
    tmp_path: Path, local_storage: StateChangelogStorage, opened: list[ChangelogKeyedStateBackend]
) -> None:
    """``reuse_local``: the caller vouches for the tables; restoring onto them would mix states."""
    handle = leave_post_checkpoint_state(opened, tmp_path / "local", local_storage)
    b = open_backend(opened, tmp_path / "local", local_storage, reuse_local=True)
    with pytest.raises(StateRestoreError, match="fresh"):
        b.restore([handle])
    kept = open_backend(opened, tmp_path / "kept", local_storage)
    put(kept, 3, 30)
    kept_handle = kept.snapshot(1).result(30)
    kept.flush()
    opened.remove(kept)
    kept.close()
    adopted = open_backend(opened, tmp_path / "kept", local_storage, reuse_local=True)
    adopted.adopt_local(KeyedStateHandle.loads(kept_handle.dumps()))
    assert get(adopted, 3) == 30
