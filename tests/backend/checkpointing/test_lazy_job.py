"""A ``LocalJob`` with ``state_loading="lazy"`` (the default): it restores without loading the state, serves and
checkpoints while partly loaded (those checkpoints restore), loads the rest between units of work
(``hydrate_step`` after each checkpoint and poll) until it is fully local, and a NO_CLAIM restore
from a savepoint reads the savepoint until the first checkpoint, which no longer depends on it."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from backend.checkpointing.savepoints import RestoreMode
from backend.job import JobOptions, LocalJob, OperatorSpec
from backend.state.lazy import PENDING_DB
from materializer.options import MaterializationOptions
from tests.backend.checkpointing.workloads import NEVER, Workload, assert_exact, materialize, read_state

STEP = 4  # key groups per subtask and hydration step: 64 per subtask take 16 steps


def job_at(tmp_path: Path, job_id: str = "job", parallelism: int = 2, **options: Any) -> LocalJob:
    options.setdefault("materialization", MaterializationOptions(interval_ms=NEVER, size_trigger_bytes=None))
    options.setdefault("hydration_key_groups", STEP)
    ops = [OperatorSpec("op", parallelism)]
    return LocalJob(tmp_path / "ckpt", job_id, ops, tmp_path / "local", JobOptions(**options))


def materialized_job(tmp_path: Path, work: Workload, job_id: str = "job") -> None:
    """A job whose latest checkpoint holds chunks and a log after them."""
    job = job_at(tmp_path, job_id)
    work.run(job, 300)
    job.checkpoint()
    materialize(job)
    work.run(job, 100)
    job.checkpoint()
    job.close()


def chunk_files(job_dir: Path) -> set[str]:
    return {p.relative_to(job_dir).as_posix() for p in (job_dir / "shared").rglob("*") if p.is_file()}


def pending_tables(job: LocalJob) -> int:
    return sum(s.backend.tables.holds_database(PENDING_DB) for s in job.all_subtasks())


def test_lazy_is_the_default_and_eager_restores_everything_at_start(tmp_path: Path) -> None:
    work = Workload()
    materialized_job(tmp_path, work)
    assert JobOptions().state_loading == "lazy"
    job = job_at(tmp_path, state_loading="eager")
    assert job.fully_local and pending_tables(job) == 0
    assert job.hydrate_step() == 0
    assert read_state(job) == work.model
    job.close()


@pytest.mark.parametrize("parallelism", [2, 3])
def test_a_lazy_job_checkpoints_while_partly_loaded_and_ends_fully_local(tmp_path: Path, parallelism: int) -> None:
    work = Workload()
    materialized_job(tmp_path, work)
    chunks = chunk_files(tmp_path / "ckpt" / "job")
    job = job_at(tmp_path, parallelism=parallelism, state_loading="lazy")
    assert not job.fully_local and pending_tables(job) == parallelism
    work.run(job, 60)  # the keys it touches are loaded on access
    meta = job.checkpoint()  # partly loaded: it references the chunks of what it has not loaded
    assert not job.fully_local
    assert {p for p in meta.referenced_files() if p.startswith("shared/")} == chunks
    assert chunk_files(tmp_path / "ckpt" / "job") == chunks  # nothing uploaded again
    steps = 0
    while not job.fully_local:
        job.poll_materialization()
        steps += 1
    assert steps > 1  # a bounded amount per step, not everything at once
    assert pending_tables(job) == 0
    assert read_state(job) == work.model
    materialize(job)  # the materialization waits for nothing now
    work.run(job, 30)
    job.checkpoint()
    job.close()
    job = job_at(tmp_path, parallelism=2)  # eagerly, from the checkpoint after the hydration
    assert read_state(job) == work.model
    job.close()


def test_a_checkpoint_taken_while_partly_loaded_restores(tmp_path: Path) -> None:
    work = Workload()
    materialized_job(tmp_path, work)
    job = job_at(tmp_path, state_loading="lazy")
    work.run(job, 40)
    job.checkpoint()
    assert not job.fully_local
    job.close()  # a crash while partly loaded: the next run starts from that checkpoint
    for loading in ("lazy", "eager"):
        job = job_at(tmp_path, parallelism=3, state_loading=loading)
        assert read_state(job) == work.model
        job.close()


@pytest.mark.parametrize("fmt", ["canonical", "native"])
def test_a_lazy_no_claim_restore_reads_the_savepoint_until_the_first_checkpoint(tmp_path: Path, fmt: str) -> None:
    work = Workload()
    materialized_job(tmp_path, work, "source")
    source = job_at(tmp_path, "source")
    source.savepoint(str(tmp_path / "sp"), fmt)
    source.close()
    job = job_at(
        tmp_path, "new", restore_from=str(tmp_path / "sp"), restore_mode=RestoreMode.NO_CLAIM, state_loading="lazy"
    )
    assert not job.fully_local
    work.run(job, 40)  # loaded from the savepoint's files
    job.checkpoint()  # the full materialization before it loads everything
    assert job.fully_local
    assert_exact(job, tmp_path / "ckpt" / "new")
    shutil.rmtree(tmp_path / "sp")  # nothing depends on it any more
    assert read_state(job) == work.model
    work.run(job, 20)
    job.checkpoint()
    job.close()
    job = job_at(tmp_path, "new", 3, state_loading="lazy")
    assert read_state(job) == work.model
    job.close()


def test_a_claimed_savepoint_restores_lazily_from_the_copy(tmp_path: Path) -> None:
    work = Workload()
    materialized_job(tmp_path, work, "source")
    source = job_at(tmp_path, "source")
    source.savepoint(str(tmp_path / "sp"), "native")
    source.close()
    job = job_at(
        tmp_path, "new", restore_from=str(tmp_path / "sp"), restore_mode=RestoreMode.CLAIM, state_loading="lazy"
    )
    work.run(job, 40)
    job.checkpoint()  # subsumes the savepoint: it is deleted, the job reads its own copy
    assert not (tmp_path / "sp" / "_metadata").exists()
    job.hydrate()
    assert job.fully_local and read_state(job) == work.model
    job.close()
