"""Shared support of the keyed-state tests: descriptors, the ``Env`` that creates and restores backends, helpers.

Tests exercise each state type through its public wrapper only, as Flink's StateBackendTestBase
does; the ``phase`` fixture (``conftest.py``) runs each read-after-write test with the last writes
cached, flushed to LMDB, snapshotted, and replayed from the changelog into a fresh backend.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from backend.core.descriptors import (
    AggregatingStateDescriptor,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    ValueStateDescriptor,
)
from backend.core.handles import KeyedStateHandle
from backend.core.keygroups import assign_key_group, key_group_ranges, subtask_for_key_group
from backend.core.serializers import Int64Serializer, StrSerializer, TupleSerializer, serialize_key
from backend.state.keyed_backend import ChangelogKeyedStateBackend
from dstl import KeyGroupRange, StateChangelogStorage

WAIT_S = 30.0
MAX_P = 128
OP = "op"
FULL = KeyGroupRange(0, MAX_P - 1)

VALUE = ValueStateDescriptor("value", Int64Serializer())
LIST = ListStateDescriptor("list", StrSerializer())
MAP = MapStateDescriptor("map", Int64Serializer(), user_key_serializer=StrSerializer())
REDUCING = ReducingStateDescriptor("sum", Int64Serializer(), reduce=operator.add)


class Average:
    """An AggregateFunction: int inputs, accumulator (sum, count), the mean as result."""

    def create_accumulator(self) -> tuple[int, int]:
        return (0, 0)

    def add(self, value: int, accumulator: tuple[int, int]) -> tuple[int, int]:
        return (accumulator[0] + value, accumulator[1] + 1)

    def get_result(self, accumulator: tuple[int, int]) -> float:
        return accumulator[0] / accumulator[1]


AVERAGE = AggregatingStateDescriptor(
    "avg", TupleSerializer([Int64Serializer(), Int64Serializer()]), aggregate=Average()
)

B = ChangelogKeyedStateBackend


# -- fixtures and helpers ---------------------------------------------------------------------


class Env:
    """Creates backends (each in its own local directory) and closes them; checkpoints and restores."""

    def __init__(self, tmp_path: Path, storage: StateChangelogStorage) -> None:
        self.tmp_path = tmp_path
        self.storage = storage
        self.dfs = tmp_path / "dfs"
        self._dirs = itertools.count()
        self._ids = itertools.count(1)
        self.open: list[B] = []
        self.kwargs: dict[int, dict[str, Any]] = {}

    def backend(
        self,
        key_group_range: KeyGroupRange = FULL,
        *,
        operator_id: str = OP,
        storage: StateChangelogStorage | None = None,
        **kwargs: Any,
    ) -> B:
        if kwargs.get("log_enabled", True) and storage is None:
            storage = self.storage
        b = B(operator_id, key_group_range, self.tmp_path / f"local-{next(self._dirs)}", storage=storage, **kwargs)
        self.open.append(b)
        self.kwargs[id(b)] = dict(kwargs, operator_id=operator_id, storage=storage)
        return b

    def close(self, b: B) -> None:
        self.open.remove(b)
        b.close()

    def close_all(self) -> None:
        while self.open:
            self.close(self.open[-1])

    def checkpoint(self, *backends: B) -> list[KeyedStateHandle]:
        """Snapshot every backend, wait, notify completion; the handles as read back from JSON."""
        cid = next(self._ids)
        futures = [b.snapshot(cid) for b in backends]
        handles = [f.result(timeout=WAIT_S) for f in futures]
        for b in backends:
            b.notify_checkpoint_complete(cid)
        return [KeyedStateHandle.loads(h.dumps()) for h in handles]

    def restore(self, handles: Sequence[KeyedStateHandle], parallelism: int, **kwargs: Any) -> list[B]:
        """New subtasks of ``parallelism``, each restored from ALL ``handles``."""
        subtasks = [self.backend(rng, **kwargs) for rng in key_group_ranges(MAX_P, parallelism)]
        for b in subtasks:
            b.restore(handles)
        return subtasks

    def reopen(self, b: B) -> B:
        """Checkpoint ``b``, close it, and restore a new backend of the same range from the handle."""
        kwargs = self.kwargs[id(b)]
        (handle,) = self.checkpoint(b)
        self.close(b)
        fresh = self.backend(b.key_group_range, **kwargs)
        fresh.restore([handle])
        return fresh


def stored(b: B, name: str) -> list[tuple[bytes, bytes]]:
    """Every entry of state ``name`` in the backend's LMDB table (what survives in the local store)."""
    return list(b.tables.scan_prefix(b.tables.database(name), b""))


def owner(key: Any, parallelism: int) -> int:
    return subtask_for_key_group(MAX_P, parallelism, assign_key_group(serialize_key(key), MAX_P))


def key_outside(rng: KeyGroupRange) -> tuple[Any, int]:
    for i in itertools.count():
        kg = assign_key_group(serialize_key(i), MAX_P)
        if not rng.start <= kg <= rng.end:
            return i, kg
    raise AssertionError("unreachable")


Phase = Callable[[B], B]

#: keys of several types, written by ``populate``
POOL = [*range(40), *(f"key-{i}" for i in range(40)), *((i, "t") for i in range(10))]


def populate(subtasks: Sequence[B]) -> None:
    """Write every state of every key of ``POOL`` (and timers) into the subtask that owns it."""
    p = len(subtasks)
    for i, key in enumerate(POOL):
        b = subtasks[owner(key, p)]
        b.set_current_key(key)
        b.get_state(VALUE).update(i)
        b.get_state(LIST).add_all([str(i), "x"])
        b.get_state(MAP).put_all({"i": i, str(i): -i})
        b.get_state(REDUCING).add(i)
        b.register_event_time_timer(i)
        b.register_processing_time_timer(1_000 + i)
