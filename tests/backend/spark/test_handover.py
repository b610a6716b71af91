"""Materialization in the background under Spark, without a Spark session: ``run_subtask`` as a task
calls it, "another Python worker" simulated by dropping this process's kept backends
(``other_worker``). A task only starts its subtask's materialization; the result reaches the next
task of the subtask in the same worker (the materializer's ``poll``) or in another one (a result
file in the local directory, ``backend.spark.handover``), and only if it still applies.

Uploads are held by the fault layer (``benchmarks.support.faulty_fs``: a stall on chunk puts)
and awaited through their futures; nothing waits by sleeping.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.core.errors import BackendClosedError
from backend.core.handles import KeyedStateHandle
from backend.spark import tasks
from backend.spark.committed import committed_handles
from backend.spark.config import OperatorConfig
from backend.spark.driver import DriverCoordinator
from backend.spark.tasks import run_subtask
from benchmarks.support.faulty_fs import Fault, FaultPlan, faulty_base_path
from dstl import ChangelogConfig
from materializer.options import MaterializationOptions
from tests.backend.spark.appending_tasks import (
    KEYS,
    appender,
    collector,
    config,
    key_group,
    other_worker,
    run_tasks,
)

#: the chunks of a materialization of the whole state at parallelism 1: one per non-empty key group,
#: all in one file (a pack) unless the config says otherwise
CHUNKS = len({key_group(k) for k in KEYS})
#: chunk puts, relative to the faulty base path
CHUNK_PUTS = "state/shared/*"

_ABANDONED: list[concurrent.futures.Future[Any]] = []


@pytest.fixture(autouse=True)
def _clean_workers() -> Iterator[None]:
    other_worker()
    yield
    settle()
    other_worker()
    for storage in tasks._STORAGES.values():
        storage.close()
    tasks._STORAGES.clear()


def faulty(tmp_path: Path, plan: FaultPlan, host: str = "a", pack_bytes: int = 16 << 20) -> OperatorConfig:
    """One subtask on a DFS with ``plan``'s faults; a materialization is due in every batch that
    logged something, unless one is running; ``pack_bytes=1``: one put per chunk."""
    job = f"{faulty_base_path(tmp_path / 'dfs', plan)}/state"
    return OperatorConfig(
        job_dir=job, uid="op", parallelism=1, max_parallelism=128, local_root=str(tmp_path / host),
        changelog=ChangelogConfig(base_path=job, max_attempts=1), tasks=1, changelog_service=False,
        materialization=MaterializationOptions(interval_ms=10**12, size_trigger_bytes=1, pack_bytes=pack_bytes),
    )  # fmt: skip


def running(cfg: OperatorConfig, subtask: int = 0) -> concurrent.futures.Future[Any]:
    """The materialization the kept backend of ``subtask`` started and has not applied."""
    future = tasks._KEPT[(cfg.job_dir, cfg.uid, cfg.parallelism, subtask)].materializer.in_flight
    assert future is not None
    return future


def settle() -> None:
    """Every materialization of this process has ended (uploaded and handed over, or failed)."""
    futures = [f for k in tasks._KEPT.values() if (f := k.materializer.in_flight) is not None]
    concurrent.futures.wait([*futures, *_ABANDONED])
    _ABANDONED.clear()


def drop_worker() -> None:
    """``other_worker`` without waiting: the worker drops its backends while they still upload."""
    _ABANDONED.extend(f for k in tasks._KEPT.values() if (f := k.materializer.in_flight) is not None)
    other_worker(finish_uploads=False)


def handle_of(cfg: OperatorConfig, batch: int, subtask: int = 0) -> KeyedStateHandle:
    return KeyedStateHandle.from_json(committed_handles(tasks.storage_for(cfg), cfg, batch)[subtask])


def chunk_paths(chunks: Any) -> set[str]:
    return {str(c["path"]) for c in chunks}


def results_in(cfg: OperatorConfig, subtask: int = 0) -> list[Path]:
    return sorted(cfg.local_dir(subtask).glob("materialized-*.json"))


def state_after(cfg: OperatorConfig, batch: int) -> dict[tuple[str], list[int]]:
    """The state after ``batch`` as a worker of a fresh host restores it from the DFS."""
    probe = dataclasses.replace(cfg, local_root=f"{cfg.local_root}-probe")
    seen: dict[tuple[str], list[int]] = {}

    collect = collector(seen)

    settle()
    for i in range(cfg.parallelism):
        run_subtask(probe, i, batch + 1, "q", 1, collect)
    other_worker()
    return seen


def first_batch(cfg: OperatorConfig) -> None:
    """Batch 0, which materializes nothing: a materialization becomes due on what was logged,
    and the first batch's changes reach the log only when it persists."""
    _, stats = run_subtask(cfg, 0, 0, "q", 1, appender(0))
    assert not stats["materializing"]


def upto(batch: int) -> dict[tuple[str], list[int]]:
    return {k: list(range(batch + 1)) for k in KEYS}


def test_a_task_returns_while_its_materialization_uploads_and_the_same_worker_applies_it_next(tmp_path: Path) -> None:
    plan = FaultPlan()
    cfg = faulty(tmp_path, plan)
    first_batch(cfg)
    plan.add(Fault(op="put", path=CHUNK_PUTS, action="stall"))
    _, stats = run_subtask(cfg, 0, 1, "q", 1, appender(1))
    assert plan.wait_stalled(1)  # the task returned; its upload is held
    assert stats["materializing"] and stats["chunks"] == 0  # its handle names no chunk
    upload = running(cfg)
    assert not upload.done()
    plan.release()
    concurrent.futures.wait([upload])
    _, stats = run_subtask(cfg, 0, 2, "q", 1, appender(2))
    assert (stats["source"], stats["materialized"], stats["chunks"]) == ("kept", 1, CHUNKS)
    handle = handle_of(cfg, 2)
    assert chunk_paths(handle.materialized) == chunk_paths(upload.result().chunks)
    (own,) = handle.changelog  # the log after the materialization: batch 1's changes only
    assert own.log.segments and own.log.after == upload.result().chunks[0]["sqn"]
    assert state_after(cfg, 2) == upto(2)
    plan.close()


def test_the_next_batch_in_another_worker_takes_the_materialization_from_the_local_directory(tmp_path: Path) -> None:
    plan = FaultPlan()
    cfg = faulty(tmp_path, plan)
    first_batch(cfg)
    plan.add(Fault(op="put", path=CHUNK_PUTS, action="stall"))
    run_subtask(cfg, 0, 1, "q", 1, appender(1))
    assert plan.wait_stalled(1)
    upload = running(cfg)
    plan.release()
    other_worker()  # the upload finishes in the old worker and leaves its result
    (result,) = results_in(cfg)
    _, stats = run_subtask(cfg, 0, 2, "q", 1, appender(2))
    assert (stats["source"], stats["materialized"], stats["chunks"]) == ("local", 1, CHUNKS)
    assert not result.exists()
    handle = handle_of(cfg, 2)
    assert chunk_paths(handle.materialized) == chunk_paths(upload.result().chunks)
    (own,) = handle.changelog  # batch 0's log is covered by the chunks: only this worker's log is left
    assert own.log.log_id != handle_of(cfg, 1).changelog[0].log.log_id
    assert state_after(cfg, 2) == upto(2)
    plan.close()


def test_a_result_of_an_earlier_life_of_the_directory_is_not_used(tmp_path: Path) -> None:
    plan = FaultPlan()
    cfg = faulty(tmp_path, plan)
    first_batch(cfg)
    run_subtask(cfg, 0, 1, "q", 1, appender(1))
    other_worker()
    (result,) = results_in(cfg)
    value = json.loads(result.read_text())
    result.write_text(json.dumps({**value, "life": "a life before a restore from the DFS"}))
    _, stats = run_subtask(cfg, 0, 2, "q", 1, appender(2))
    assert (stats["source"], stats["materialized"], stats["chunks"]) == ("local", 0, 0)
    assert not result.exists()
    assert state_after(cfg, 2) == upto(2)
    plan.close()


def test_a_materialization_finishing_while_another_worker_runs_the_next_batch_is_not_applied(tmp_path: Path) -> None:
    """Worker A's upload ends while worker B runs batch 1: B started before the result existed,
    and after B's batch the state continues with B's log, which A's result does not cover. B's
    own materialization is taken by the batch after, A's chunks stay orphans for the driver."""
    plan = FaultPlan()
    cfg = faulty(tmp_path, plan)
    first_batch(cfg)
    # A's put of its chunks (one file): every read of its tables is done, so A may close them meanwhile
    plan.add(Fault(op="put", path=CHUNK_PUTS, action="stall", times=1))
    run_subtask(cfg, 0, 1, "q", 1, appender(1))
    assert plan.wait_stalled(1)
    upload_a = running(cfg)
    drop_worker()

    def lands_meanwhile(backend: Any, now: int, watermark: Any) -> list[Any]:
        plan.release()
        concurrent.futures.wait([upload_a])
        assert len(results_in(cfg)) == 1
        return list(appender(2)(backend, now, watermark))

    _, stats = run_subtask(cfg, 0, 2, "q", 1, lands_meanwhile)  # worker B
    assert (stats["source"], stats["materialized"], stats["chunks"]) == ("local", 0, 0)
    chunks_a = chunk_paths(upload_a.result().chunks)
    upload_b = running(cfg)
    other_worker()
    assert len(results_in(cfg)) == 2
    _, stats = run_subtask(cfg, 0, 3, "q", 1, appender(3))  # worker C
    assert stats["materialized"] == 1
    assert chunk_paths(handle_of(cfg, 3).materialized) == chunk_paths(upload_b.result().chunks)
    remaining = [json.loads(p.read_text())["log_id"] for p in results_in(cfg)]
    assert remaining in ([], [handle_of(cfg, 3).changelog[-1].log.log_id])  # at most C's own, later
    assert state_after(cfg, 3) == upto(3)
    storage = tasks.storage_for(cfg)
    assert chunks_a <= set(storage.files.list("shared"))  # workers delete nothing
    driver = DriverCoordinator(cfg)  # a driver start deletes what no checkpoint or pending record names
    try:
        assert not chunks_a & set(storage.files.list("shared"))
    finally:
        driver.close()
    plan.close()


def test_a_result_whose_chunks_are_gone_from_the_dfs_is_not_taken(tmp_path: Path) -> None:
    """A result left by a worker of an earlier application: the new driver's start-up cleanup
    deleted its chunks, which no checkpoint names."""
    plan = FaultPlan()
    cfg = faulty(tmp_path, plan)
    first_batch(cfg)
    run_subtask(cfg, 0, 1, "q", 1, appender(1))
    other_worker()
    (result,) = results_in(cfg)
    DriverCoordinator(cfg).close()  # the next application's driver starts
    _, stats = run_subtask(cfg, 0, 2, "q", 1, appender(2))
    assert (stats["source"], stats["materialized"], stats["chunks"]) == ("local", 0, 0)
    assert not result.exists()
    assert state_after(cfg, 2) == upto(2)
    plan.close()


def test_a_worker_that_dies_mid_upload_leaves_no_result_and_the_next_worker_materializes_again(tmp_path: Path) -> None:
    plan = FaultPlan()
    cfg = faulty(tmp_path, plan, pack_bytes=1)  # a put per chunk: reads of the tables follow the first
    first_batch(cfg)
    plan.add(Fault(op="put", path=CHUNK_PUTS, action="stall", times=1))  # A's first chunk put
    run_subtask(cfg, 0, 1, "q", 1, appender(1))
    assert plan.wait_stalled(1)
    upload_a = running(cfg)
    drop_worker()  # its tables close under the upload
    plan.release()
    concurrent.futures.wait([upload_a])
    assert isinstance(upload_a.exception(), BackendClosedError)  # its next read failed: no result
    assert results_in(cfg) == []
    _, stats = run_subtask(cfg, 0, 2, "q", 1, appender(2))
    assert (stats["source"], stats["materialized"], stats["materializing"]) == ("local", 0, True)
    other_worker()
    _, stats = run_subtask(cfg, 0, 3, "q", 1, appender(3))
    assert (stats["materialized"], stats["chunks"]) == (1, CHUNKS)
    assert state_after(cfg, 3) == upto(3)
    plan.close()


def test_a_failed_materialization_leaves_the_state_correct_and_starts_again(tmp_path: Path) -> None:
    plan = FaultPlan()
    cfg = faulty(tmp_path, plan)
    first_batch(cfg)
    failing = plan.add(Fault(op="put", path=CHUNK_PUTS, action="fail"))
    for batch in (1, 2):
        _, stats = run_subtask(cfg, 0, batch, "q", 1, appender(batch))
        assert stats["materializing"]  # batch 2: the failure was counted, and it started again
        concurrent.futures.wait([running(cfg)])
        assert running(cfg).exception() is not None and results_in(cfg) == []
    plan.remove(failing)
    _, stats = run_subtask(cfg, 0, 3, "q", 1, appender(3))  # counts the second failure, starts again
    assert stats["materialized"] == 0 and stats["materializing"]
    settle()
    _, stats = run_subtask(cfg, 0, 4, "q", 1, appender(4))
    assert (stats["source"], stats["materialized"], stats["chunks"]) == ("kept", 1, CHUNKS)
    assert state_after(cfg, 4) == upto(4)
    plan.close()


@settings(max_examples=15)
@given(
    steps=st.lists(st.tuples(st.booleans(), st.booleans()), min_size=3, max_size=12),
    task_count=st.integers(1, 2),
)
def test_many_batches_alternating_workers_with_materialization_due_often_equal_the_model(
    steps: list[tuple[bool, bool]], task_count: int
) -> None:
    """Each batch runs in the same worker or another (``switch``); before it, the uploads in
    flight finish (``settle``) or race with it. Every batch that logs something starts a
    materialization unless one runs. The state equals the model whatever the races, and after a
    settled batch every handle carries at most the log after the last materialization that
    finished before it, and its own: the carried log does not grow with the batches."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = config(Path(tmp), 2, tasks=task_count, size_trigger_bytes=1)
        try:
            for batch, (switch, settled) in enumerate(steps):
                if settled:
                    settle()
                if switch:
                    drop_worker()
                run_tasks(cfg, batch, batch)
                if settled:
                    for subtask in range(cfg.parallelism):
                        assert len(handle_of(cfg, batch, subtask).changelog) <= 2
            assert state_after(cfg, len(steps) - 1) == upto(len(steps) - 1)
        finally:
            settle()
            other_worker()
            for storage in tasks._STORAGES.values():
                storage.close()
            tasks._STORAGES.clear()
