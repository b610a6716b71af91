"""A materialization taken by a backend that continues the same state in another process, and a
backend closed while its materialization still uploads.

Under Spark the next batch of a subtask may run in another Python worker; it continues from the
state the first worker left and may take that worker's finished materialization
(``ChangelogKeyedStateBackend.adopt_materialization``). Here "another process" is a backend that
restores the first one's checkpoint: its lineage carries the first one's log, as an adopting
worker's does. The storage owns no files, as a Spark worker's: only the driver deletes DFS files,
so a chunk another backend superseded stays for whoever takes it. Every handle is checked by
restoring it and comparing with a dict model. Uploads are held by ``GatedUpload``; nothing waits
by sleeping.
"""

from __future__ import annotations

import concurrent.futures
import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from backend.core.errors import BackendClosedError
from dstl import KeyGroupRange
from materializer.options import MaterializationOptions
from materializer.periodic import MaterializationResult, PeriodicMaterializer
from tests.materializer.backends import (
    FULL,
    NEVER,
    WAIT_S,
    Env,
    GatedUpload,
    check_restores,
    checkpoint,
    environment,
    writer,
)
from tests.support.materializer_crash_child import (
    MAX_P,
    Model,
    apply_to_backend,
    apply_to_model,
    batch_a,
    batch_b,
    batch_c,
)

B = Any


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    with environment(tmp_path, owns_files=False) as e:
        yield e


def handing_over(
    b: B, upload: Callable[[str, bytes], None] | None = None, **options: Any
) -> tuple[PeriodicMaterializer, list[MaterializationResult]]:
    """A materializer started only by the test (``options``: more of its options), and the results
    it hands over."""
    results: list[MaterializationResult] = []
    materialization = MaterializationOptions(interval_ms=NEVER, size_trigger_bytes=None, **options)
    m = PeriodicMaterializer(b, materialization, on_result=results.append, upload=upload)
    return m, results


def take(b: B, result: MaterializationResult) -> bool:
    return bool(b.adopt_materialization(result.log_id, result.sqn, result.key_group_range, result.chunks))


def model_of(*batches: Any) -> Model:
    model = Model()
    for ops in batches:
        apply_to_model(model, ops)
    return model


def test_a_backend_continuing_the_state_takes_the_materialization_instead_of_the_log_it_covers(env: Env) -> None:
    a = env.backends.new()
    m, results = handing_over(a)
    apply_to_backend(a, batch_a())
    assert m.trigger()
    apply_to_backend(a, batch_b())  # after the cut: in a's log after the result's SQN
    handle = checkpoint(a, 1)  # names a's log only: the materialization is not applied in a yet
    m.wait(WAIT_S)
    (result,) = results
    assert (result.log_id, result.key_group_range) == (writer(a).log_id, FULL)
    assert handle.materialized == ()

    (b,) = env.backends.restored(handle, 1)  # continues a's state: carries a's log
    assert take(b, result)
    apply_to_backend(b, batch_c())
    after = checkpoint(b, 2)
    assert list(after.materialized) == list(result.chunks)
    carried, own = after.changelog
    assert (carried.log.log_id, carried.log.after) == (result.log_id, result.sqn)
    assert carried.log.segments and all(seg.sqn > result.sqn for seg in carried.log.segments)
    assert own.log.log_id == writer(b).log_id
    assert sum(s.length for s in carried.log.segments) < sum(s.length for e in handle.changelog for s in e.log.segments)
    check_restores(env, after, model_of(batch_a(), batch_b(), batch_c()), parallelisms=(1, 3))
    assert not take(b, result)  # it holds it already
    m.close()


def test_a_materialization_is_taken_only_where_the_carried_log_ends_with_the_log_it_covers(env: Env) -> None:
    a = env.backends.new()
    m, results = handing_over(a)
    apply_to_backend(a, batch_a())
    first = checkpoint(a, 1)
    assert m.trigger()
    m.wait(WAIT_S)  # r1: a's log up to the end of checkpoint 1
    apply_to_backend(a, batch_b())
    assert m.trigger()
    m.wait(WAIT_S)  # r2: more than checkpoint 1 holds; applied in a
    apply_to_backend(a, batch_c())
    third = checkpoint(a, 2)  # r2's chunks + a's log after r2's SQN
    r1, r2 = results

    (b,) = env.backends.restored(first, 1)
    assert not take(b, r2)  # its chunks hold changes b's lineage does not have
    narrowed = MaterializationResult(r1.log_id, r1.sqn, KeyGroupRange(0, MAX_P // 2 - 1), r1.chunks)
    assert not take(b, narrowed)  # another subtask's key groups
    assert not take(b, MaterializationResult("another-log", r1.sqn, r1.key_group_range, r1.chunks))
    assert take(b, r1)
    assert b.adopt_materialization(r1.log_id, r1.sqn, r1.key_group_range, r1.chunks) is False  # once
    check_restores(env, checkpoint(b, 3), model_of(batch_a()), parallelisms=(2,))

    (c,) = env.backends.restored(third, 1)
    assert not take(c, r2)  # it holds r2 already (its carried log starts at r2's SQN)
    assert not take(c, r1)  # older than what it holds
    apply_to_backend(c, batch_a())  # c's own log now follows a's
    fourth = checkpoint(c, 4)
    (d,) = env.backends.restored(fourth, 1)
    assert [e.log.log_id for e in fourth.changelog] == [r2.log_id, writer(c).log_id]
    assert not take(d, r2)  # the carried log ends with c's log, which r2 does not cover
    model = apply_to_model(model_of(batch_a(), batch_b(), batch_c()), batch_a())
    check_restores(env, checkpoint(d, 5), model, parallelisms=(1, 3))
    m.close()


def test_a_result_covering_only_carried_state_names_the_last_carried_log(env: Env) -> None:
    """A backend that logged nothing yet materializes what it carries: the result names the last
    carried log up to its end, so a backend continuing the same lineage can take it."""
    a = env.backends.new()
    apply_to_backend(a, batch_a())
    handle = checkpoint(a, 1)
    (b,) = env.backends.restored(handle, 1)
    m, results = handing_over(b)
    assert m.trigger()  # nothing changed in b, but its state is carried log
    m.wait(WAIT_S)
    (result,) = results
    (entry,) = handle.changelog
    assert (result.log_id, result.sqn) == (entry.log.log_id, entry.log.upto)
    (c,) = env.backends.restored(handle, 1)
    assert take(c, result)
    after = checkpoint(c, 2)
    assert after.changelog == () and list(after.materialized) == list(result.chunks)
    check_restores(env, after, model_of(batch_a()))
    m.close()


def test_closing_a_backend_while_its_materialization_uploads_fails_the_materialization_cleanly(env: Env) -> None:
    a = env.backends.new()
    upload = GatedUpload(env.storage)
    m, results = handing_over(a, chunk_key_groups=8, upload=upload, pack_bytes=1)  # one chunk per upload
    apply_to_backend(a, batch_a())
    upload.gate.clear()
    assert m.trigger()
    assert upload.blocked.wait(WAIT_S)  # the first chunk is read, its upload is held
    running = m.in_flight
    assert running is not None
    m.close(wait=False)
    env.backends.close(a)  # does not wait for the upload: no read of the tables is in progress
    upload.gate.set()
    concurrent.futures.wait([running], WAIT_S)
    assert isinstance(running.exception(), BackendClosedError)  # its next read found the tables closed
    assert results == []
    assert env.storage.files.list("shared") == []  # the chunk it uploaded is deleted


def test_a_materialization_that_read_everything_finishes_after_its_backend_closed(env: Env) -> None:
    a = env.backends.new()
    upload = GatedUpload(env.storage)
    m, results = handing_over(a, chunk_key_groups=MAX_P, upload=upload)  # one chunk: one read
    apply_to_backend(a, batch_a())
    handle = checkpoint(a, 1)
    upload.gate.clear()
    assert m.trigger()
    assert upload.blocked.wait(WAIT_S)
    running = m.in_flight
    assert running is not None
    m.close(wait=False)
    env.backends.close(a)
    upload.gate.set()
    concurrent.futures.wait([running], WAIT_S)
    assert running.exception() is None
    (result,) = results
    (b,) = env.backends.restored(handle, 1)
    assert take(b, result)
    apply_to_backend(b, batch_b())
    model = apply_to_model(copy.deepcopy(model_of(batch_a())), batch_b())
    check_restores(env, checkpoint(b, 2), model, parallelisms=(1, 2))
