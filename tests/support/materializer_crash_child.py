"""Child process of the materializer crash test: killed (SIGKILL) in the middle of a chunk upload.

``python -m tests.support.materializer_crash_child DIR HANDLE MARKER`` (cwd: the project root):

1. builds state (batch A) in a backend whose DFS is ``DIR/dfs`` and materializes it;
2. changes more (batch B), completes checkpoint 1 (chunks of A + the log of B) and writes its
   handle JSON to ``HANDLE`` atomically (temporary file + ``os.replace``);
3. changes more (batch C, not in checkpoint 1) and starts a materialization whose upload writes
   ONE chunk, then writes that chunk's path to ``MARKER`` (atomically) and blocks forever.

The parent waits for ``MARKER``, kills the process and checks recovery and cleanup. The batches
and the dict model of the state live here so that parent and child agree on them.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backend.core.descriptors import ListStateDescriptor, MapStateDescriptor, ValueStateDescriptor
from backend.core.serializers import Int64Serializer, StrSerializer
from backend.state.keyed_backend import ChangelogKeyedStateBackend
from dstl import ChangelogConfig, KeyGroupRange, StateChangelogStorage
from materializer.options import MaterializationOptions
from materializer.periodic import PeriodicMaterializer

OPERATOR = "crash-op"
MAX_P = 128
WAIT_S = 60.0

VALUE = ValueStateDescriptor("value", Int64Serializer())
LIST = ListStateDescriptor("list", Int64Serializer())
MAP = MapStateDescriptor("map", Int64Serializer(), user_key_serializer=StrSerializer())

#: one change: (key, value to set or None to clear, element to add to the list, (map key, value))
Op = tuple[Any, int | None, int, tuple[str, int]]


@dataclass
class Model:
    """What the value, list and map states hold, per key (absent keys hold nothing)."""

    value: dict[Any, int] = field(default_factory=dict)
    lists: dict[Any, list[int]] = field(default_factory=dict)
    maps: dict[Any, dict[str, int]] = field(default_factory=dict)


def batch_a() -> list[Op]:
    return [(k, k, k, ("x", k)) for k in range(200)]


def batch_b() -> list[Op]:
    changed = [(k, None if k % 7 == 0 else k + 1_000, -k, ("y", k)) for k in range(0, 200, 5)]
    return [*changed, *((k, k, k, ("x", k)) for k in range(200, 230))]


def batch_c() -> list[Op]:
    return [(k, k + 2_000, k + 2_000, ("x", -k)) for k in range(0, 230, 3)]


def apply_to_model(model: Model, ops: Sequence[Op]) -> Model:
    for key, value, element, (user_key, entry) in ops:
        if value is None:
            model.value.pop(key, None)
        else:
            model.value[key] = value
        model.lists.setdefault(key, []).append(element)
        model.maps.setdefault(key, {})[user_key] = entry
    return model


def apply_to_backend(backend: ChangelogKeyedStateBackend, ops: Sequence[Op]) -> None:
    value, lst, mp = backend.get_state(VALUE), backend.get_state(LIST), backend.get_state(MAP)
    for key, v, element, (user_key, entry) in ops:
        backend.set_current_key(key)
        if v is None:
            value.clear()
        else:
            value.update(v)
        lst.add(element)
        mp.put(user_key, entry)


def checkpoint_1_model() -> Model:
    return apply_to_model(apply_to_model(Model(), batch_a()), batch_b())


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class CrashingUpload:
    """Delegates to the storage until armed; armed, it uploads one chunk, reports it and hangs."""

    def __init__(self, storage: StateChangelogStorage, marker: Path) -> None:
        self.storage = storage
        self.marker = marker
        self.armed = False

    def __call__(self, path: str, data: bytes) -> None:
        self.storage.files.put(path, data)
        if self.armed:
            write_atomically(self.marker, path)
            threading.Event().wait()  # never set: the parent kills us here


def main(argv: list[str]) -> None:
    directory, handle_path, marker = Path(argv[0]), Path(argv[1]), Path(argv[2])
    storage = StateChangelogStorage(ChangelogConfig.local(directory / "dfs", persist_delay_ms=0))
    backend = ChangelogKeyedStateBackend(
        OPERATOR, KeyGroupRange(0, MAX_P - 1), directory / "local", storage=storage, max_parallelism=MAX_P
    )
    upload = CrashingUpload(storage, marker)
    materializer = PeriodicMaterializer(
        backend, MaterializationOptions(interval_ms=10**12, size_trigger_bytes=None), upload=upload
    )

    apply_to_backend(backend, batch_a())
    if not materializer.trigger():
        raise SystemExit("materialization of batch A did not start")
    materializer.wait(WAIT_S)
    if materializer.metrics.completed != 1:
        raise SystemExit(f"materialization of batch A did not complete: {materializer.metrics}")

    apply_to_backend(backend, batch_b())
    handle = backend.snapshot(1).result(timeout=WAIT_S)
    backend.notify_checkpoint_complete(1)
    write_atomically(handle_path, handle.dumps())

    apply_to_backend(backend, batch_c())
    upload.armed = True
    if not materializer.trigger():
        raise SystemExit("materialization of batch C did not start")
    materializer.wait()  # hangs: the upload never returns


if __name__ == "__main__":
    main(sys.argv[1:])
