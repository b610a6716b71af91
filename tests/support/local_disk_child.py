"""Fill the local state directory until a write of the local tables fails (issue 25).

Shared by ``test_local_disk_full`` and the child process it runs under a file size limit:
``python -m tests.support.local_disk_child DFS LOCAL LIMIT_BYTES CACHE_LIMIT OUT`` (cwd: the
project root) opens a backend over the local directory ``LOCAL`` and the DFS directory ``DFS``
(its caches of ``CACHE_LIMIT`` changes), limits the
size of every file it writes to ``LIMIT_BYTES`` (``RLIMIT_FSIZE``: LMDB's write past it comes
back short, which LMDB reports as an I/O error), fills the tables with ``fill`` until a local
write fails, then lifts the limit (the disk has room again) and checks that the backend goes on:
a flush, a materialization and a checkpoint. It writes what it saw to ``OUT`` as JSON (``model``:
what was written, ``reads``: what the backend read after the error, ``reads_after``: after the
limit was lifted, ``handle``: the checkpoint's handle, and each error's type and message).

Every round writes each key's value, list, map and timers, then takes a checkpoint. Small caches
(``CACHE_LIMIT``) make the backend spill to LMDB many times per round, so the failed local write
is a spill (value changes the last checkpoint logged are then only in memory); with ``NO_SPILL``
only checkpoints write to LMDB, and the failed write is a checkpoint's write of the list, map and
timer changes.
"""

from __future__ import annotations

import itertools
import json
import resource
import sys
from pathlib import Path
from typing import Any

from backend.core.descriptors import ListStateDescriptor, MapStateDescriptor, ValueStateDescriptor
from backend.core.errors import LocalStateError
from backend.core.serializers import Int64Serializer, StrSerializer
from backend.state.keyed_backend import ChangelogKeyedStateBackend
from dstl import ChangelogConfig, KeyGroupRange, StateChangelogStorage
from materializer.options import MaterializationOptions
from materializer.periodic import PeriodicMaterializer

WAIT_S = 30.0
MAX_P = 128
FULL = KeyGroupRange(0, MAX_P - 1)
KEYS = 200
#: write-back caches this small spill to LMDB many times per round
CACHE_LIMIT = 64
#: caches this large never spill: only checkpoints write to LMDB (list, map and timer changes)
NO_SPILL = 10**6
#: a value's padding: a round rewrites about 200 KB of values
PAD = "x" * 1000
MAX_ROUNDS = 200

VALUE = ValueStateDescriptor("value", StrSerializer())
ITEMS = ListStateDescriptor("items", Int64Serializer())
ATTRS = MapStateDescriptor("attrs", Int64Serializer(), user_key_serializer=StrSerializer())

#: per key (as a string: JSON keys): {"value": str | None, "items": [int], "attrs": {str: int}, "timers": [int]}
Model = dict[str, dict[str, Any]]


def open_backend(
    local: Path, storage: StateChangelogStorage, cache_limit: int = CACHE_LIMIT, **kwargs: Any
) -> ChangelogKeyedStateBackend:
    return ChangelogKeyedStateBackend("op", FULL, local, storage=storage, cache_limit=cache_limit, **kwargs)


def checkpoint(b: ChangelogKeyedStateBackend, checkpoint_id: int) -> str:
    """Snapshot ``b``, wait, confirm; the handle as JSON."""
    handle = b.snapshot(checkpoint_id).result(timeout=WAIT_S)
    b.notify_checkpoint_complete(checkpoint_id)
    return handle.dumps()


def fill(b: ChangelogKeyedStateBackend, checkpoint_ids: itertools.count[int]) -> tuple[LocalStateError, Model]:
    """Write rounds of every key's state and checkpoint after each, until a write of the local
    tables fails; its error and what was written (the model of what reads must return).

    A value write is made before the spill it triggers (it is kept when the spill fails); a list
    or map write that needs a spill is made after it (it is not made when the spill fails)."""
    value, items, attrs = b.get_state(VALUE), b.get_state(ITEMS), b.get_state(ATTRS)
    model: Model = {str(k): {"value": None, "items": [], "attrs": {}, "timers": []} for k in range(KEYS)}
    for r in range(MAX_ROUNDS):
        try:
            for key in range(KEYS):
                entry = model[str(key)]
                b.set_current_key(key)
                entry["value"] = f"{r}:{key}:{PAD}"
                value.update(entry["value"])
                items.add(r)
                entry["items"].append(r)
                attrs.put(f"r{r}", r)
                entry["attrs"][f"r{r}"] = r
                b.register_event_time_timer(r)
                entry["timers"].append(r)
            checkpoint(b, next(checkpoint_ids))
        except LocalStateError as exc:
            return exc, model
    raise AssertionError(f"the local directory {b.tables.path} did not fill up in {MAX_ROUNDS} rounds")


def read_all(b: ChangelogKeyedStateBackend) -> Model:
    """What ``b`` reads for every key, in the shape of ``fill``'s model."""
    value, items, attrs = b.get_state(VALUE), b.get_state(ITEMS), b.get_state(ATTRS)
    out: Model = {}
    for key in range(KEYS):
        b.set_current_key(key)
        out[str(key)] = {
            "value": value.value(),
            "items": list(items.get()),
            "attrs": dict(attrs.items()),
            "timers": [ts for _, ts in b.list_timers()],
        }
    return out


def materialize(b: ChangelogKeyedStateBackend) -> None:
    """Materialize ``b`` now (its flush, then chunks of what the tables hold) and wait for it."""
    m = PeriodicMaterializer(b, MaterializationOptions(interval_ms=10**12, size_trigger_bytes=None))
    try:
        assert m.trigger()
        m.wait(WAIT_S)
    finally:
        m.close()
    assert m.metrics.completed == 1, f"the materialization failed: {m.metrics}"


def error_of(exc: BaseException) -> dict[str, str]:
    return {"type": type(exc).__name__, "message": str(exc)}


def main(dfs: Path, local: Path, limit: int, cache_limit: int, out: Path) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    storage = StateChangelogStorage(ChangelogConfig.local(dfs))
    b = open_backend(local, storage, cache_limit)
    ids = itertools.count(1)
    result: dict[str, Any] = {}
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
        error, model = fill(b, ids)
        result.update(model=model, error=error_of(error), reads=read_all(b))
        try:
            b.flush()
        except LocalStateError as again:  # still no room: the next write fails the same way
            result["again"] = error_of(again)
        resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
        b.flush()
        materialize(b)
        result.update(reads_after=read_all(b), handle=checkpoint(b, next(ids)))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
        b.close()
        storage.close()
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5]))
