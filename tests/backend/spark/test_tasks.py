"""The task and driver protocol of ``backend.spark`` without a Spark session: ``run_subtask`` as a
task would call it, ``DriverCoordinator.complete_batch`` as the listener would. Covers what a real
Spark run only hits by chance: a subtask changing Python worker every batch, records of an earlier
attempt at another parallelism, local tables of a superseded attempt, a changed operator uid, a
replaced Spark checkpoint, and pending records the next batch may still need.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from backend.checkpointing.metadata import SnapshotMetadata, metadata_path
from backend.core.errors import CheckpointError
from backend.spark import tasks
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
    read_all,
    run_tasks,
)

pytestmark = pytest.mark.usefixtures("clean_workers")  # every test starts and ends with no worker state


def run_batch(cfg: OperatorConfig, batch: int, value: int, subtasks: Any = None) -> list[dict[str, Any]]:
    return [run_subtask(cfg, i, batch, "q", 1, appender(value))[1] for i in subtasks or range(cfg.parallelism)]


def test_a_subtask_that_changes_worker_every_batch_still_materializes(tmp_path: Path) -> None:
    """Each batch runs in another Python worker. A task only starts the materialization; the
    upload ends in the old worker, and the next worker takes its result from the local directory:
    from then on its handle names the chunks and its own log, not the carried logs before them."""
    cfg = config(tmp_path, 1, size_trigger_bytes=4_000)
    driver = DriverCoordinator(cfg)
    driver.register(cfg)
    taken = 0
    started = False
    for batch in range(30):
        (stats,) = run_batch(cfg, batch, batch)
        assert stats["source"] == ("local" if batch else "dfs")
        assert stats["materialized"] == int(started)  # the one the previous worker started, if any
        taken += stats["materialized"]
        started = stats["materializing"]
        driver.complete_batch(batch, "q")
        latest = driver.latest()
        assert latest is not None
        (handle,) = latest.handles("op")
        if stats["materialized"]:
            (own,) = handle.changelog  # the carried logs are in the chunks now
            assert handle.materialized and own.log.segments
        assert len(handle.changelog) < 15  # the carried log does not grow with every batch
        other_worker()  # lets the upload finish in the old worker
    assert taken >= 2
    assert read_all(cfg, 29) == {k: list(range(30)) for k in KEYS}
    driver.close()


def test_records_of_an_attempt_at_another_parallelism_are_not_mixed_in(tmp_path: Path) -> None:
    run_batch(config(tmp_path, 2), 0, 0)
    run_batch(config(tmp_path, 4), 1, 1)  # batch 1 at parallelism 4, never committed
    other_worker()
    run_batch(config(tmp_path, 2), 1, 1)  # Spark re-runs batch 1 at parallelism 2: indices 2, 3 linger
    other_worker()
    assert read_all(config(tmp_path, 3), 1) == {k: [0, 1] for k in KEYS}


def test_local_tables_of_a_superseded_attempt_are_not_adopted(tmp_path: Path) -> None:
    cfg_a, cfg_b = config(tmp_path, 1, host="a"), config(tmp_path, 1, host="b")
    run_batch(cfg_a, 0, 0)
    run_batch(cfg_a, 1, 1)  # host a: tables at batch 1
    other_worker()
    run_batch(cfg_b, 1, 1)  # batch 1 evaluated again on host b: its handle is the committed one
    other_worker()
    stats = run_batch(cfg_a, 2, 2)  # host a's marker says batch 1, but not the committed batch 1
    assert stats[0]["source"] == "dfs"
    assert read_all(cfg_a, 2) == {k: [0, 1, 2] for k in KEYS}


def test_a_changed_operator_uid_or_a_replaced_spark_checkpoint_is_refused(tmp_path: Path) -> None:
    cfg = config(tmp_path, 1)
    driver = DriverCoordinator(cfg)
    driver.register(cfg)
    run_batch(cfg, 0, 0)
    driver.complete_batch(0, "q")
    run_batch(cfg, 1, 1)
    driver.complete_batch(1, "q")
    other_worker()
    with pytest.raises(CheckpointError, match=r"not of 'renamed'.*operator_uid"):
        run_batch(config(tmp_path, 1, uid="renamed", host="b"), 2, 2)
    with pytest.raises(CheckpointError, match=r"starts at batch 0.*checkpointLocation"):
        run_batch(config(tmp_path, 1, host="c"), 0, 0)  # Spark's own checkpoint was deleted
    driver.close()


def test_pending_files_stay_while_the_next_batch_or_a_checkpoint_needs_them(tmp_path: Path) -> None:
    """The records of batch b stay until chk-<b+1> (a task of b+1 may still read them); the files
    holding them hold the log too, so they stay while a retained checkpoint references them, and
    go (with their directories) once a materialization made the log before it unnecessary."""
    state = tmp_path / "state"
    cfg = config(tmp_path, 2, size_trigger_bytes=2_000)
    driver = DriverCoordinator(cfg)
    driver.register(cfg)
    for batch in range(12):
        run_batch(cfg, batch, batch)
        driver.complete_batch(batch, "q")
        retained = [
            SnapshotMetadata.loads((state / metadata_path(c)).read_bytes(), "") for c in {max(batch - 1, 0), batch}
        ]
        referenced = {f for meta in retained for h in meta.handles("op") for f in h.referenced_files()}
        on_disk = {str(p.relative_to(state)) for p in state.glob("pending/*/*/*")}
        latest = {p for p in on_disk if p.startswith(f"pending/{batch}/")}
        assert on_disk - latest <= referenced  # nothing older stays unless a checkpoint needs it
        assert {p for p in referenced if p.startswith("pending/")} <= on_disk
        assert all(any(d.iterdir()) for d in state.glob("pending/*/*"))  # no empty directory stays
    assert len(list(state.glob("pending/*"))) < 12  # materializations let old batches go
    driver.storage.flush()  # subsumption deletes in the background
    assert sorted(p.name for p in state.glob("chk-*")) == ["chk-10", "chk-11"]
    assert read_all(cfg, 11) == {k: list(range(12)) for k in KEYS}
    driver.close()


def test_a_fenced_checkpoint_whose_metadata_landed_does_not_lose_its_batch(tmp_path: Path) -> None:
    """Issue 16, review finding 2: chk-2's _metadata PUT failed after Spark committed batch 2, its
    fence was written and the PUT landed late. A restarted driver took the fenced chk-2 for the
    latest checkpoint, deleted pending/2, and batch 3 silently started from the state after batch 1."""
    plan = FaultPlan()
    job = f"{faulty_base_path(tmp_path / 'dfs', plan)}/state"

    def on(host: str) -> OperatorConfig:
        return OperatorConfig(
            job_dir=job, uid="op", parallelism=2, max_parallelism=128, local_root=str(tmp_path / host),
            changelog=ChangelogConfig(base_path=job), tasks=2, changelog_service=False,
            materialization=MaterializationOptions(interval_ms=10**12),
        )  # fmt: skip

    def state_after_2() -> dict[tuple[str], list[int]]:
        other_worker()
        seen: dict[tuple[str], list[int]] = {}

        collect = collector(seen)

        for i in range(2):
            run_subtask(on("probe"), i, 3, "q", 1, collect)
        other_worker()
        return seen

    cfg = on("a")
    driver = DriverCoordinator(cfg)
    driver.register(cfg)
    try:
        for batch in range(3):
            run_batch(cfg, batch, batch)
            if batch < 2:
                driver.complete_batch(batch, "q")
        plan.add(Fault(op="put", path="state/chk-2/_metadata", action="late"))
        with pytest.raises(CheckpointError, match="fenced"):
            driver.complete_batch(2, "q")
        plan.clear()
        plan.land_late()
        # whatever lands next to a fence is not a checkpoint: here, one naming batch 1's state
        chk_1 = driver.latest()
        assert chk_1 is not None and chk_1.checkpoint_id == 1
        forged = SnapshotMetadata(2, chk_1.operators, job_id=chk_1.job_id, properties=chk_1.properties)
        driver.storage.files.put(metadata_path(2), forged.dumps())
        assert state_after_2() == {k: [0, 1, 2] for k in KEYS}
    finally:
        driver.close()
    driver = DriverCoordinator(cfg)  # a restarted driver
    driver.register(cfg)
    try:
        latest = driver.latest()
        assert latest is not None and latest.checkpoint_id == 1
        assert state_after_2() == {k: [0, 1, 2] for k in KEYS}
    finally:
        driver.close()
        plan.close()


def test_a_task_of_several_subtasks_persists_them_and_their_records_in_one_file(tmp_path: Path) -> None:
    cfg = config(tmp_path, 8, tasks=2)
    driver = DriverCoordinator(cfg)
    driver.register(cfg)
    for batch in range(3):
        run_tasks(cfg, batch, batch)  # one task after the other: a file each
        pending = sorted((tmp_path / "state" / "pending" / str(batch) / "op").iterdir())
        assert len(pending) == 2 and all(p.suffix == ".dstl" for p in pending)
        assert not list((tmp_path / "state").glob("dstl/*/*"))  # the changes went into them
        assert driver.complete_batch(batch, "q") is not None
    latest = driver.latest()
    assert latest is not None
    handles = latest.handles("op")
    assert len(handles) == 8
    for first in (0, 4):  # the four subtasks of a task: each batch's changes in one file
        files = [{s.path for e in h.changelog for s in e.log.segments} for h in handles[first : first + 4]]
        assert all(f == files[0] for f in files) and len(files[0]) == 3
    assert read_all(cfg, 2) == {k: [0, 1, 2] for k in KEYS}
    driver.close()


def test_the_materializations_a_task_starts_together_write_one_chunk_file(tmp_path: Path) -> None:
    """Two tasks of four subtasks each, every subtask due after batch 1: a chunk file per task
    (``materializer.packs``), not one per subtask or key group; the checkpoints name them."""
    cfg = config(tmp_path, 8, tasks=2, size_trigger_bytes=1)
    driver = DriverCoordinator(cfg)
    driver.register(cfg)
    shared = tmp_path / "state" / "shared"
    for batch in range(3):
        stats = run_tasks(cfg, batch, batch)
        if batch == 1:
            assert all(s["materializing"] for s in stats)
            other_worker()  # the uploads finish (and hand over their results)
            assert len(list(shared.iterdir())) == 2
        assert driver.complete_batch(batch, "q") is not None
    latest = driver.latest()
    assert latest is not None
    handles = latest.handles("op")
    for first in (0, 4):
        paths = {c["path"] for h in handles[first : first + 4] for c in h.materialized}
        assert len(paths) == 1 and sum(len(h.materialized) for h in handles[first : first + 4]) > 4
    named = {str(c["path"]) for h in handles for c in h.materialized}
    assert {f"shared/{p.name}" for p in shared.iterdir()} == named
    assert read_all(cfg, 2) == {k: [0, 1, 2] for k in KEYS}
    driver.close()


def test_attempts_that_group_subtasks_into_tasks_differently_mix_by_last_write(tmp_path: Path) -> None:
    """Batch 1 ran with one task for all subtasks and, re-run, with one task per subtask for
    some: each subtask's latest record counts, and restores and local tables agree with it."""
    run_tasks(config(tmp_path, 4, tasks=2), 0, 0)
    run_tasks(config(tmp_path, 4, tasks=1), 1, 1)  # evaluated once: pending/1/op/0-3.json
    other_worker()
    cfg = config(tmp_path, 4, tasks=4, host="b")
    for subtask in (1, 2):  # evaluated again, in part, on another host with value 10
        run_subtask(cfg, subtask, 1, "q", 1, appender(10))
    other_worker()
    driver = DriverCoordinator(cfg)
    driver.register(cfg)
    meta = driver.complete_batch(1, "q")
    assert meta is not None
    rerun = range(cfg.key_group_range(1).start, cfg.key_group_range(2).end + 1)
    expected = {k: [0, 10 if key_group(k) in rerun else 1] for k in KEYS}
    assert read_all(config(tmp_path, 4, tasks=2), 1) == expected
    stats = run_tasks(config(tmp_path, 4, tasks=1), 2, 2)  # host a: tables of 1 and 2 are superseded
    assert [s["source"] for s in stats] == ["local", "dfs", "dfs", "local"]
    driver.close()


def test_a_failing_subtask_fails_its_task_and_the_retry_starts_from_the_previous_batch(tmp_path: Path) -> None:
    cfg = config(tmp_path, 4, tasks=1)
    run_tasks(cfg, 0, 0)

    def failing(subtask: int, backend: Any, now: int, watermark: Any) -> list[Any]:
        appender(1)(backend, now, watermark)
        if subtask == 2:
            raise RuntimeError("the user's processor failed")
        return []

    with pytest.raises(RuntimeError, match="processor failed"):
        tasks.run_subtasks(cfg, range(4), 1, "q", 1, failing)
    assert not (tmp_path / "state" / "pending" / "1").exists()
    stats = run_tasks(cfg, 1, 1)  # the retry, in the same worker
    assert {s["source"] for s in stats} == {"dfs"}  # no table touched by the failed attempt is trusted
    assert read_all(cfg, 1) == {k: [0, 1] for k in KEYS}


def test_a_query_restarted_in_the_same_driver_at_another_parallelism_completes_its_batches(tmp_path: Path) -> None:
    """The driver's coordinator outlives a stopped query; the restarted query's operator registers
    again at its new parallelism and its batches complete at that one."""
    before, after = config(tmp_path, 4, tasks=2), config(tmp_path, 2, tasks=1)
    driver = DriverCoordinator(before)
    driver.register(before)
    run_tasks(before, 0, 0)
    assert driver.complete_batch(0, "q") is not None
    other_worker()
    driver.register(after)  # the same uid at parallelism 2: no longer refused
    run_tasks(after, 1, 1)
    meta = driver.complete_batch(1, "q")
    assert meta is not None and len(meta.handles("op")) == 2
    assert read_all(after, 1) == {k: [0, 1] for k in KEYS}
    driver.close()


def test_the_size_trigger_counts_the_same_bytes_whichever_worker_runs_the_subtask(tmp_path: Path) -> None:
    """The size trigger counts logged (uncompressed) bytes; a subtask adopted by another worker
    must go on counting from the bytes logged so far, not from the carried log's file
    (compressed) bytes, which would make it materialize far later than one that stays put."""

    def logged_after(root: Path, switch: bool) -> int:
        cfg = config(root, 1, size_trigger_bytes=None)
        for batch in range(4):
            stats = run_batch(cfg, batch, batch)
            if switch and batch < 3:
                other_worker()
        assert stats[0]["source"] == ("local" if switch else "kept")
        logged: int = tasks._KEPT[(cfg.job_dir, cfg.uid, 1, 0)].backend.log_bytes_since_materialization
        other_worker()
        return logged

    assert logged_after(tmp_path / "moving", True) == logged_after(tmp_path / "staying", False) > 0
