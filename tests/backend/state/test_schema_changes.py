"""A restored state registered with a changed schema: what is refused, with which error, and that
the checkpoint stays usable by the code that wrote it (``backend.core.serializers.evolution``)."""

from __future__ import annotations

from typing import Any

import pytest

from backend.core.descriptors import ValueStateDescriptor
from backend.core.errors import SchemaEvolutionError
from backend.core.handles import KeyedStateHandle
from backend.core.serializers import Float64Serializer, Int64Serializer, OptionalSerializer, RowSerializer
from tests.backend.state.support import Env


def acc(*fields: tuple[str, Any]) -> ValueStateDescriptor[Any]:
    return ValueStateDescriptor("acc", RowSerializer([(n, OptionalSerializer(s)) for n, s in fields]))


OLD = acc(("total", Float64Serializer()), ("n", Int64Serializer()))


def checkpointed_under_old(env: Env) -> KeyedStateHandle:
    """A checkpoint of one key's value under ``OLD``."""
    b = env.backend()
    b.set_current_key("k")
    b.get_state(OLD).update((1.5, 2))
    (handle,) = env.checkpoint(b)
    return handle


def old_code_restores(env: Env, handle: KeyedStateHandle) -> bool:
    """Whether the code that wrote ``handle`` restarts from it and reads its value."""
    again = env.backend()
    again.restore([handle])
    again.set_current_key("k")
    return bool(again.get_state(OLD).value() == (1.5, 2))


@pytest.mark.parametrize(
    ("registered", "field", "why"),
    [
        (acc(("total", Int64Serializer()), ("n", Int64Serializer())), "total", "not a widening"),
        (ValueStateDescriptor("acc", RowSerializer([("total", Float64Serializer())])), "total", "NOT NULL"),
    ],
    ids=["narrowed", "made-not-null"],
)
def test_an_unresolvable_change_is_refused_naming_the_field_and_the_old_code_restores(
    env: Env, registered: ValueStateDescriptor[Any], field: str, why: str
) -> None:
    handle = checkpointed_under_old(env)

    changed = env.backend()
    changed.restore([handle])
    with pytest.raises(SchemaEvolutionError, match=why) as info:
        changed.get_state(registered)
    assert (info.value.state, info.value.field) == ("acc", field)
    error = info.value
    assert f"field {field!r}" in str(error) and error.old in str(error) and error.new in str(error)
    assert "float64/1" in error.old  # the field's stored type, not the whole schema

    assert old_code_restores(env, handle)


def test_a_change_the_rules_resolve_reads_the_old_values_through_it_and_the_old_code_still_restores(
    env: Env,
) -> None:
    handle = checkpointed_under_old(env)
    changed = env.backend()
    changed.restore([handle])
    changed.set_current_key("k")
    new = acc(("n", Int64Serializer()), ("total", Float64Serializer()), ("added", Int64Serializer()))
    assert changed.get_state(new).value() == (2, 1.5, None)

    assert old_code_restores(env, handle)  # the checkpoint was not touched
