"""Checkpoints of a ``LocalJob``: reference counts against the files really on the DFS, retention,
concurrent checkpoints, restart cleanup, and the checks on ``_metadata`` (format, checksum, paths).

The invariant checked after every step: the files under the job directory are exactly the
retained checkpoints' ``_metadata`` plus the files they reference, and the registry counts, per
file, the retained checkpoints naming it (no leak, no premature delete).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from backend.checkpointing.coordinator import CheckpointCoordinator, CheckpointRetention
from backend.checkpointing.metadata import (
    IDS_DIR,
    OWNER_DIR,
    SnapshotMetadata,
    metadata_path,
)
from backend.checkpointing.registry import SharedStateRegistry
from backend.core.errors import CheckpointError
from backend.core.handles import KeyedStateHandle
from backend.job import JobOptions, LocalJob, OperatorSpec
from dstl import ChangelogConfig, StateChangelogStorage
from materializer.options import MaterializationOptions
from tests.backend.checkpointing.workloads import (
    NEVER,
    Workload,
    assert_exact,
    expected_files,
    files_on_dfs,
    materialize,
    read_state,
)


def make_job(tmp_path: Path, job_id: str = "job", parallelism: int = 2, **options: Any) -> LocalJob:
    """A job that materializes only when a test says so; ``options`` are ``JobOptions`` fields."""
    options.setdefault("materialization", MaterializationOptions(interval_ms=NEVER, size_trigger_bytes=None))
    ops = [OperatorSpec("op", parallelism)]
    return LocalJob(tmp_path / "ckpt", job_id, ops, tmp_path / "local", JobOptions(**options))


@pytest.mark.parametrize("num_retained", [1, 2, 3])
def test_reference_counts_match_the_files_on_the_dfs(tmp_path: Path, num_retained: int) -> None:
    work = Workload()
    job = make_job(tmp_path, num_retained=num_retained)
    job_dir = tmp_path / "ckpt" / "job"
    for round_ in range(12):
        work.run(job, 150)
        if round_ % 3 == 1:
            materialize(job)
        if round_ == 7:  # two materializations between checkpoints: the first one's chunks are garbage
            work.run(job, 20)
            materialize(job)
        job.checkpoint()
        assert len(job.coordinator.completed) == min(round_ + 1, num_retained)
        assert_exact(job, job_dir)
    job.close()
    assert files_on_dfs(job_dir) == expected_files(job)
    job = make_job(tmp_path, num_retained=num_retained, parallelism=3)
    assert read_state(job) == work.model
    assert_exact(job, job_dir)
    job.close()


def test_a_later_checkpoint_completing_first_aborts_the_earlier_one(tmp_path: Path) -> None:
    work = Workload()
    job = make_job(tmp_path, num_retained=2)
    job_dir = tmp_path / "ckpt" / "job"
    work.run(job, 200)
    job.checkpoint()
    work.run(job, 100)
    first = job.trigger_checkpoint()
    work.run(job, 100)
    materialize(job)
    second = job.trigger_checkpoint()
    expected = {k: (t, list(s), dict(m)) for k, (t, s, m) in work.model.items()}
    work.run(job, 50)  # after the second checkpoint: not in it
    job.complete_checkpoint(second)
    with pytest.raises(CheckpointError, match="not pending"):
        job.complete_checkpoint(first)
    assert [m.checkpoint_id for m in job.coordinator.completed] == [1, second.checkpoint_id]
    assert_exact(job, job_dir)
    job.close()
    assert files_on_dfs(job_dir) == expected_files(job)
    job = make_job(tmp_path, num_retained=2)
    assert read_state(job) == expected
    assert_exact(job, job_dir)
    job.close()


def test_restart_deletes_orphans_before_the_first_checkpoint(tmp_path: Path) -> None:
    work = Workload()
    job = make_job(tmp_path)
    work.run(job, 300)
    job.checkpoint()
    work.run(job, 100)
    materialize(job)  # chunks no checkpoint names yet
    job.trigger_checkpoint()  # uploaded log, never completed
    job.storage.flush()
    job_dir = tmp_path / "ckpt" / "job"
    job.close()
    for orphan in ("shared/stray.chunk", "dstl/00/stray", "chk-9/_metadata.tmp-1234", "chk-5/other"):
        (job_dir / orphan).parent.mkdir(parents=True, exist_ok=True)
        (job_dir / orphan).write_bytes(b"x")
    assert len(files_on_dfs(job_dir)) > len(expected_files(job))
    job = make_job(tmp_path)
    assert_exact(job, job_dir)
    assert read_state(job) != work.model  # the uncompleted work is gone...
    assert job.coordinator.trigger() == 10  # ...and checkpoint ids are never reused
    job.close()


@pytest.mark.parametrize("retention", list(CheckpointRetention))
def test_externalized_checkpoint_retention_on_cancel(tmp_path: Path, retention: CheckpointRetention) -> None:
    work = Workload()
    job = make_job(tmp_path, num_retained=2, retention=retention)
    for _ in range(3):
        work.run(job, 100)
        job.checkpoint()
    job.cancel()
    job_dir = tmp_path / "ckpt" / "job"
    if retention is CheckpointRetention.DELETE_ON_CANCELLATION:
        assert files_on_dfs(job_dir) == set()
    else:
        job = make_job(tmp_path, num_retained=2, retention=retention)
        assert read_state(job) == work.model
        job.close()


def test_close_is_not_cancel(tmp_path: Path) -> None:
    work = Workload()
    job = make_job(tmp_path, retention=CheckpointRetention.DELETE_ON_CANCELLATION)
    work.run(job, 100)
    job.checkpoint()
    job.close()  # a failover or a stop: the checkpoints stay
    job = make_job(tmp_path, retention=CheckpointRetention.DELETE_ON_CANCELLATION)
    assert read_state(job) == work.model
    job.close()


def test_registry_counts_per_checkpoint() -> None:
    registry = SharedStateRegistry()
    registry.register(1, ["a", "b"])
    registry.register(2, ["b", "c"])
    assert registry.count("b") == 2
    assert registry.unregister(1) == ["a"]
    assert registry.unregister(2) == ["b", "c"]
    assert registry.files() == set()
    with pytest.raises(CheckpointError):
        registry.register(3, ["x"])
        registry.register(3, ["y"])


def _coordinator(tmp_path: Path) -> tuple[StateChangelogStorage, CheckpointCoordinator]:
    storage = StateChangelogStorage(ChangelogConfig.local(tmp_path / "job"))
    coordinator = CheckpointCoordinator(storage.files)
    coordinator.recover()
    return storage, coordinator


def _handle(paths: list[str], uid: str = "op") -> KeyedStateHandle:
    chunks = tuple(
        {"path": p, "key_groups": [0, 127], "scope": [0, 127], "sqn": 0, "size": 1, "entries": 1} for p in paths
    )
    return KeyedStateHandle.from_json(
        {"version": 1, "operator_id": uid, "checkpoint_id": 1, "max_parallelism": 128, "key_group_range": [0, 127],
         "states": {}, "materialized": list(chunks), "changelog": []}
    )  # fmt: skip


def test_a_checkpoint_may_not_reference_deleted_or_missing_files(tmp_path: Path) -> None:
    storage, coordinator = _coordinator(tmp_path)
    try:
        storage.files.put("shared/a.chunk", b"a")
        storage.files.put("shared/b.chunk", b"b")
        for files in (["shared/a.chunk"], ["shared/b.chunk"]):
            cid = coordinator.trigger()
            coordinator.acknowledge(cid, "op", 0, _handle(files))
            coordinator.complete(cid)
        storage.flush()  # subsumption deletes in the background
        assert not (tmp_path / "job" / "shared" / "a.chunk").exists()  # subsumed with checkpoint 1
        cid = coordinator.trigger()
        coordinator.acknowledge(cid, "op", 0, _handle(["shared/a.chunk"]))
        with pytest.raises(CheckpointError, match="deleted with a subsumed checkpoint"):
            coordinator.complete(cid)
        cid = coordinator.trigger()
        coordinator.acknowledge(cid, "op", 0, _handle(["shared/never-uploaded.chunk"]))
        with pytest.raises(CheckpointError, match="does not exist"):
            coordinator.complete(cid)
        assert [m.checkpoint_id for m in coordinator.completed] == [2]
    finally:
        storage.close()


@pytest.mark.parametrize("path", ["../other-job/shared/x.chunk", "/etc/passwd", "s3://bucket/x", "shared/../../x"])
def test_paths_outside_the_job_directory_are_rejected(tmp_path: Path, path: str) -> None:
    storage, coordinator = _coordinator(tmp_path)
    try:
        cid = coordinator.trigger()
        coordinator.acknowledge(cid, "op", 0, _handle([path]))
        with pytest.raises(CheckpointError, match=r"outside|not relative"):
            coordinator.complete(cid)
    finally:
        storage.close()
    # the same path in a hand-edited _metadata on disk is refused when the job restarts
    meta = SnapshotMetadata(1, {"op": {"max_parallelism": 128, "subtasks": [_handle(["shared/x"]).to_json()]}})
    text = meta.dumps().decode().replace('"shared/x"', json.dumps(path))
    body = json.loads(text)
    body.pop("crc32")
    from backend.checkpointing.metadata import _crc

    body["crc32"] = _crc(body)
    chk = tmp_path / "job2" / "chk-1"
    chk.mkdir(parents=True)
    (chk / "_metadata").write_text(json.dumps(body))
    with pytest.raises(CheckpointError, match=r"chk-1/_metadata.*(outside|not relative)"):
        LocalJob(tmp_path, "job2", [OperatorSpec("op", 1)], tmp_path / "local")


def test_corrupt_or_foreign_metadata_is_named(tmp_path: Path) -> None:
    work = Workload()
    job = make_job(tmp_path)
    work.run(job, 50)
    meta = job.checkpoint()
    job.close()
    path = tmp_path / "ckpt" / "job" / metadata_path(meta.checkpoint_id)
    good = path.read_bytes()
    for i in range(0, len(good), max(1, len(good) // 97)):
        bad = bytearray(good)
        bad[i] ^= 0x04
        with pytest.raises(CheckpointError, match="chk-1/_metadata"):
            SnapshotMetadata.loads(bytes(bad), str(path))
    body = json.loads(good)
    body["version"] = 99
    with pytest.raises(CheckpointError, match="version 99"):
        SnapshotMetadata.loads(json.dumps(body).encode(), str(path))
    path.write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match="not a snapshot metadata file"):
        make_job(tmp_path)


def test_checkpoint_files_stay_inside_the_job_directory(tmp_path: Path) -> None:
    work = Workload()
    job = make_job(tmp_path)
    work.run(job, 100)
    materialize(job)
    job.checkpoint()
    job.close()
    top = {p.name for p in (tmp_path / "ckpt").iterdir()}
    assert top == {"job"}
    assert {p.name for p in (tmp_path / "ckpt" / "job").iterdir()} <= {"chk-1", "dstl", "shared", IDS_DIR, OWNER_DIR}
    assert all(not os.path.isabs(p) for p in expected_files(job))
