"""Random sequences of compatible schema changes, writes, clears, checkpoints, materializations
and restarts (at any parallelism) against a plain-Python model (``backend.state.versions``).

The model keeps every value as a dict of field -> value and converts it eagerly at each change
of schema, as the rules say a value read through the change reads: a kept field converted (int
widened to float), an added field None, a removed field gone (and None if it comes back later).
The backend converts lazily, through every schema in between; after every restart the two must
agree on every key of value, list and map state. A materialization folds the older versions
(``backend.state.folding``); it may be started and applied with other steps in between, which then
run between its cut and its end.
"""

from __future__ import annotations

import copy
import itertools
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from backend.core.descriptors import ListStateDescriptor, MapStateDescriptor, StateDescriptor, ValueStateDescriptor
from backend.core.handles import KeyedStateHandle
from backend.core.keygroups import assign_key_group, key_group_ranges, subtask_for_key_group
from backend.core.serializers import (
    Float64Serializer,
    Int64Serializer,
    OptionalSerializer,
    RowSerializer,
    StrSerializer,
    serialize_key,
)
from backend.state.keyed_backend import ChangelogKeyedStateBackend
from dstl import ChangelogConfig, StateChangelogStorage
from materializer.options import MaterializationOptions
from materializer.periodic import PeriodicMaterializer, restore

MAX_P = 128
WAIT_S = 30.0
KEYS = ["a", "b", "c", 1, 2, 3]
USER_KEYS = ["x", "y"]
FIELDS = ["f", "g", "h", "i"]
KINDS = ["value", "list", "map"]
#: materializations start only when a step says so
NEVER = MaterializationOptions(interval_ms=10**12, size_trigger_bytes=None)

#: a schema: its fields in order, each "int" or "float" (every field nullable)
Schema = tuple[tuple[str, str], ...]
Row = dict[str, Any]


def serializer(schema: Schema) -> RowSerializer:
    return RowSerializer(
        [(n, OptionalSerializer(Int64Serializer() if t == "int" else Float64Serializer())) for n, t in schema]
    )


def descriptor(kind: str, schema: Schema) -> StateDescriptor[Any]:
    if kind == "value":
        return ValueStateDescriptor("value", serializer(schema))
    if kind == "list":
        return ListStateDescriptor("list", serializer(schema))
    return MapStateDescriptor("map", serializer(schema), user_key_serializer=StrSerializer())


@st.composite
def changed(draw: st.DrawFn, schema: Schema) -> Schema:
    """A schema the rules accept after ``schema``: fields kept (an int maybe widened to float) or
    removed, fields it lacks added, the order shuffled."""
    kept = [(n, "float" if t == "int" and draw(st.booleans()) else t) for n, t in schema if draw(st.booleans())]
    before = {n for n, _ in schema}  # a field removed now may come back in a later change, not in this one
    added = [(n, draw(st.sampled_from(["int", "float"]))) for n in FIELDS if n not in before and draw(st.booleans())]
    fields = kept + added or list(schema[:1])
    return tuple(draw(st.permutations(fields)))


def convert(value: Row, old: Schema, new: Schema) -> Row:
    before = dict(old)
    out: Row = {}
    for name, kind in new:
        v = value.get(name) if name in before else None
        out[name] = float(v) if v is not None and kind == "float" else v
    return out


def as_tuple(value: Row, schema: Schema) -> tuple[Any, ...]:
    return tuple(value[n] for n, _ in schema)


@dataclass
class Model:
    values: dict[Any, Row] = field(default_factory=dict)
    lists: dict[Any, list[Row]] = field(default_factory=dict)
    maps: dict[Any, dict[str, Row]] = field(default_factory=dict)

    def converted(self, old: Schema, new: Schema) -> Model:
        return Model(
            {k: convert(v, old, new) for k, v in self.values.items()},
            {k: [convert(v, old, new) for v in vs] for k, vs in self.lists.items()},
            {k: {u: convert(v, old, new) for u, v in m.items()} for k, m in self.maps.items()},
        )


class SchemaMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="schema-machine-"))
        self.storage = StateChangelogStorage(ChangelogConfig.local(self.tmp / "dfs", persist_delay_ms=0))
        self.dirs = itertools.count()
        self.ids = itertools.count(1)
        self.schema: Schema = (("f", "int"),)
        self.model = Model()
        self.backends: list[ChangelogKeyedStateBackend] = []
        self.materializers: list[PeriodicMaterializer] = []
        self.completed: list[tuple[list[KeyedStateHandle], Model, Schema]] = []

    def teardown(self) -> None:
        try:
            for m in self.materializers:
                m.close()
            for b in self.backends:
                b.close()
            self.storage.close()
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def _start(self, parallelism: int, handles: list[KeyedStateHandle]) -> None:
        for m in self.materializers:
            m.close()
        for b in self.backends:
            b.close()
        self.backends, self.materializers = [], []
        for rng in key_group_ranges(MAX_P, parallelism):
            b = ChangelogKeyedStateBackend("op", rng, self.tmp / f"local-{next(self.dirs)}", storage=self.storage)
            self.backends.append(b)
            restore(b, handles)
            self.materializers.append(PeriodicMaterializer(b, NEVER))

    def at(self, key: Any, kind: str) -> Any:
        kg = assign_key_group(serialize_key(key), MAX_P)
        b = self.backends[subtask_for_key_group(MAX_P, len(self.backends), kg)]
        b.set_current_key(key)
        return b.get_state(descriptor(kind, self.schema))

    @initialize(cache_limit=st.just(0))
    def start(self, cache_limit: int) -> None:
        self._start(1, [])

    def _row(self, data: st.DataObject) -> Row:
        return {
            n: data.draw(st.none() | st.integers(-50, 50).map(float if t == "float" else int), label=n)
            for n, t in self.schema
        }

    @rule(kind=st.sampled_from(KINDS), key=st.sampled_from(KEYS), user_key=st.sampled_from(USER_KEYS), data=st.data())
    def write(self, kind: str, key: Any, user_key: str, data: st.DataObject) -> None:
        state, value = self.at(key, kind), self._row(data)
        if kind == "value":
            state.update(as_tuple(value, self.schema))
            self.model.values[key] = value
        elif kind == "list":
            state.add(as_tuple(value, self.schema))
            self.model.lists.setdefault(key, []).append(value)
        else:
            state.put(user_key, as_tuple(value, self.schema))
            self.model.maps.setdefault(key, {})[user_key] = value

    @rule(kind=st.sampled_from(KINDS), key=st.sampled_from(KEYS), user_key=st.sampled_from([None, *USER_KEYS]))
    def clear(self, kind: str, key: Any, user_key: str | None) -> None:
        state = self.at(key, kind)
        if kind == "map" and user_key is not None:
            state.remove(user_key)
            self.model.maps.get(key, {}).pop(user_key, None)
            if not self.model.maps.get(key, True):
                del self.model.maps[key]
            return
        state.clear()
        {"value": self.model.values, "list": self.model.lists, "map": self.model.maps}[kind].pop(key, None)

    @rule(key=st.sampled_from(KEYS))
    def check(self, key: Any) -> None:
        s, m = self.schema, self.model
        value = self.at(key, "value").value()
        assert value == (as_tuple(m.values[key], s) if key in m.values else None)
        assert self.at(key, "list").get() == [as_tuple(v, s) for v in m.lists.get(key, [])]
        items = dict(self.at(key, "map").items())
        assert items == {u: as_tuple(v, s) for u, v in m.maps.get(key, {}).items()}
        for u in USER_KEYS:
            assert self.at(key, "map").get(u) == items.get(u)

    @rule()
    def flush(self) -> None:
        """Every subtask writes its caches to its tables (removing older entries), then reads."""
        for b in self.backends:
            b.flush()
        for key in KEYS:
            self.check(key)

    @rule()
    def start_materialization(self) -> None:
        """Every subtask starts one (its cut, and the copy of older versions): it is applied, and
        the older versions forgotten, by ``apply_materialization``, other steps maybe between."""
        for m in self.materializers:
            m.trigger()

    @rule()
    def apply_materialization(self) -> None:
        for m in self.materializers:
            m.wait(WAIT_S)
            assert m.in_flight is None
        for key in KEYS:
            self.check(key)

    @rule()
    def materialize(self) -> None:
        """Start and apply one at once, then read from the tables (no cached read)."""
        self.start_materialization()
        self.apply_materialization()
        self.flush()

    @rule()
    def checkpoint(self) -> None:
        cid = next(self.ids)
        handles = [f.result(timeout=WAIT_S) for f in [b.snapshot(cid) for b in self.backends]]
        for b in self.backends:
            b.notify_checkpoint_complete(cid)
        self.completed.append(
            ([KeyedStateHandle.loads(h.dumps()) for h in handles], copy.deepcopy(self.model), self.schema)
        )

    @precondition(lambda self: self.completed)
    @rule(data=st.data(), change=st.booleans(), parallelism=st.integers(1, 3))
    def restart(self, data: st.DataObject, change: bool, parallelism: int) -> None:
        """A restart from a completed checkpoint (the latest, or an older one), under its schema
        or a changed one; every key must then read as the model says."""
        index = data.draw(st.integers(0, len(self.completed) - 1), label="checkpoint")
        handles, model, schema = self.completed[index]
        self._start(parallelism, handles)
        self.schema = data.draw(changed(schema), label="schema") if change else schema
        self.model = model.converted(schema, self.schema)
        for key in KEYS:
            self.check(key)


TestSchemaMachine = SchemaMachine.TestCase
TestSchemaMachine.settings = settings(stateful_step_count=30, max_examples=100, deadline=None)
