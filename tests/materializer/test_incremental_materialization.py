"""``PeriodicMaterializer``: incremental chunks, only the changed key groups uploaded.

Every restore goes through ``materializer.periodic.restore`` into fresh backends of several
parallelisms, and the union of the subtasks is compared with a dict model: what a restarted job
sees.
"""

from __future__ import annotations

from materializer.options import MaterializationOptions
from materializer.periodic import PeriodicMaterializer
from tests.materializer.backends import (
    NEVER,
    Env,
    check_restores,
    checkpoint,
    first_keys_in_key_group,
    materialize,
    writer,
)
from tests.support.materializer_crash_child import (
    LIST,
    MAP,
    MAX_P,
    VALUE,
    Model,
    apply_to_backend,
    apply_to_model,
    batch_a,
    batch_b,
    checkpoint_1_model,
)

# -- 2. incremental materialization ---------------------------------------------------------------


def test_incremental_materialization_uploads_only_changed_key_groups(env: Env) -> None:
    b = env.backends.new()
    m = PeriodicMaterializer(b, MaterializationOptions(interval_ms=NEVER, size_trigger_bytes=None, chunk_key_groups=1))
    model = Model()
    ops = [(k, k, k, ("x", k)) for k in range(2_000)]
    apply_to_backend(b, ops)
    apply_to_model(model, ops)
    non_empty = {b.key_group_of(k) for k in range(2_000)}
    assert len(non_empty) == MAX_P

    materialize(m)
    assert (m.metrics.chunks_uploaded, m.metrics.chunks_reused) == (MAX_P, 0)
    assert m.metrics.last_incremental_size == m.metrics.last_full_size
    first = checkpoint(b, 1)
    first_paths = {tuple(c["key_groups"]): c["path"] for c in first.materialized}
    assert len(first_paths) == MAX_P
    files_before = set(env.storage.files.list("shared"))

    changed_kg = b.key_group_of(0)
    ops = [(k, -k, -k, ("y", k)) for k in first_keys_in_key_group(changed_kg, 5)]
    apply_to_backend(b, ops)
    apply_to_model(model, ops)
    materialize(m)
    assert m.metrics.chunks_uploaded == MAX_P + 1
    assert m.metrics.chunks_reused == MAX_P - 1
    assert m.metrics.last_incremental_size * 20 < m.metrics.last_full_size, m.metrics
    second = checkpoint(b, 2)
    second_paths = {tuple(c["key_groups"]): c["path"] for c in second.materialized}
    assert {kg for kg, path in second_paths.items() if path != first_paths[kg]} == {(changed_kg, changed_kg)}
    assert set(env.storage.files.list("shared")) - files_before == {second_paths[(changed_kg, changed_kg)]}
    check_restores(env, second, model, parallelisms=(1, 2, 4))

    skipped = m.metrics.skipped_unchanged
    assert m.trigger() is False  # nothing changed since
    assert m.metrics.skipped_unchanged == skipped + 1
    checkpoint(b, 3)  # a checkpoint with nothing new does not make the next one necessary either
    assert m.trigger() is False
    assert m.metrics.skipped_unchanged == skipped + 2
    assert m.metrics.completed == 2
    m.close()


def test_emptied_key_group_is_dropped_and_not_restored(env: Env) -> None:
    b = env.backends.new()
    m = PeriodicMaterializer(b, MaterializationOptions(interval_ms=NEVER, size_trigger_bytes=None, chunk_key_groups=1))
    model = Model()
    ops = [(k, k, k, ("x", k)) for k in range(300)]
    apply_to_backend(b, ops)
    apply_to_model(model, ops)
    materialize(m)
    chunks = m.metrics.chunks_uploaded
    emptied = b.key_group_of(3)
    for k in [k for k in range(300) if b.key_group_of(k) == emptied]:
        b.set_current_key(k)
        b.get_state(VALUE).clear()
        b.get_state(LIST).clear()
        b.get_state(MAP).clear()
        for part in (model.value, model.lists, model.maps):
            part.pop(k)
    materialize(m)
    assert m.metrics.chunks_uploaded == chunks  # nothing to upload: the key group is empty now
    assert m.metrics.chunks_reused == chunks - 1
    handle = checkpoint(b, 1)
    assert all(c["key_groups"] != [emptied, emptied] for c in handle.materialized)
    check_restores(env, handle, model, parallelisms=(1, 2))
    m.close()


def test_materialization_after_a_restore_rewrites_restored_state(env: Env) -> None:
    """A restored backend's state came partly from logs: its first materialization writes every
    chunk (no previous chunk is complete), and checkpoints after it need no old log."""
    b = env.backends.new()
    m = PeriodicMaterializer(b, MaterializationOptions(interval_ms=NEVER, size_trigger_bytes=None, chunk_key_groups=16))
    apply_to_backend(b, batch_a())
    materialize(m)
    apply_to_backend(b, batch_b())
    handle = checkpoint(b, 1)
    m.close()
    model = checkpoint_1_model()

    (r,) = env.backends.restored(handle, 1)
    mr = PeriodicMaterializer(
        r, MaterializationOptions(interval_ms=NEVER, size_trigger_bytes=None, chunk_key_groups=16)
    )
    materialize(mr)  # nothing changed since the restore, but the state is partly from logs
    assert mr.metrics.chunks_reused == 0
    after = checkpoint(r, 2)
    assert all(e.log.log_id == writer(r).log_id for e in after.changelog)  # the restored log is gone
    check_restores(env, after, model, parallelisms=(1, 3))
    assert mr.trigger() is False
    mr.close()
