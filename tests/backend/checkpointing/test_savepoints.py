"""Savepoints: canonical and native, moved directories, other parallelism, restore modes, uids."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from backend.checkpointing.savepoints import RestoreMode
from backend.core.descriptors import ValueStateDescriptor
from backend.core.errors import CheckpointError
from backend.core.serializers import Float64Serializer, Int64Serializer, OptionalSerializer, RowSerializer
from backend.job import JobOptions, LocalJob, OperatorSpec
from materializer.options import MaterializationOptions
from tests.backend.checkpointing.workloads import Workload, assert_exact, files_on_dfs, materialize, read_state

NEVER = 10**12  # ms: an interval no test reaches


def job_at(
    tmp_path: Path, job_id: str, parallelism: int = 2, uids: tuple[str, ...] = ("op",), **kw: object
) -> LocalJob:
    ops = [OperatorSpec(uid, parallelism) for uid in uids]
    materialization = MaterializationOptions(interval_ms=NEVER, size_trigger_bytes=None)
    options = JobOptions(materialization=materialization, **kw)  # type: ignore[arg-type]
    return LocalJob(tmp_path / "ckpt", job_id, ops, tmp_path / "local", options)


def source_job(tmp_path: Path, work: Workload, uids: tuple[str, ...] = ("op",)) -> LocalJob:
    job = job_at(tmp_path, "source", uids=uids)
    for uid in uids:
        work.run(job, 300, uid)
    job.checkpoint()
    materialize(job)
    for uid in uids:
        work.run(job, 100, uid)
    job.checkpoint()
    return job


@pytest.mark.parametrize("fmt", ["canonical", "native"])
@pytest.mark.parametrize("parallelism", [1, 3, 5])
def test_savepoint_moved_and_restored_at_another_parallelism(tmp_path: Path, fmt: str, parallelism: int) -> None:
    work = Workload()
    job = source_job(tmp_path, work)
    job.savepoint(str(tmp_path / "sp"), fmt)
    job.cancel()
    shutil.rmtree(tmp_path / "ckpt")  # the savepoint is self-contained
    shutil.move(tmp_path / "sp", tmp_path / "moved")
    job = job_at(tmp_path, "restored", parallelism, restore_from=str(tmp_path / "moved"))
    assert read_state(job) == work.model
    work.run(job, 50)
    job.checkpoint()
    job.close()
    job = job_at(tmp_path, "restored", 2)
    assert read_state(job) == work.model
    job.close()


@pytest.mark.parametrize("fmt", ["canonical", "native"])
def test_no_claim_first_checkpoint_does_not_depend_on_the_savepoint(tmp_path: Path, fmt: str) -> None:
    work = Workload()
    job = source_job(tmp_path, work)
    job.savepoint(str(tmp_path / "sp"), fmt)
    job.close()
    job = job_at(tmp_path, "new", restore_from=str(tmp_path / "sp"), restore_mode=RestoreMode.NO_CLAIM)
    work.run(job, 40)
    job.checkpoint()
    assert_exact(job, tmp_path / "ckpt" / "new")
    job.close()
    assert (tmp_path / "sp" / "_metadata").exists()  # never touched
    shutil.rmtree(tmp_path / "sp")
    job = job_at(tmp_path, "new", 3)
    assert read_state(job) == work.model
    job.close()


@pytest.mark.parametrize("fmt", ["canonical", "native"])
def test_claim_deletes_the_savepoint_when_subsumed(tmp_path: Path, fmt: str) -> None:
    work = Workload()
    job = source_job(tmp_path, work)
    job.savepoint(str(tmp_path / "sp"), fmt)
    job.close()
    job = job_at(tmp_path, "new", restore_from=str(tmp_path / "sp"), restore_mode=RestoreMode.CLAIM)
    assert (tmp_path / "sp" / "_metadata").exists()  # still there until a checkpoint replaces it
    work.run(job, 40)
    job.checkpoint()
    assert files_on_dfs(tmp_path / "sp") == set()
    assert_exact(job, tmp_path / "ckpt" / "new")
    job.close()
    job = job_at(tmp_path, "new")
    assert read_state(job) == work.model
    job.close()


def test_claim_of_another_jobs_retained_checkpoint(tmp_path: Path) -> None:
    work = Workload()
    job = source_job(tmp_path, work)
    chk = job.coordinator.latest()
    assert chk is not None
    job.close()
    src = tmp_path / "ckpt" / "source" / f"chk-{chk.checkpoint_id}"
    job = job_at(tmp_path, "new", restore_from=str(src), restore_mode=RestoreMode.CLAIM)
    assert read_state(job) == work.model
    job.checkpoint()
    assert not (src / "_metadata").exists()
    job.close()


def test_legacy_keeps_the_savepoint(tmp_path: Path) -> None:
    work = Workload()
    job = source_job(tmp_path, work)
    job.savepoint(str(tmp_path / "sp"), "native")
    job.close()
    before = files_on_dfs(tmp_path / "sp")
    job = job_at(tmp_path, "new", restore_from=str(tmp_path / "sp"), restore_mode=RestoreMode.LEGACY)
    work.run(job, 40)
    job.checkpoint()
    job.checkpoint()
    job.close()
    assert files_on_dfs(tmp_path / "sp") == before
    shutil.rmtree(tmp_path / "sp")
    job = job_at(tmp_path, "new")
    assert read_state(job) == work.model
    job.close()


def test_state_of_a_removed_operator_needs_allow_non_restored_state(tmp_path: Path) -> None:
    work, gone = Workload(1), Workload(2)
    job = job_at(tmp_path, "source", uids=("op", "old"))
    work.run(job, 200, "op")
    gone.run(job, 200, "old")
    job.savepoint(str(tmp_path / "sp"), "canonical")
    job.close()
    with pytest.raises(CheckpointError, match=r"operators \['old'\].*allow_non_restored_state"):
        job_at(tmp_path, "new", uids=("op", "added"), restore_from=str(tmp_path / "sp"))
    job = job_at(
        tmp_path, "new", uids=("op", "added"), restore_from=str(tmp_path / "sp"), allow_non_restored_state=True
    )
    assert read_state(job, "op") == work.model
    assert read_state(job, "added") == {}  # a new operator starts empty
    job.close()


def test_bad_savepoint_targets_and_sources(tmp_path: Path) -> None:
    work = Workload()
    job = source_job(tmp_path, work)
    job.savepoint(str(tmp_path / "sp"), "canonical")
    with pytest.raises(CheckpointError, match="not empty"):
        job.savepoint(str(tmp_path / "sp"), "native")
    with pytest.raises(CheckpointError, match="inside the job directory"):
        job.savepoint(str(tmp_path / "ckpt" / "source" / "sp"))
    with pytest.raises(ValueError, match="format"):
        job.savepoint(str(tmp_path / "sp2"), "parquet")
    job.close()
    with pytest.raises(CheckpointError, match="no _metadata"):
        job_at(tmp_path, "new", restore_from=str(tmp_path / "nothing-here"))
    (tmp_path / "sp" / "_metadata").write_bytes(b"{}")
    with pytest.raises(CheckpointError, match="not a snapshot metadata file"):
        job_at(tmp_path, "new2", restore_from=str(tmp_path / "sp"))


def test_a_canonical_savepoint_keeps_every_schema_version_when_subtasks_registered_differently(
    tmp_path: Path,
) -> None:
    """After a restart under a changed schema, a subtask whose code never ran yet has not
    registered the change: its metadata knows one version, another subtask's two. The savepoint
    holds both (the union), so every key reads back under the new schema."""
    old = ValueStateDescriptor("acc", RowSerializer([("total", OptionalSerializer(Int64Serializer()))]))
    new = ValueStateDescriptor(
        "acc",
        RowSerializer(
            [("total", OptionalSerializer(Float64Serializer())), ("n", OptionalSerializer(Int64Serializer()))]
        ),
    )
    keys = [f"k{i}" for i in range(40)]
    job = job_at(tmp_path, "source")
    for i, key in enumerate(keys):
        job.backend_for("op", key).get_state(old).update((i,))
    job.checkpoint()
    job.close()
    job = job_at(tmp_path, "source")
    changed = job.subtasks["op"][0].backend
    state = changed.get_state(new)  # only the first subtask registers the new schema, and writes in it
    expected = [(float(i), None) for i in range(40)]
    for i, key in enumerate(keys):
        if changed.key_group_of(key) in changed.key_group_range:
            changed.set_current_key(key)
            state.update((i + 0.5, 1))
            expected[i] = (i + 0.5, 1)
    job.savepoint(str(tmp_path / "sp"), "canonical")
    job.cancel()
    job = job_at(tmp_path, "restored", 3, restore_from=str(tmp_path / "sp"))
    assert [job.backend_for("op", key).get_state(new).value() for key in keys] == expected
    job.close()
