"""A task of a bootstrap write: the rows of one Spark partition into chunks of the savepoint.

The rows arrive as Arrow record batches in the state data source's columns (``state_writer`` checked
them against the state). Each row's key is stored as the drop-in stores it (``backend.spark.keys``:
the tuple of the grouping values as the API the query runs hands them over: a ``timestamp`` a wall
time in the session's time zone to the pandas APIs, that wall time made aware in the zone to
``transformWithState``, whose rows also turn a NaN into None, both as ``backend.spark.batch``
converts them) in the key group the drop-in's query computes for it, Spark's ``pmod(hash(grouping
columns), max parallelism)`` of the values themselves (``spark_hash``). The values go in through the
same handle and state objects a processor uses (``backend.spark.handle``, strict types), into a
scratch backend without a log covering every key group, so that the stored bytes, the serializer ids
and the recorded schemas are exactly the drop-in's; a TTL value keeps the expiry its row gives (the
scratch backend's clock is set to the expiry minus the TTL for each write).

Then, per run of consecutive key groups the partition holds, one chunk (``materializer.chunks``, as
a materialization writes it), packed back to back into files of at most ``PACK_BYTES`` under the
write's directory of the savepoint (``bootstrap.write_dir``); the task returns the files' entries
and its key groups for the commit (``bootstrap``).

Refused, naming the state and the key: a null key or value, a null TTL expiry, a key twice in a
value state, a user key twice in one key's map state. A list's elements keep the order of the
partition's rows.
"""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from backend.core.handles import CHUNK_HASH, chunk_digest
from backend.spark.codecs import struct_codec
from backend.spark.errors import StateSourceError
from backend.spark.handle import new_handle
from backend.spark.schema import SparkType, parse_schema
from backend.spark.spark_hash import Hasher, hasher_for, key_group
from backend.spark.state_columns import GROUPING
from backend.state.keyed_backend import ChangelogKeyedStateBackend
from dstl import ChangelogConfig, KeyGroupRange
from materializer.chunks import encode_chunk
from materializer.periodic import read_sections

__all__ = ["PACK_BYTES", "StateRows", "TaskOutput", "WritePlan", "python_values"]

#: the largest file a write task puts (several chunks back to back), as a materialization's packs
PACK_BYTES = 16 << 20
#: the processor APIs, as the ``processorApi`` option names them: how each hands a timestamp key over
PANDAS_API, ROW_API = "transformWithStateInPandas", "transformWithState"
#: the column layouts of a written state (``state_writer``): its kind and how its rows hold values
LAYOUTS = {"value": "value", "list_element": "list", "list_value": "list", "user_map": "map", "map_value": "map"}


@dataclass(frozen=True)
class WritePlan:
    """One bootstrap write, decided on the driver (``state_writer.plan_write``) and shipped to every
    task: where, which operator and state, its columns and its recorded metadata."""

    savepoint: str  # the savepoint directory (a URL or an absolute local path)
    storage: ChangelogConfig  # its DFS settings, ``base_path`` the savepoint
    write_id: str
    uid: str
    state: str
    layout: str  # a key of LAYOUTS
    max_parallelism: int
    key: GROUPING
    value_schema: str  # the declared value schema (DDL)
    user_key_schema: str | None = None
    ttl_ms: int | None = None
    api: str | None = None  # PANDAS_API or ROW_API: needed for a timestamp key column
    overwrite: bool = False
    state_meta: dict[str, Any] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return LAYOUTS[self.layout]


@dataclass
class TaskOutput:
    """What a task wrote: the savepoint's file entries of its chunks, its key groups, its rows."""

    files: list[dict[str, Any]]
    key_groups: list[int]
    rows: int


def python_values(dtype: SparkType) -> Callable[[Any], Any]:
    """Arrow's Python value of a ``dtype`` column (``to_pylist``: structs dicts, maps lists of
    pairs) as a processor hands the value to its state: structs tuples, maps dicts."""
    if dtype.name == "struct":
        names = [f.name for f in dtype.fields]
        convert = [python_values(f.type) for f in dtype.fields]
        return lambda v: None if v is None else tuple(c(v.get(n)) for n, c in zip(names, convert, strict=True))
    if dtype.name == "array":
        assert dtype.element is not None
        element = python_values(dtype.element)
        return lambda v: None if v is None else [element(x) for x in v]
    if dtype.name == "map":
        assert dtype.element is not None and dtype.value is not None
        key, value = python_values(dtype.element), python_values(dtype.value)
        return lambda v: None if v is None else {key(k): value(x) for k, x in v}
    return lambda v: v


class StateRows:
    """The scratch backend of one task (or, without rows, of the driver's planning: ``state_meta``)."""

    def __init__(self, plan: WritePlan, scratch: str) -> None:
        self.plan = plan
        self.now = 0
        self.backend = ChangelogKeyedStateBackend(
            plan.uid, KeyGroupRange(0, plan.max_parallelism - 1), scratch, storage=None,
            max_parallelism=plan.max_parallelism, log_enabled=False, clock=lambda: self.now,
        )  # fmt: skip
        self.handle = new_handle(self.backend, "ProcessingTime" if plan.ttl_ms else "None", strict_types=True)
        self.variable: Any
        if plan.kind == "value":
            self.variable = self.handle.getValueState(plan.state, plan.value_schema, plan.ttl_ms)
        elif plan.kind == "list":
            self.variable = self.handle.getListState(plan.state, plan.value_schema, plan.ttl_ms)
        else:
            self.variable = self.handle.getMapState(plan.state, plan.user_key_schema, plan.value_schema, plan.ttl_ms)
        self.key_types = [parse_schema(f"c {dtype}").fields[0].type for _, dtype in plan.key]
        self.hashers: list[Hasher] = [hasher_for(t) for t in self.key_types]
        value = python_values(parse_schema(plan.value_schema))
        self.value: Callable[[Any], Any] = value
        if plan.ttl_ms:
            self.value = lambda v: None if v is None else (value(v["value"]), v["ttlExpirationMs"])
        self.user_key = self.user_key_codec = None
        if plan.user_key_schema is not None:
            self.user_key = python_values(parse_schema(plan.user_key_schema))
            #: a map's user keys as stored: a user key twice in one key's rows is refused
            self.user_key_codec = struct_codec(plan.user_key_schema, plan.state, True, "key")
        self.key_groups: set[int] = set()
        self.seen: set[bytes] = set()
        self.rows = 0

    def state_meta(self) -> dict[str, Any]:
        """The state's metadata as the drop-in records it (serializer ids, TTL, declared schemas)."""
        return dict(self.backend.state_metadata()[self.plan.state])

    def close(self) -> None:
        self.backend.close()

    # -- rows -----------------------------------------------------------------------------------

    def _keys(self, column: Any) -> Iterator[tuple[tuple[Any, ...], int]]:
        """(the grouping values, the key group) of each row of the ``key`` column."""
        import pyarrow as pa  # type: ignore[import-untyped, unused-ignore]
        import pyarrow.compute as pc  # type: ignore[import-untyped, unused-ignore]

        if column.null_count:
            raise StateSourceError(f"state {self.plan.state!r}: a row has a null key (column key)")
        hashed, stored = [], []
        rows_api = self.plan.api == ROW_API
        for i, dtype in enumerate(self.key_types):
            child = column.field(i)
            if dtype.name == "timestamp":
                hashed.append(child.cast("int64").to_pylist())
                walls = pc.local_timestamp(child).to_pylist()  # the session's wall time, as pandas gets it
                if rows_api:  # made aware in the session's zone again, as the Row API's conversion does
                    zone = pa.scalar(0, type=child.type).as_py().tzinfo
                    walls = [None if w is None else w.replace(tzinfo=zone) for w in walls]
                stored.append(walls)
            else:
                values = child.to_pylist()
                hashed.append(values)
                if rows_api and dtype.name in ("float", "double"):  # the Row API's rows pass through pandas
                    values = [None if v != v else v for v in values]  # a NaN: None, as there
                stored.append(values)
        mp, hashers = self.plan.max_parallelism, self.hashers
        for inputs, values in zip(zip(*hashed, strict=True), zip(*stored, strict=True), strict=True):
            yield values, key_group(inputs, hashers, mp)

    def add(self, batch: Any) -> None:
        """Write the rows of one Arrow record batch."""
        keys = self._keys(batch.column("key"))
        layout = self.plan.layout
        if layout == "user_map":
            users = batch.column("user_map_key").to_pylist()
            values = batch.column("user_map_value").to_pylist()
            for (key, kg), user, value in zip(keys, users, values, strict=True):
                self._set_key(key, kg)
                self._put(key, user, value)
        else:
            for (key, kg), value in zip(keys, batch.column(layout).to_pylist(), strict=True):
                self._set_key(key, kg)
                if layout == "value":
                    self._value(key, value)
                elif layout == "list_element":
                    self._append(key, value)
                elif layout == "list_value":
                    for element in self._present(key, value, "list_value"):
                        self._append(key, element)
                else:
                    for user, entry in self._present(key, value, "map_value"):
                        self._put(key, user, entry)
        self.rows += batch.num_rows

    def _set_key(self, key: tuple[Any, ...], kg: int) -> None:
        self.handle.set_implicit_key(key, kg)
        self.key_groups.add(kg)

    def _present(self, key: tuple[Any, ...], value: Any, column: str) -> Any:
        if value is None:
            raise StateSourceError(f"state {self.plan.state!r}: key {key!r} has a null {column}")
        return value

    def _stored(self, key: tuple[Any, ...], value: Any, column: str) -> Any:
        """A row's value as the state objects take it, the clock set to give it its TTL expiry."""
        converted = self.value(self._present(key, value, column))
        if not self.plan.ttl_ms:
            return converted
        inner, expiry = converted
        if expiry is None:
            raise StateSourceError(f"state {self.plan.state!r}: key {key!r} has a null {column}.ttlExpirationMs")
        self.now = int(expiry) - self.plan.ttl_ms
        return self._present(key, inner, f"{column}.value")

    def _once(self, key: tuple[Any, ...], what: bytes, twice: str) -> None:
        if what in self.seen:
            raise StateSourceError(f"state {self.plan.state!r}: {twice} (key {key!r})")
        self.seen.add(what)

    def _value(self, key: tuple[Any, ...], value: Any) -> None:
        self._once(key, self.backend.current_ckey, "a value state holds one value per key, and the rows hold two")
        self.variable.update(self._stored(key, value, "value"))

    def _append(self, key: tuple[Any, ...], element: Any) -> None:
        self.variable.appendValue(self._stored(key, element, "list_element"))

    def _put(self, key: tuple[Any, ...], user: Any, value: Any) -> None:
        assert self.user_key is not None and self.user_key_codec is not None
        user_key = self.user_key(self._present(key, user, "user_map_key"))
        serialized = self.user_key_codec.serializer.serialize(self.user_key_codec.to_store(user_key))
        self._once(key, self.backend.current_ckey + serialized, f"user key {user_key!r} appears twice in one map")
        self.variable.updateValue(user_key, self._stored(key, value, "user_map_value"))

    # -- chunks ---------------------------------------------------------------------------------

    def runs(self) -> list[KeyGroupRange]:
        """The runs of consecutive key groups the rows hold."""
        runs: list[KeyGroupRange] = []
        for kg in sorted(self.key_groups):
            if runs and runs[-1].end == kg - 1:
                runs[-1] = KeyGroupRange(runs[-1].start, kg)
            else:
                runs.append(KeyGroupRange(kg, kg))
        return runs

    def write(self, put: Callable[[str, bytes], None], directory: str, partition: int) -> TaskOutput:
        """Put the chunks, one per run, packed into files under ``directory``; their entries."""
        entries: list[dict[str, Any]] = []
        pack: list[bytes] = []
        packed: list[dict[str, Any]] = []
        size = 0
        attempt = uuid.uuid4().hex[:12]

        def flush() -> None:
            nonlocal size
            path = f"{directory}/part-{partition:05d}-{attempt}-{len(entries) + len(packed)}.chunk"
            put(path, b"".join(pack))
            entries.extend({**entry, "path": path} for entry in packed)
            pack.clear()
            packed.clear()
            size = 0

        txn, databases = self.backend.consistent_view()
        try:
            for rng in self.runs():
                sections = read_sections(txn, databases, rng)
                if not sections:
                    continue
                data = encode_chunk(rng, 0, sections)
                if pack and size + len(data) > PACK_BYTES:
                    flush()
                entries_count = sum(len(v) for v in sections.values())
                packed.append({"key_groups": rng.to_json(), "offset": size, "size": len(data),
                               "entries": entries_count, CHUNK_HASH: chunk_digest(data)})  # fmt: skip
                pack.append(data)
                size += len(data)
        finally:
            txn.abort()
        if pack:
            flush()
        return TaskOutput(entries, sorted(self.key_groups), self.rows)


def plan_state_meta(plan: WritePlan) -> dict[str, Any]:
    """The state's metadata, from a scratch registration (on the driver, before any task runs)."""
    with tempfile.TemporaryDirectory(prefix="dstl-bootstrap-plan-") as scratch:
        rows = StateRows(plan, scratch)
        try:
            return rows.state_meta()
        finally:
            rows.close()
