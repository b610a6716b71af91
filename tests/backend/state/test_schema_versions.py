"""A restored state registered with a schema change the evolution rules resolve: its old values
read converted, writes and clears replace them, and checkpoints before and after the change
restore, for value, list and map state, with and without TTL (``backend.state.versions``)."""

from __future__ import annotations

from typing import Any

import pytest

from backend.core.descriptors import (
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    StateDescriptor,
    StateTtl,
    ValueStateDescriptor,
)
from backend.core.errors import ConfigurationError
from backend.core.handles import KeyedStateHandle
from backend.core.serializers import (
    Float64Serializer,
    Int64Serializer,
    OptionalSerializer,
    RowSerializer,
    Serializer,
    StrSerializer,
)
from tests.backend.state.support import B, Env, stored

I64, F64, STR = Int64Serializer(), Float64Serializer(), StrSerializer()
TTL_MS = 1_000


def row(*fields: tuple[str, Serializer[Any]]) -> RowSerializer:
    return RowSerializer([(name, OptionalSerializer(s)) for name, s in fields])


#: schema A; B reorders it, drops ``gone``, widens ``total`` to float and adds ``added``; C drops
#: ``added`` again and adds ``more``
A = row(("n", I64), ("gone", STR), ("total", I64))
SCHEMA_B = row(("total", F64), ("n", I64), ("added", STR))
C = row(("n", I64), ("total", F64), ("more", I64))


def in_b(a: tuple[Any, ...]) -> tuple[Any, ...]:
    n, _, total = a
    return (None if total is None else float(total), n, None)


def in_c(b: tuple[Any, ...]) -> tuple[Any, ...]:
    total, n, _ = b
    return (n, total, None)


def descriptor(kind: str, schema: RowSerializer, ttl: bool) -> StateDescriptor[Any]:
    t = StateTtl(TTL_MS) if ttl else None
    if kind == "value":
        return ValueStateDescriptor("acc", schema, ttl=t)
    if kind == "list":
        return ListStateDescriptor("acc", schema, ttl=t)
    return MapStateDescriptor("acc", schema, ttl=t, user_key_serializer=STR)


def write(state: Any, kind: str, values: list[Any]) -> None:
    """Replace the current key's state by ``values`` (a value: the first; a map: u0, u1, ...)."""
    if kind == "value":
        state.update(values[0])
    elif kind == "list":
        state.update(values)
    else:
        state.clear()
        state.put_all({f"u{i}": v for i, v in enumerate(values)})


def read(state: Any, kind: str) -> list[Any]:
    """The current key's values in the order ``write`` took them ([] when it has none)."""
    if kind == "value":
        value = state.value()
        return [] if value is None else [value]
    if kind == "list":
        return list(state.get())
    items = dict(state.items())
    assert [state.get(u) for u in items] == list(items.values())  # point reads agree with the scan
    return list(items.values())


KINDS = ["value", "list", "map"]
OLD_VALUES = {f"k{i}": [(i, "x", 10 * i), (i + 1, None, None)] for i in range(4)}


class Clock:
    def __init__(self) -> None:
        self.now = 1_000

    def __call__(self) -> int:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def first_run(env: Env, kind: str, ttl: bool, clock: Clock) -> KeyedStateHandle:
    """Schema A: every key of ``OLD_VALUES`` written, checkpointed (the value state: one value)."""
    b = env.backend(clock=clock)
    state = b.get_state(descriptor(kind, A, ttl))
    for key, values in OLD_VALUES.items():
        b.set_current_key(key)
        write(state, kind, values)
    (handle,) = env.checkpoint(b)
    env.close(b)
    return handle


def restored(env: Env, handle: KeyedStateHandle, clock: Clock) -> B:
    b = env.backend(clock=clock)
    b.restore([handle])
    return b


def expected_in_b(kind: str) -> dict[str, list[Any]]:
    return {key: [in_b(v) for v in (values[:1] if kind == "value" else values)] for key, values in OLD_VALUES.items()}


@pytest.mark.parametrize("ttl", [False, True], ids=["no-ttl", "ttl"])
@pytest.mark.parametrize("kind", KINDS)
def test_old_values_read_converted_writes_and_clears_replace_them_across_restores(
    env: Env, kind: str, ttl: bool, clock: Clock
) -> None:
    before = first_run(env, kind, ttl, clock)
    clock.now += TTL_MS // 2  # the new writes expire later than the old values
    b = restored(env, before, clock)
    state = b.get_state(descriptor(kind, SCHEMA_B, ttl))
    expected = expected_in_b(kind)
    for key, values in expected.items():
        b.set_current_key(key)
        assert read(state, kind) == values
    b.set_current_key("k1")
    write(state, kind, [(2.5, 7, "new")])
    expected["k1"] = [(2.5, 7, "new")]
    b.set_current_key("k2")
    state.clear()  # stored only in the older table
    expected["k2"] = []
    b.set_current_key("k4")
    write(state, kind, [(4.5, 4, None)])
    expected["k4"] = [(4.5, 4, None)]
    for flushed in (False, True):  # the changes cached, then written to the tables
        if flushed:
            b.flush()
        for key, values in expected.items():
            b.set_current_key(key)
            assert read(state, kind) == values
    (after,) = env.checkpoint(b)
    assert after.states["acc"]["version"] == 1
    assert after.states["acc"]["older"] == [{**descriptor(kind, A, ttl).metadata(), "version": 0}]

    again = restored(env, after, clock)  # the same new schema: no new version
    state = again.get_state(descriptor(kind, SCHEMA_B, ttl))
    for key, values in expected.items():
        again.set_current_key(key)
        assert read(state, kind) == values, key
    old_keys = {table_key[4 : 4 + table_key[3]] for table_key, _ in stored(again, "acc")}
    assert len(old_keys) == 2  # k1 and k2 left the older table in the flush that replaced them
    assert stored(again, "acc~1")
    (same,) = env.checkpoint(again)
    assert same.states == after.states

    further = restored(env, after, clock)  # a further change reads both older versions through
    state = further.get_state(descriptor(kind, C, ttl))
    for key, values in expected.items():
        further.set_current_key(key)
        assert read(state, kind) == [in_c(v) for v in values], key
    (third,) = env.checkpoint(further)
    assert [m["version"] for m in third.states["acc"]["older"]] == [1, 0]

    old_code = restored(env, before, clock)  # the checkpoint before the change is untouched
    state = old_code.get_state(descriptor(kind, A, ttl))
    for key, values in OLD_VALUES.items():
        old_code.set_current_key(key)
        assert read(state, kind) == (values[:1] if kind == "value" else values)

    if ttl:  # an old value keeps the expiry it was stored with; a new one has its own
        clock.now = 1_000 + TTL_MS
        state = b.get_state(descriptor(kind, SCHEMA_B, ttl))
        b.set_current_key("k4")
        assert read(state, kind) == [(4.5, 4, None)]
        b.set_current_key("k0")
        assert read(state, kind) == []


@pytest.mark.parametrize("kind", ["list", "map"])
def test_a_mutation_of_a_key_stored_in_the_older_table_moves_its_whole_state(env: Env, kind: str, clock: Clock) -> None:
    b = restored(env, first_run(env, kind, False, clock), clock)
    state = b.get_state(descriptor(kind, SCHEMA_B, False))
    b.set_current_key("k3")
    if kind == "list":
        state.add((9.0, 9, None))
    else:
        state.put("u9", (9.0, 9, None))
    want = [*expected_in_b(kind)["k3"], (9.0, 9, None)]
    assert read(state, kind) == want
    (handle,) = env.checkpoint(b)
    again = restored(env, handle, clock)
    again.set_current_key("k3")
    assert read(again.get_state(descriptor(kind, SCHEMA_B, False)), kind) == want
    assert not [k for k, _ in stored(again, "acc") if b"k3" in k]


def test_reducing_state_adds_to_a_converted_old_value(env: Env, clock: Clock) -> None:
    old = ReducingStateDescriptor("sum", I64, reduce=lambda a, b: a + b)
    b = env.backend(clock=clock)
    b.set_current_key("k")
    b.get_state(old).add(3)
    (handle,) = env.checkpoint(b)
    new = ReducingStateDescriptor("sum", F64, reduce=lambda a, b: a + b)
    again = restored(env, handle, clock)
    again.set_current_key("k")
    again.get_state(new).add(0.5)
    assert again.get_state(new).get() == 3.5


def test_a_state_named_like_another_states_version_table_is_refused(env: Env, clock: Clock) -> None:
    b = restored(env, first_run(env, "value", False, clock), clock)
    b.get_state(descriptor("value", SCHEMA_B, False))  # table acc~1
    with pytest.raises(ConfigurationError, match="collide"):
        b.get_state(ValueStateDescriptor("acc~1", I64))


def test_a_state_deleted_after_a_change_is_gone_in_every_version_and_its_name_is_free(env: Env, clock: Clock) -> None:
    b = restored(env, first_run(env, "value", False, clock), clock)
    state = b.get_state(descriptor("value", SCHEMA_B, False))
    b.set_current_key("k1")
    state.update((1.0, 1, None))
    b.delete_state("acc")
    other = ValueStateDescriptor("acc", I64)
    fresh = b.get_state(other)
    for key in OLD_VALUES:
        b.set_current_key(key)
        assert fresh.value() is None
    b.set_current_key("k0")
    fresh.update(5)
    (handle,) = env.checkpoint(b)
    again = restored(env, handle, clock)
    again.set_current_key("k0")
    assert again.get_state(other).value() == 5
    again.set_current_key("k1")
    assert again.get_state(other).value() is None


def test_declared_types_recorded_on_a_state_of_an_earlier_release_keep_its_version() -> None:
    """A checkpoint written before states recorded the caller's declared types (the Spark adapter's)
    has the same stored form: registering it with them now is no schema change (no read-through
    table, no forced full materialization), and subtasks that did and did not register it since
    agree; the declared types themselves still change versions."""
    from backend.state import versions

    before = {"kind": "value", "serializer": 'row/1("t":optional/1(int64/1))', "ttl_ms": None}
    now = {**before, "declared": ["`t` bigint"]}
    assert versions.register("s", before, now, None) == now  # type: ignore[arg-type]
    assert versions.merge("s", before, now) == now
    assert versions.merge("s", now, before) == now
    renamed = {**before, "serializer": 'row/1("u":optional/1(int64/1))', "declared": ["`u` bigint"]}
    assert versions.version_of(versions.merge("s", {**renamed, "version": 1, "older": [{**before, "version": 0}]},
                                              now)) == 1  # fmt: skip
