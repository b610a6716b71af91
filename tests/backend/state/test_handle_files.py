"""The DFS files a returned snapshot handle references stay until its checkpoint is decided.

As in Flink (the changelog's ``TaskChangelogRegistry``): a handle the backend returned from
``snapshot`` may be in a ``_metadata`` already, so its log files and materialized chunks stay
until the checkpoint is confirmed (they belong to it), subsumed or aborted (released, deleted).
A backend that closes first keeps them: whether they are garbage is the coordinator's call
(recovery's orphan scan removes them if no completed checkpoint names them).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from backend.core.descriptors import ValueStateDescriptor
from backend.core.handles import KeyedStateHandle
from backend.core.serializers import Int64Serializer
from backend.state.keyed_backend import ChangelogKeyedStateBackend
from benchmarks.support.faulty_fs import Fault, FaultPlan, faulty_base_path
from dstl import ChangelogConfig, KeyGroupRange
from materializer.options import MaterializationOptions
from materializer.periodic import PeriodicMaterializer, restore
from tests.support.backend_world import BackendWorld

WAIT_S = 30.0
MAX_P = 8
FULL = KeyGroupRange(0, MAX_P - 1)
COUNT = ValueStateDescriptor("count", Int64Serializer())
NEVER = 10**12


class World(BackendWorld):
    """One storage over ``tmp/dfs`` and the backends over it (each with its own local directory)."""

    def __init__(self, tmp: Path) -> None:
        self.plan = FaultPlan()
        base = faulty_base_path(tmp / "dfs", self.plan)
        super().__init__(tmp, ChangelogConfig(base_path=base, persist_delay_ms=0, retry_delay_ms=1), MAX_P)

    def write(self, b: ChangelogKeyedStateBackend, values: dict[str, int]) -> None:
        state = b.get_state(COUNT)
        for key, value in values.items():
            b.set_current_key(key)
            state.update(value)

    def read(self, b: ChangelogKeyedStateBackend, keys: list[str]) -> dict[str, int | None]:
        state = b.get_state(COUNT)
        out: dict[str, int | None] = {}
        for key in keys:
            b.set_current_key(key)
            out[key] = state.value()
        return out

    def materialize(self, b: ChangelogKeyedStateBackend) -> None:
        m = PeriodicMaterializer(b, MaterializationOptions(interval_ms=NEVER, size_trigger_bytes=None))
        assert m.trigger()
        m.wait(WAIT_S)
        m.close()
        assert m.metrics.completed == 1

    def snapshot(self, b: ChangelogKeyedStateBackend, checkpoint_id: int) -> KeyedStateHandle:
        return b.snapshot(checkpoint_id).result(WAIT_S)

    def restored(self, handle: KeyedStateHandle) -> ChangelogKeyedStateBackend:
        b = self.backend()
        restore(b, [handle])
        return b

    def files(self) -> set[str]:
        self.storage.flush(WAIT_S)  # background deletions done
        return {p.relative_to(self.dfs).as_posix() for p in self.dfs.rglob("*") if p.is_file()}


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    w = World(tmp_path)
    try:
        yield w
    finally:
        w.close()


VALUES = {"a": 1, "b": 2, "c": 3}


def test_close_before_checkpoint_complete_keeps_the_log_files_of_the_returned_handle(world: World) -> None:
    b = world.backend()
    world.write(b, VALUES)
    handle = world.snapshot(b, 1)
    assert handle.referenced_files()
    b.close()  # before notify_checkpoint_complete(1): the handle may be in a _metadata already
    assert handle.referenced_files() <= world.files()
    assert world.read(world.restored(handle), list(VALUES)) == VALUES


def test_close_before_checkpoint_complete_keeps_the_chunks_of_the_returned_handle(world: World) -> None:
    b = world.backend()
    world.write(b, VALUES)
    world.materialize(b)
    world.write(b, {"a": 10})
    handle = world.snapshot(b, 1)
    assert handle.materialized
    b.close()
    assert handle.referenced_files() <= world.files()
    assert world.read(world.restored(handle), list(VALUES)) == {**VALUES, "a": 10}


def test_an_aborted_handles_superseded_chunks_go_and_a_confirmed_handle_survives_close(world: World) -> None:
    b = world.backend()
    world.write(b, VALUES)
    world.materialize(b)
    aborted = world.snapshot(b, 1)
    b.notify_checkpoint_aborted(1)
    world.write(b, {"a": 5, "b": 6, "c": 7})
    world.materialize(b)  # supersedes every chunk the aborted handle named
    confirmed = world.snapshot(b, 2)
    b.notify_checkpoint_complete(2)
    b.close()
    on_dfs = world.files()
    aborted_chunks = {str(c["path"]) for c in aborted.materialized}
    assert aborted_chunks
    assert not aborted_chunks & on_dfs
    assert confirmed.referenced_files() <= on_dfs
    assert world.read(world.restored(confirmed), list(VALUES)) == {"a": 5, "b": 6, "c": 7}


def test_close_deletes_a_superseded_chunk_no_handle_names(world: World) -> None:
    b = world.backend()
    world.write(b, VALUES)
    world.materialize(b)
    first = {str(c["path"]) for c in b.lineage.materialized}
    world.write(b, {"a": 10, "b": 20, "c": 30})
    world.materialize(b)  # supersedes every chunk of the first: never named by a snapshot
    handle = world.snapshot(b, 1)
    b.close()
    on_dfs = world.files()
    assert not first & on_dfs
    assert handle.referenced_files() <= on_dfs


def test_a_refused_delete_of_a_superseded_chunk_fails_no_materialization_and_is_retried(world: World) -> None:
    b = world.backend()
    world.write(b, VALUES)
    world.materialize(b)
    first = {str(c["path"]) for c in b.lineage.materialized}
    world.write(b, {"a": 10, "b": 20, "c": 30})
    world.plan.add(Fault(op="delete", path="shared/*", action="fail", times=2))
    world.materialize(b)  # supersedes the first chunks: their DELETE is refused twice
    assert not first & world.files()
    handle = world.snapshot(b, 1)
    assert world.read(world.restored(handle), list(VALUES)) == {"a": 10, "b": 20, "c": 30}


def test_a_refused_delete_after_checkpoint_complete_does_not_fail_the_notification(world: World) -> None:
    b = world.backend()
    world.write(b, VALUES)
    world.materialize(b)
    first = {str(c["path"]) for c in b.lineage.materialized}
    world.snapshot(b, 1)  # names the first chunks: they stay while it is pending
    world.write(b, {"a": 10, "b": 20, "c": 30})
    world.materialize(b)
    second = world.snapshot(b, 2)
    world.plan.add(Fault(op="delete", path="shared/*", action="fail", times=2))
    b.notify_checkpoint_complete(2)  # subsumes 1: its chunks are garbage now, their DELETE refused twice
    on_dfs = world.files()
    assert not first & on_dfs
    assert second.referenced_files() <= on_dfs
