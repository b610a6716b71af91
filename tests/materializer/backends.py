"""Backends of the materializer tests over a local DFS, and the checks on what they restore.

``environment`` gives a test a storage over ``<tmp>/dfs`` and ``Backends``, which creates
backends (each in its own local directory), restores fresh subtasks of any parallelism from a
handle, and closes them all at the end. ``check_restores`` compares the union of the restored
subtasks with a dict model (``tests.support.materializer_crash_child.Model``): what a restarted
job sees. ``FlakyUpload`` and ``GatedUpload`` are ``upload`` callables the materializer accepts,
failing or holding an upload; nothing waits by sleeping.
The small steps the ``PeriodicMaterializer`` tests share follow: ``materialize`` (start one and
apply its outcome), ``first_keys_in_key_group``, a ``fake_clock`` and ``new_storage``.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backend.core.handles import KeyedStateHandle
from backend.core.keygroups import assign_key_group, key_group_ranges, subtask_for_key_group
from backend.core.serializers import serialize_key
from backend.state.keyed_backend import ChangelogKeyedStateBackend
from dstl import ChangelogConfig, ChangelogWriter, KeyGroupRange, StateChangelogStorage
from materializer.periodic import PeriodicMaterializer, restore
from tests.support.materializer_crash_child import LIST, MAP, MAX_P, OPERATOR, VALUE, Model

WAIT_S = 30.0
FULL = KeyGroupRange(0, MAX_P - 1)
NEVER = 10**12  # ms: an interval no test reaches: materializations start only when a test says so


B = ChangelogKeyedStateBackend


class Backends:
    """Creates backends, each in its own local directory, and closes them all at the end."""

    def __init__(self, tmp: Path, storage: StateChangelogStorage) -> None:
        self.tmp = tmp
        self.storage = storage
        self._dirs = itertools.count()
        self.open: list[B] = []

    def new(self, key_group_range: KeyGroupRange = FULL, **kwargs: Any) -> B:
        b = B(
            OPERATOR,
            key_group_range,
            self.tmp / f"local-{next(self._dirs)}",
            storage=self.storage,
            max_parallelism=MAX_P,
            **kwargs,
        )
        self.open.append(b)
        return b

    def close(self, b: B) -> None:
        self.open.remove(b)
        b.close()

    def close_all(self) -> None:
        while self.open:
            self.close(self.open[-1])

    def restored(self, handle: KeyedStateHandle, parallelism: int) -> list[B]:
        """Fresh subtasks of ``parallelism``, each restored from ``handle`` (read back from JSON)."""
        return self.restored_all([handle], parallelism)

    def restored_all(self, handles: Sequence[KeyedStateHandle], parallelism: int) -> list[B]:
        """Fresh subtasks of ``parallelism``, restored from the handles of every subtask of a checkpoint."""
        handles = [KeyedStateHandle.loads(h.dumps()) for h in handles]
        subtasks = [self.new(rng) for rng in key_group_ranges(MAX_P, parallelism)]
        for b in subtasks:
            restore(b, handles)
        return subtasks


def owner(subtasks: Sequence[B], key: Any) -> B:
    kg = assign_key_group(serialize_key(key), MAX_P)
    b = subtasks[subtask_for_key_group(MAX_P, len(subtasks), kg)]
    b.set_current_key(key)
    return b


def writer(b: B) -> ChangelogWriter:
    assert b.writer is not None
    return b.writer


def stored_count(subtasks: Sequence[B], name: str) -> int:
    return sum(len(list(b.tables.scan_prefix(b.tables.database(name), b""))) for b in subtasks)


def assert_state_equals(subtasks: Sequence[B], model: Model, keys: Iterable[Any]) -> None:
    """Every key reads as in ``model``, and the tables hold exactly the model (nothing duplicated)."""
    for key in keys:
        b = owner(subtasks, key)
        assert b.get_state(VALUE).value() == model.value.get(key), key
        assert b.get_state(LIST).get() == model.lists.get(key, []), key
        assert dict(b.get_state(MAP).items()) == model.maps.get(key, {}), key
    for b in subtasks:
        b.flush()
    assert stored_count(subtasks, VALUE.name) == len(model.value)
    assert stored_count(subtasks, LIST.name) == len(model.lists)
    assert stored_count(subtasks, MAP.name) == sum(map(len, model.maps.values()))


def model_keys(model: Model) -> set[Any]:
    return set(model.value) | set(model.lists) | set(model.maps)


def checkpoint(b: B, checkpoint_id: int) -> KeyedStateHandle:
    handle = b.snapshot(checkpoint_id).result(timeout=WAIT_S)
    b.notify_checkpoint_complete(checkpoint_id)
    return handle


class FlakyUpload:
    """An ``upload`` that raises ``OSError`` on the listed calls (1-based) and delegates otherwise."""

    def __init__(self, storage: StateChangelogStorage, failing: Container[int]) -> None:
        self.storage = storage
        self.failing = failing
        self.calls = 0

    def __call__(self, path: str, data: bytes) -> None:
        self.calls += 1
        if self.calls in self.failing:
            raise OSError(f"injected upload failure (call {self.calls})")
        self.storage.files.put(path, data)


class GatedUpload:
    """An ``upload`` that waits for ``gate`` before delegating: holds a materialization in flight."""

    def __init__(self, storage: StateChangelogStorage) -> None:
        self.storage = storage
        self.gate = threading.Event()
        self.gate.set()
        self.blocked = threading.Event()  # set while an upload waits for the gate
        self.calls = 0

    def __call__(self, path: str, data: bytes) -> None:
        self.calls += 1
        if not self.gate.is_set():
            self.blocked.set()
        released = self.gate.wait(WAIT_S)
        self.blocked.clear()
        if not released:
            raise TimeoutError("the test never released the upload gate")
        self.storage.files.put(path, data)


@dataclass
class Env:
    tmp: Path
    storage: StateChangelogStorage
    backends: Backends


@contextlib.contextmanager
def environment(tmp: Path, owns_files: bool = True) -> Iterator[Env]:
    """A local DFS under ``tmp`` and the backends of a test; ``owns_files=False``: the storage never
    deletes a file, as a Spark worker's."""
    storage = StateChangelogStorage(ChangelogConfig.local(tmp / "dfs", persist_delay_ms=0), owns_files=owns_files)
    backends = Backends(tmp, storage)
    try:
        yield Env(tmp, storage, backends)
    finally:
        backends.close_all()
        storage.close()


def check_restores(env: Env, handle: KeyedStateHandle, model: Model, parallelisms: Sequence[int] = (1, 3)) -> None:
    for parallelism in parallelisms:
        subtasks = env.backends.restored(handle, parallelism)
        assert_state_equals(subtasks, model, model_keys(model))
        for b in subtasks:
            env.backends.close(b)


def fake_clock(now: list[float]) -> Callable[[], float]:
    return lambda: now[0]


def new_storage(directory: Path) -> StateChangelogStorage:
    return StateChangelogStorage(ChangelogConfig.local(directory, persist_delay_ms=0))


def materialize(m: PeriodicMaterializer) -> None:
    """Start a materialization and apply its outcome (it must start: something changed)."""
    assert m.trigger()
    m.wait(WAIT_S)


def first_keys_in_key_group(key_group: int, count: int, start: int = 0) -> list[int]:
    found: list[int] = []
    for k in itertools.count(start):
        if assign_key_group(serialize_key(k), MAX_P) == key_group:
            found.append(k)
            if len(found) == count:
                return found
    raise AssertionError("unreachable")
