"""State registration, delete_state, and keyed access without a current key."""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from typing import Any

import pytest

from backend.core.descriptors import (
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    StateTtl,
    ValueStateDescriptor,
)
from backend.core.serializers import (
    BytesSerializer,
    Float64Serializer,
    Int64Serializer,
    OptionalSerializer,
    RowSerializer,
    StrSerializer,
)
from dstl import ConfigurationError, KeyGroupRange
from tests.backend.state.support import FULL, LIST, MAP, VALUE, B, Env, stored

# -- registration ------------------------------------------------------------------------------


def test_get_state_returns_the_same_state_for_the_same_descriptor(env: Env) -> None:
    b = env.backend()
    s = b.get_state(VALUE)
    b.set_current_key("k")
    s.update(4)
    again = b.get_state(ValueStateDescriptor("value", Int64Serializer()))
    assert again.value() == 4


@pytest.mark.parametrize(
    "other",
    [
        ValueStateDescriptor("value", StrSerializer()),
        ValueStateDescriptor("value", Int64Serializer(), ttl=StateTtl(5)),
        ListStateDescriptor("value", Int64Serializer()),
        MapStateDescriptor("value", Int64Serializer(), user_key_serializer=StrSerializer()),
        ReducingStateDescriptor("value", Int64Serializer(), reduce=operator.add),
    ],
    ids=["serializer", "ttl", "list", "map", "reducing"],
)
def test_reregistering_a_name_with_another_serializer_or_kind_raises(env: Env, other: Any) -> None:
    b = env.backend()
    b.get_state(VALUE)
    with pytest.raises(ValueError):
        b.get_state(other)


def test_map_user_key_serializer_is_part_of_the_registration(env: Env) -> None:
    b = env.backend()
    b.get_state(MAP)
    with pytest.raises(ValueError):
        b.get_state(MapStateDescriptor("map", Int64Serializer(), user_key_serializer=BytesSerializer()))


def test_the_timer_state_name_is_reserved(env: Env) -> None:
    b = env.backend()
    with pytest.raises(ValueError):
        b.get_state(ValueStateDescriptor("__timers__", Int64Serializer()))


@pytest.mark.parametrize(
    ("make", "argument"),
    [
        (lambda env: StateTtl(0), "ttl_ms"),
        (lambda env: ValueStateDescriptor("", Int64Serializer()), "state name"),
        (lambda env: MapStateDescriptor("m", Int64Serializer()), "user_key_serializer"),
        (lambda env: ReducingStateDescriptor("r", Int64Serializer()), "reduce="),
        (lambda env: env.backend().get_state(ValueStateDescriptor("__timers__", Int64Serializer())), "reserved"),
        (lambda env: B("op", FULL, env.tmp_path / "no-storage", storage=None), "storage"),
        (lambda env: env.backend(num_retained=0), "num_retained"),
        (lambda env: env.backend(KeyGroupRange(0, 127), max_parallelism=64), "max_parallelism"),
    ],
    ids=["ttl", "name", "map-user-key", "reduce", "reserved-name", "storage", "num-retained", "key-group-range"],
)
def test_bad_arguments_raise_configuration_error_naming_the_argument(
    env: Env, make: Callable[[Env], Any], argument: str
) -> None:
    with pytest.raises(ConfigurationError, match=re.escape(argument)) as info:
        make(env)
    assert isinstance(info.value, ValueError)  # callers catching ValueError still catch it


# -- delete_state ------------------------------------------------------------------------------


def test_delete_state_of_an_unknown_name_does_nothing(env: Env) -> None:
    b = env.backend()
    b.get_state(VALUE)
    b.set_current_key("k")
    b.get_state(VALUE).update(1)
    b.delete_state("never-registered")
    assert b.get_state(VALUE).value() == 1


def test_delete_state_removes_the_data_and_is_restorable(env: Env) -> None:
    b = env.backend()
    v, m = b.get_state(VALUE), b.get_state(MAP)
    for k in range(15):
        b.set_current_key(k)
        v.update(k)
        m.put("x", k)
        if k == 4:
            b.flush()  # keys 0..4 in LMDB
        elif k == 9:
            env.checkpoint(b)  # keys 5..9 logged by a checkpoint; 10..14 only cached
    b.delete_state(VALUE.name)
    assert stored(b, VALUE.name) == []
    for k in range(15):
        b.set_current_key(k)
        assert m.get("x") == k

    b = env.reopen(b)
    # the state is gone after a restore too: it may be registered again with another serializer
    s = b.get_state(ValueStateDescriptor(VALUE.name, StrSerializer()))
    m = b.get_state(MAP)
    assert stored(b, VALUE.name) == []
    for k in range(15):
        b.set_current_key(k)
        assert s.value() is None
        assert m.get("x") == k
    b.set_current_key(3)
    s.update("new")
    b = env.reopen(b)
    b.set_current_key(3)
    assert b.get_state(ValueStateDescriptor(VALUE.name, StrSerializer())).value() == "new"

    b.delete_state(VALUE.name)  # and once more, registered again with the first serializer
    v = b.get_state(VALUE)
    for k in range(15):
        b.set_current_key(k)
        assert v.value() is None


def test_delete_state_of_a_restored_state_not_registered_again(env: Env) -> None:
    b = env.backend()
    b.set_current_key("k")
    b.get_state(LIST).add("x")
    b = env.reopen(b)
    b.delete_state(LIST.name)  # never registered in this backend, only restored
    assert stored(b, LIST.name) == []
    b = env.reopen(b)
    b.set_current_key("k")
    assert b.get_state(ListStateDescriptor(LIST.name, Int64Serializer())).get() == []


@pytest.mark.parametrize(
    "access",
    [
        lambda b: b.get_state(VALUE).value(),
        lambda b: b.get_state(VALUE).update(1),
        lambda b: b.get_state(LIST).add("x"),
        lambda b: b.register_event_time_timer(5),
    ],
    ids=["value", "update", "list-add", "timer"],
)
def test_keyed_access_without_a_current_key_is_refused(env: Env, access: Callable[[B], Any]) -> None:
    b = env.backend()
    b.get_state(VALUE)
    b.get_state(LIST)
    with pytest.raises((ValueError, RuntimeError)):
        access(b)
    b.set_current_key("k")
    b.get_state(VALUE).update(2)
    b = env.reopen(b)  # the backend still checkpoints and restores
    b.set_current_key("k")
    assert b.get_state(VALUE).value() == 2


def test_a_registration_under_a_changed_schema_evolves_the_live_state(env: Env) -> None:
    """A backend kept across a query's runs (a Spark worker keeps it) sees the restarted code
    register its state again under the changed schema: the same rules as a restore apply."""
    old = ValueStateDescriptor("acc", RowSerializer([("total", OptionalSerializer(Int64Serializer()))]))
    new = ValueStateDescriptor(
        "acc",
        RowSerializer(
            [("n", OptionalSerializer(Int64Serializer())), ("total", OptionalSerializer(Float64Serializer()))]
        ),
    )
    b = env.backend()
    b.set_current_key("k")
    b.get_state(old).update((4,))  # cached, not yet in LMDB
    b.set_current_key("j")
    b.get_state(old).update((1,))
    evolved = b.get_state(new)
    b.set_current_key("k")
    assert evolved.value() == (None, 4.0)
    evolved.update((1, 5.0))
    (handle,) = env.checkpoint(b)
    again = env.backend()
    again.restore([handle])
    state = again.get_state(new)
    again.set_current_key("k")
    assert state.value() == (1, 5.0)
    again.set_current_key("j")
    assert state.value() == (None, 1.0)
