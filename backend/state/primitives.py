"""The state primitives a user holds: value, list, map, reducing and aggregating state.

Each wrapper is bound to its backend and addresses the backend's *current key*
(``set_current_key``); the data lives in the state's table (``value_table``, ``list_table``,
``map_table``). Values handed out by ``value()``/``get()`` are the cached objects, as in Flink's
heap backend: treat them as immutable and write them back to change state.

``None`` means "no value" for every kind, and is never stored:

- ``ValueState.update(None)`` clears the value (as ``clear()``); ``value()`` is None when unset.
- ``MapState.put(k, None)`` removes ``k`` (as ``remove(k)``); ``get(k)`` is None when absent.
- ``ListState.update(None)`` clears the list (as ``clear()``); ``get()`` is ``[]`` when unset.
  A list *element* cannot be addressed, so ``add(None)``, or ``add_all``/``update`` with a None
  element, raises ``NoneElementError`` (a ``ValueError`` naming the state) and changes nothing.

``ValueState.value()`` and ``update()`` without TTL are the hot path: they read and write the
value table's per-key-group dicts directly (see ``value_table``) instead of calling the table. A
key found nowhere then checks one attribute (``table.older``) before reading an older schema
version's table (``versions``); a key found costs nothing more. In a batch, a key of the batch is
read from the table's ``ahead`` (its values read ahead), and every write goes there too.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Generic, TypeVar

from backend.core.descriptors import (
    AggregatingStateDescriptor,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    StateDescriptor,
)
from backend.state.context import StateHost
from backend.state.list_table import ListTable
from backend.state.map_table import MapTable
from backend.state.state_table import MISS, TOMBSTONE, StateTable
from backend.state.value_table import ValueTable

__all__ = [
    "AggregatingState",
    "ListState",
    "MapState",
    "ReducingState",
    "ValueState",
    "create_state",
]

V = TypeVar("V")
K = TypeVar("K")


class _Bound:
    __slots__ = ("_backend", "_table")

    def __init__(self, backend: StateHost, table: StateTable) -> None:
        self._backend = backend
        self._table: Any = table


class ValueState(_Bound, Generic[V]):
    """One value per key. ``update(None)`` clears it; ``value()`` is None when there is none."""

    __slots__ = ("_ahead", "_caches", "_fast")

    def __init__(self, backend: StateHost, table: StateTable) -> None:
        super().__init__(backend, table)
        assert isinstance(table, ValueTable)
        self._caches = table.caches  # the same dicts for the table's lifetime (cleared in place)
        self._ahead = table.ahead
        self._fast = not table.ttl_ms

    def value(self) -> V | None:
        if self._fast:  # the hot path, inlined: read ahead, or cache hit, else one LMDB get
            backend = self._backend
            ck = backend.current_ckey
            ahead = self._ahead
            if ahead:
                cached = ahead.get(ck, MISS)
                if cached is not MISS:
                    return cached  # type: ignore[no-any-return]
            cached = self._caches[backend.current_kg].get(ck, MISS)
            if cached is MISS:
                table = self._table
                cached = table.cleans[backend.current_kg].get(ck, MISS)
                if cached is MISS:
                    stored = table.lookup.get(ck)
                    if stored is not None:
                        return table.ser.deserialize(stored)  # type: ignore[no-any-return]
                    older = table.older  # a miss: an older schema version's table may hold it
                    return None if older is None else older.find(ck)
            return None if cached is TOMBSTONE else cached
        return self._table.get(self._backend.current_ckey)  # type: ignore[no-any-return]

    def update(self, value: V | None) -> None:
        if value is None:
            self._table.clear(self._backend.current_ckey)
        elif self._fast:
            backend = self._backend
            ck = backend.current_ckey
            cache = self._caches[backend.current_kg]
            cache[ck] = value
            ahead = self._ahead
            if ahead:
                ahead[ck] = value
            if len(cache) > backend.kg_flush_threshold:
                backend.flush()
        else:
            self._table.put(self._backend.current_ckey, value)

    def clear(self) -> None:
        self._table.clear(self._backend.current_ckey)


class ListState(_Bound, Generic[V]):
    """A list per key. ``update(None)`` clears it; a None element raises ``NoneElementError``."""

    __slots__ = ()

    def get(self) -> list[V]:
        return self._table.get(self._backend.current_ckey)  # type: ignore[no-any-return]

    def add(self, value: V) -> None:
        self._table.add(self._backend.current_ckey, value)

    def add_all(self, values: Iterable[V]) -> None:
        self._table.add_all(self._backend.current_ckey, values)

    def update(self, values: Iterable[V] | None) -> None:
        self._table.update(self._backend.current_ckey, values)

    def clear(self) -> None:
        self._table.clear(self._backend.current_ckey)


class MapState(_Bound, Generic[K, V]):
    """A map per key. ``put(k, None)`` removes ``k``; ``get(k)`` is None when ``k`` is absent."""

    __slots__ = ()

    def get(self, user_key: K) -> V | None:
        return self._table.get(self._backend.current_ckey, user_key)  # type: ignore[no-any-return]

    def put(self, user_key: K, value: V | None) -> None:
        if value is None:
            self._table.remove(self._backend.current_ckey, user_key)
        else:
            self._table.put(self._backend.current_ckey, user_key, value)

    def put_all(self, entries: dict[K, V | None]) -> None:
        for k, v in entries.items():
            self.put(k, v)

    def remove(self, user_key: K) -> None:
        self._table.remove(self._backend.current_ckey, user_key)

    def contains(self, user_key: K) -> bool:
        return self.get(user_key) is not None

    def items(self) -> Iterator[tuple[K, V]]:
        return self._table.items(self._backend.current_ckey)  # type: ignore[no-any-return]

    def keys(self) -> Iterator[K]:
        return (k for k, _ in self.items())

    def values(self) -> Iterator[V]:
        return (v for _, v in self.items())

    def is_empty(self) -> bool:
        return next(self.items(), None) is None

    def clear(self) -> None:
        self._table.clear(self._backend.current_ckey)


class ReducingState(_Bound, Generic[V]):
    """A value per key that ``add`` folds new values into with the descriptor's ``reduce``."""

    __slots__ = ("_reduce",)

    def __init__(self, backend: StateHost, table: StateTable) -> None:
        super().__init__(backend, table)
        desc = table.descriptor
        assert isinstance(desc, ReducingStateDescriptor) and desc.reduce is not None
        self._reduce = desc.reduce

    def get(self) -> V | None:
        return self._table.get(self._backend.current_ckey)  # type: ignore[no-any-return]

    def add(self, value: V) -> None:
        ck = self._backend.current_ckey
        current = self._table.get(ck)
        self._table.put(ck, value if current is None else self._reduce(current, value))

    def clear(self) -> None:
        self._table.clear(self._backend.current_ckey)


class AggregatingState(_Bound, Generic[V]):
    """An accumulator per key that ``add`` feeds; ``get`` is the aggregate function's result."""

    __slots__ = ("_agg",)

    def __init__(self, backend: StateHost, table: StateTable) -> None:
        super().__init__(backend, table)
        desc = table.descriptor
        assert isinstance(desc, AggregatingStateDescriptor) and desc.aggregate is not None
        self._agg = desc.aggregate

    def get(self) -> Any:
        acc = self._table.get(self._backend.current_ckey)
        return None if acc is None else self._agg.get_result(acc)

    def add(self, value: V) -> None:
        ck = self._backend.current_ckey
        acc = self._table.get(ck)
        if acc is None:
            acc = self._agg.create_accumulator()
        self._table.put(ck, self._agg.add(value, acc))

    def clear(self) -> None:
        self._table.clear(self._backend.current_ckey)


def create_state(
    backend: StateHost, descriptor: StateDescriptor[Any], version: int = 0, older: list[dict[str, Any]] | None = None
) -> tuple[StateTable, Any]:
    """The table that stores ``descriptor``'s state and the wrapper a user holds for it; ``version``
    and ``older``: the schema version and the older ones read through (``backend.state.versions``)."""
    if isinstance(descriptor, MapStateDescriptor):
        table: StateTable = MapTable(backend, descriptor, version, older)
        return table, MapState(backend, table)
    if isinstance(descriptor, ListStateDescriptor):
        table = ListTable(backend, descriptor, version, older)
        return table, ListState(backend, table)
    table = ValueTable(backend, descriptor, version, older)
    if isinstance(descriptor, ReducingStateDescriptor):
        return table, ReducingState(backend, table)
    if isinstance(descriptor, AggregatingStateDescriptor):
        return table, AggregatingState(backend, table)
    return table, ValueState(backend, table)
