"""Spark's ``StatefulProcessorHandle`` over ``ChangelogKeyedStateBackend``: state variables and timers.

A user's unchanged ``pyspark.sql.streaming.StatefulProcessor`` receives a ``SparkStateHandle`` in
``init`` and gets Spark's value, list and map state objects, timers and ``deleteIfExists`` with
Spark's method names, argument and return types and errors. In Spark every one of these calls is a
round trip to a JVM state server; here it is a dict lookup or an LMDB get.

Why each Spark state maps to one backend state: a state name is Spark's unit of registration,
TTL and deletion, and it is ours too (``get_state``/``delete_state``); the grouping key is the
backend key (``backend.spark.keys``), so state and timers live in the key's key group and rescale
with it. Values are checked and converted by the state's codec (``backend.spark.codecs``), which
documents the Python types Spark hands back and what it stores for a value of the wrong type
(``strict_types`` raises instead).

The objects handed to the processor are instances of pyspark's own classes (``isinstance(handle,
StatefulProcessorHandle)`` holds, as user code and Spark's tests check): the public ``SparkStateHandle``,
``ValueState``, ``ListState`` and ``MapState`` are built on first use from our implementation and
pyspark's class (``_pyspark_classes``), so that importing this module never imports pyspark (the
plumbing imports it on the driver and in every worker; pyspark is loaded wherever a processor runs).
Our methods override every pyspark method; pyspark's constructors are never called.

A state dropped by ``deleteIfExists`` fails as in Spark, whose objects address a state by name: every
call raises ``PySparkRuntimeError`` with the message pyspark's client gives, its iterators are empty,
and an object of the same kind works again once ``init`` creates the state again.

The state objects and the handle share a module because each state object asks its handle for
the current key on every call (one attribute lookup on the hot path), and the handle creates them.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from backend.core.descriptors import ListStateDescriptor, MapStateDescriptor, StateTtl, ValueStateDescriptor
from backend.spark import state_schemas
from backend.spark.codecs import StructCodec, struct_codec
from backend.spark.errors import StateOperationError
from backend.spark.keys import backend_key, set_key
from backend.spark.rows import plain_value
from backend.spark.unsafe_row import map_key_order
from backend.state.timers import EVENT_TIME, PROCESSING_TIME
from dstl import ConfigurationError

if TYPE_CHECKING:
    from backend.state.keyed_backend import ChangelogKeyedStateBackend

__all__ = [
    "CLOSED",
    "CREATED",
    "DATA_PROCESSED",
    "INITIALIZED",
    "TIMER_PROCESSED",
    "TIME_MODES",
    "ListState",
    "MapState",
    "SparkStateHandle",
    "ValueState",
    "new_handle",
    "normalize_time_mode",
]

# Spark's StatefulProcessorHandleState, in order; state variables are created only while CREATED
# (in init), timers are used only from INITIALIZED to DATA_PROCESSED.
CREATED, INITIALIZED, DATA_PROCESSED, TIMER_PROCESSED, CLOSED = 1, 2, 3, 4, 5
_PHASE_NAMES = {CREATED: "CREATED", INITIALIZED: "INITIALIZED", DATA_PROCESSED: "DATA_PROCESSED",
                TIMER_PROCESSED: "TIMER_PROCESSED", CLOSED: "CLOSED"}  # fmt: skip

#: Spark's time modes, lower case (as Spark parses them: case does not matter)
TIME_MODES = ("none", "processingtime", "eventtime")


def normalize_time_mode(time_mode: str) -> str:
    """``"None"``/``"ProcessingTime"``/``"EventTime"`` in any case -> lower case (Spark's parsing)."""
    mode = str(time_mode).lower()
    if mode not in TIME_MODES:
        raise ValueError(f"unknown time mode {time_mode!r}: use 'None', 'ProcessingTime' or 'EventTime'")
    return mode


# -- the state objects -------------------------------------------------------------------------


def _dropped(operation: str, kind: str, name: str) -> Exception:
    """What pyspark's client raises for a call on a state its handle no longer has."""
    from pyspark.errors import PySparkRuntimeError

    return PySparkRuntimeError(f"{operation}: {kind} state {name} is not initialized.")


class _Variable:
    """What Spark's three state objects share: the handle (whose current key every call checks),
    the backend state (None once ``deleteIfExists`` dropped it) and the schema's codec."""

    __slots__ = ("_codec", "_handle", "_name", "_state")
    _KIND = ""

    def __init__(self, handle: _StateHandle, name: str, state: Any, codec: StructCodec) -> None:
        self._handle, self._name, self._state, self._codec = handle, name, state, codec

    def _check(self, operation: str) -> Any:
        """The backend state, once the call is allowed: a grouping key is set and the state was not
        dropped (``operation`` names the call as pyspark's client does in its error)."""
        if self._handle.current_key is None:
            self._handle.check_key(self._name)  # raises
        if self._state is None:
            raise _dropped(operation, self._KIND, self._name)
        return self._state

    def _live(self) -> bool:
        """For the iterators, which Spark's client ends early (empty) on a dropped state."""
        self._handle.check_key(self._name)
        return self._state is not None

    def _rebind(self, other: _Variable) -> None:
        """The state was created again after ``deleteIfExists``: address the new one, as Spark's
        objects (which name their state) do."""
        self._state, self._codec = other._state, other._codec


class _ValueState(_Variable):
    """Spark's ValueState: ``get`` returns a tuple in schema order, or None."""

    __slots__ = ()
    _KIND = "Value"

    def exists(self) -> bool:
        return self._check("Error checking value state exists").value() is not None

    def get(self) -> tuple[Any, ...] | None:
        stored = self._check("Error getting value state").value()
        return None if stored is None else self._codec.values(stored)

    def update(self, newValue: Any) -> None:
        state = self._check("Error updating value state")
        state.update(self._codec.to_store(newValue))  # None is not iterable: TypeError, as in pyspark

    def clear(self) -> None:
        self._check("Error clearing value state").clear()


class _ListState(_Variable):
    """Spark's ListState: ``get`` returns an iterator of tuples; ``put``/``appendList`` refuse an
    empty list and None elements (Spark's ILLEGAL_STATE_STORE_VALUE)."""

    __slots__ = ()
    _KIND = "List"

    def _elements(self, values: Any, what: str) -> list[Any]:
        self._handle.check_key(self._name)
        if values is None:
            raise TypeError(f"state {self._name!r}: {what} needs a list, not None ('NoneType' object is not iterable)")
        elements = [self._codec.to_store(v) for v in values]
        if not elements:
            raise ValueError(f"state {self._name!r}: {what} needs a non-empty list (EMPTY_LIST_VALUE)")
        return elements

    def exists(self) -> bool:
        return bool(self._check("Error checking value state exists").get())  # pyspark's message, for lists too

    def get(self) -> Iterator[tuple[Any, ...]]:
        if not self._live():
            return iter(())
        values = self._codec.values
        return iter([values(v) for v in self._state.get()])

    def put(self, newState: Any) -> None:
        elements = self._elements(newState, "put")
        self._check("Error updating value state").update(elements)

    def appendValue(self, newState: Any) -> None:
        state = self._check("Error updating value state")
        state.add(self._codec.to_store(newState))

    def appendList(self, newState: Any) -> None:
        elements = self._elements(newState, "appendList")
        self._check("Error updating value state").add_all(elements)

    def clear(self) -> None:
        self._check("Error clearing value state").clear()


class _MapState(_Variable):
    """Spark's MapState: ``getValue`` returns a ``Row`` with the value schema's names (as Spark
    does), the iterators plain tuples, in Spark's order (its RocksDB order of the user keys'
    ``UnsafeRow`` bytes, ``backend.spark.unsafe_row``), sorted when iterating: the stored
    format stays the drop-in's own."""

    __slots__ = ("_key_codec", "_order")
    _KIND = "Map"

    def __init__(self, handle: _StateHandle, name: str, state: Any, key_codec: StructCodec, codec: StructCodec) -> None:
        super().__init__(handle, name, state, codec)
        self._key_codec = key_codec
        self._order = map_key_order(key_codec.dtype)

    def _rebind(self, other: _Variable) -> None:
        super()._rebind(other)
        if isinstance(other, _MapState):
            self._key_codec, self._order = other._key_codec, other._order

    def exists(self) -> bool:
        return not self._check("Error checking map state exists").is_empty()

    def getValue(self, key: Any) -> Any:
        stored = self._check("Error getting value").get(self._key_codec.to_store(key))
        return None if stored is None else self._codec.from_store(stored)

    def containsKey(self, key: Any) -> bool:
        state = self._check("Error checking if map state contains key")
        return state.contains(self._key_codec.to_store(key))  # type: ignore[no-any-return]

    def updateValue(self, key: Any, value: Any) -> None:
        state = self._check("Error updating map state value")
        state.put(self._key_codec.to_store(key), self._codec.to_store(value))

    def iterator(self) -> Iterator[tuple[tuple[Any, ...], tuple[Any, ...]]]:
        if not self._live():
            return iter(())
        keys, values, order = self._key_codec.values, self._codec.values, self._order
        items = self._state.items()
        if order is not None:
            items = sorted(items, key=lambda item: order(item[0]))
        return iter([(keys(k), values(v)) for k, v in items])

    def keys(self) -> Iterator[tuple[Any, ...]]:
        return (k for k, _ in self.iterator())

    def values(self) -> Iterator[tuple[Any, ...]]:
        return (v for _, v in self.iterator())

    def removeKey(self, key: Any) -> None:
        self._check("Error removing key from map state").remove(self._key_codec.to_store(key))

    def clear(self) -> None:
        self._check("Error clearing map state").clear()


# -- the handle ---------------------------------------------------------------------------------


class _StateHandle:
    """Spark's ``StatefulProcessorHandle`` on a ``ChangelogKeyedStateBackend``.

    The runner drives its phase (``phase``), sets the grouping key of each call
    (``set_implicit_key``), and fires timers (``collect_expired_timers``/``finish_timer``); the
    processor sees only Spark's methods. Timers go to the backend's processing-time timers in
    ProcessingTime mode and its event-time timers in EventTime mode.
    """

    def __init__(
        self, backend: ChangelogKeyedStateBackend, time_mode: str = "None", strict_types: bool = False
    ) -> None:
        self._backend = backend
        #: raise ``StateValueError`` for a value of the wrong type instead of storing what Spark stores
        self.strict_types = strict_types
        self.time_mode = normalize_time_mode(time_mode)
        self.phase = CREATED
        self.current_key: tuple[Any, ...] | None = None  # the backend key of the current call
        #: timers taken out of the backend to fire in this batch and not yet handled, by the key's
        #: table key: Spark still lists them (and ignores registering them) until they are handled
        self._firing: dict[bytes, set[int]] = {}
        self._domain = EVENT_TIME if self.time_mode == "eventtime" else PROCESSING_TIME
        #: the state objects ``init`` created, by state name (``deleteIfExists`` drops them)
        self._variables: dict[str, list[_Variable]] = {}

    # -- driven by the runner ------------------------------------------------------------------

    def set_implicit_key(self, key: Sequence[Any], key_group: int | None = None) -> tuple[Any, ...]:
        """Make ``key`` (a grouping key as Spark passes it) current; returns its backend key.

        ``key_group``: the key's key group when the plumbing computed it (Spark's SQL hash in the
        JVM); None lets the backend compute it from the key's bytes."""
        bkey = backend_key(key)
        set_key(self._backend, bkey, key_group)
        self.current_key = bkey
        return bkey

    def remove_implicit_key(self) -> None:
        self.current_key = None

    def check_key(self, name: str) -> None:
        """State ``name`` is used with a grouping key (in a handler, not in init or close)."""
        if self.current_key is None:
            raise StateOperationError(
                f"state {name!r} used without a grouping key: use state in handleInputRows, "
                "handleInitialState or handleExpiredTimer, not in init or close"
            )

    def collect_expired_timers(self, threshold_ms: int) -> list[tuple[tuple[Any, ...], int, int]]:
        """Take every timer with timestamp <= ``threshold_ms`` out of the backend (as Spark 4.3
        does: a timer registered at the batch timestamp fires in that batch), in timestamp order, as (backend
        key, key group, timestamp). Like Spark's pre-fetched iterator, the list is fixed now: timers
        registered while handling them wait for the next batch, deleted ones still fire."""
        fired: list[tuple[tuple[Any, ...], int, int]] = []

        def collect(key: Any, timestamp: int) -> None:
            fired.append((key, self._backend.current_kg, timestamp))
            self._firing.setdefault(self._backend.current_ckey, set()).add(timestamp)

        if self._domain == EVENT_TIME:
            self._backend.advance_watermark(threshold_ms, collect)
        else:
            self._backend.advance_processing_time(threshold_ms, collect)
        return fired

    def finish_timer(self, timestamp: int) -> None:
        """After handleExpiredTimer of the current key: Spark deletes the timer, also if it was
        registered again while it was being handled."""
        self._firing.get(self._backend.current_ckey, set()).discard(timestamp)
        self._delete(timestamp)

    # -- Spark's StatefulProcessorHandle --------------------------------------------------------

    def _check_create(self, operation: str, name: str) -> None:
        if self.phase != CREATED:
            raise StateOperationError(
                f"cannot {operation} {name!r} in handle state {_PHASE_NAMES[self.phase]}: state variables are "
                "created and deleted only in init()"
            )

    def _ttl(self, name: str, ttl_ms: int | None) -> StateTtl | None:
        if not ttl_ms:
            return None
        try:  # StateTtl checks the range; a bad TTL is reported before a wrong time mode
            ttl = StateTtl(int(ttl_ms))
        except ConfigurationError as exc:
            raise ConfigurationError(f"state {name!r}: {exc}") from None
        if self.time_mode != "processingtime":
            raise StateOperationError(f"state {name!r}: TTL needs time mode ProcessingTime, not {self.time_mode!r}")
        return ttl

    def _register(self, name: str, variable: _Variable) -> Any:
        """Keep ``variable`` for ``deleteIfExists``; objects of the same kind that a deletion of the
        state dropped address the new one (Spark's objects name their state)."""
        known = self._variables.setdefault(name, [])
        for old in known:
            if old._state is None and type(old) is type(variable):
                old._rebind(variable)
        known.append(variable)
        return variable

    def _declared(self, name: str, kind: str, *codecs: StructCodec) -> tuple[str, ...]:
        return state_schemas.declared(self._backend, name, kind, *codecs)

    def getValueState(self, stateName: str, schema: Any, ttlDurationMs: int | None = None) -> _ValueState:
        self._check_create("create state", stateName)
        codec = struct_codec(schema, stateName, self.strict_types)
        ttl, declared = self._ttl(stateName, ttlDurationMs), self._declared(stateName, "value", codec)
        descriptor = ValueStateDescriptor(stateName, codec.serializer, ttl, declared)
        made = _pyspark_classes()["ValueState"](self, stateName, self._backend.get_state(descriptor), codec)
        return self._register(stateName, made)  # type: ignore[no-any-return]

    def getListState(self, stateName: str, schema: Any, ttlDurationMs: int | None = None) -> _ListState:
        self._check_create("create state", stateName)
        codec = struct_codec(schema, stateName, self.strict_types)
        ttl, declared = self._ttl(stateName, ttlDurationMs), self._declared(stateName, "list", codec)
        descriptor = ListStateDescriptor(stateName, codec.serializer, ttl, declared)
        made = _pyspark_classes()["ListState"](self, stateName, self._backend.get_state(descriptor), codec)
        return self._register(stateName, made)  # type: ignore[no-any-return]

    def getMapState(
        self, stateName: str, userKeySchema: Any, valueSchema: Any, ttlDurationMs: int | None = None
    ) -> _MapState:
        self._check_create("create state", stateName)
        key_codec = struct_codec(userKeySchema, stateName, self.strict_types, prefix="key")
        codec = struct_codec(valueSchema, stateName, self.strict_types)
        ttl, declared = self._ttl(stateName, ttlDurationMs), self._declared(stateName, "map", codec, key_codec)
        descriptor = MapStateDescriptor(
            stateName, codec.serializer, ttl, declared, user_key_serializer=key_codec.serializer
        )
        state = self._backend.get_state(descriptor)
        made = _pyspark_classes()["MapState"](self, stateName, state, key_codec, codec)
        return self._register(stateName, made)  # type: ignore[no-any-return]

    def deleteIfExists(self, stateName: str) -> None:
        """Drop the state and its data in every key; it may then be created again with another
        schema. The objects created for it fail from now on, as Spark's do."""
        self._check_create("delete state", stateName)
        self._backend.delete_state(stateName)
        for variable in self._variables.get(stateName, ()):
            variable._state = None

    def _check_timers(self, operation: str) -> None:
        if self.time_mode == "none":
            raise StateOperationError(f"cannot {operation} with time mode None")
        if not INITIALIZED <= self.phase <= DATA_PROCESSED or self.current_key is None:
            raise StateOperationError(f"cannot {operation} in handle state {_PHASE_NAMES[self.phase]}")

    def _timestamp(self, value: Any) -> int:
        value = plain_value(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"a timer timestamp is an int (ms), got {value!r}")
        return int(value)

    def registerTimer(self, expiryTimestampMs: int) -> None:
        self._check_timers("register a timer")
        timestamp = self._timestamp(expiryTimestampMs)
        if timestamp in self._firing.get(self._backend.current_ckey, ()):
            return  # Spark: it exists until handled, so this is a no-op (and it is deleted after)
        if self._domain == EVENT_TIME:
            self._backend.register_event_time_timer(timestamp)
        else:
            self._backend.register_processing_time_timer(timestamp)

    def _delete(self, timestamp: int) -> None:
        if self._domain == EVENT_TIME:
            self._backend.delete_event_time_timer(timestamp)
        else:
            self._backend.delete_processing_time_timer(timestamp)

    def deleteTimer(self, expiryTimestampMs: int) -> None:
        self._check_timers("delete a timer")
        timestamp = self._timestamp(expiryTimestampMs)
        self._firing.get(self._backend.current_ckey, set()).discard(timestamp)
        self._delete(timestamp)

    def listTimers(self) -> Iterator[int]:
        """The current key's timers, ascending (Spark's order is its encoding's: unspecified)."""
        self._check_timers("list timers")
        timers = set(self._backend.timers.timestamps(self._domain))
        timers.update(self._firing.get(self._backend.current_ckey, ()))
        return iter(sorted(timers))


# -- pyspark's classes --------------------------------------------------------------------------

#: the public names of the classes built on pyspark's (``_pyspark_classes``), and what they build on
_BUILT = {
    "SparkStateHandle": (_StateHandle, "StatefulProcessorHandle"),
    "ValueState": (_ValueState, "ValueState"),
    "ListState": (_ListState, "ListState"),
    "MapState": (_MapState, "MapState"),
}


@functools.cache
def _pyspark_classes() -> dict[str, type[Any]]:
    """Our handle and state classes as subclasses of pyspark's (built once, on first use)."""
    from pyspark.sql.streaming import stateful_processor

    return {
        name: type(name, (ours, getattr(stateful_processor, theirs)),
                   {"__slots__": (), "__module__": __name__, "__qualname__": name, "__doc__": ours.__doc__})
        for name, (ours, theirs) in _BUILT.items()
    }  # fmt: skip


def new_handle(
    backend: ChangelogKeyedStateBackend, time_mode: str = "None", strict_types: bool = False
) -> _StateHandle:
    """A ``SparkStateHandle`` (a pyspark ``StatefulProcessorHandle``) over ``backend``."""
    return _pyspark_classes()["SparkStateHandle"](backend, time_mode, strict_types)  # type: ignore[no-any-return]


if TYPE_CHECKING:
    SparkStateHandle = _StateHandle
    ValueState = _ValueState
    ListState = _ListState
    MapState = _MapState


def __getattr__(name: str) -> Any:
    """``SparkStateHandle``, ``ValueState``, ``ListState``, ``MapState``: built on pyspark's classes
    when first asked for (PEP 562), so that importing this module does not import pyspark."""
    if name in _BUILT:
        return _pyspark_classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
