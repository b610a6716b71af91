"""A state whose schema changed, materialized: the older version's table goes into the chunks
under its own name as any table, and a restore from them (at any parallelism) reads the old
values converted and the new ones as written (``backend.state.versions``)."""

from __future__ import annotations

from typing import Any

from backend.core.descriptors import ValueStateDescriptor
from backend.core.serializers import Float64Serializer, Int64Serializer, OptionalSerializer, RowSerializer
from materializer.options import MaterializationOptions
from materializer.periodic import PeriodicMaterializer
from tests.materializer.backends import NEVER, Env, checkpoint, materialize, owner

OLD = ValueStateDescriptor("acc", RowSerializer([("total", OptionalSerializer(Int64Serializer()))]))
NEW = ValueStateDescriptor(
    "acc",
    RowSerializer([("n", OptionalSerializer(Int64Serializer())), ("total", OptionalSerializer(Float64Serializer()))]),
)
OPTIONS = MaterializationOptions(interval_ms=NEVER, size_trigger_bytes=None)


def test_a_materialized_checkpoint_after_a_change_restores_both_versions(env: Env) -> None:
    b = env.backends.new()
    m = PeriodicMaterializer(b, OPTIONS)
    for k in range(100):
        b.set_current_key(k)
        b.get_state(OLD).update((k,))
    materialize(m)
    first = checkpoint(b, 1)
    m.close()

    (changed,) = env.backends.restored(first, 1)
    state = changed.get_state(NEW)
    expected: dict[int, Any] = {k: (None, float(k)) for k in range(100)}
    for k in range(0, 100, 3):
        changed.set_current_key(k)
        state.update((k, -1.0))
        expected[k] = (k, -1.0)
    for k in range(1, 100, 3):
        changed.set_current_key(k)
        state.clear()
        expected[k] = None
    m = PeriodicMaterializer(changed, OPTIONS)
    materialize(m)
    second = checkpoint(changed, 2)
    m.close()
    assert second.materialized  # the changes before it are in its chunks, not in the log after it
    assert second.states["acc"]["version"] == 1

    for parallelism in (1, 3):
        subtasks = env.backends.restored(second, parallelism)
        for k, value in expected.items():
            assert owner(subtasks, k).get_state(NEW).value() == value, (parallelism, k)
