"""A handle handed out is the coordinator's: closing the storage first must not delete its files.

A checkpoint's log files are confirmed when its subtasks hear that it completed. Between the
``_metadata`` write and that notification the process may shut its log down (its
``StateChangelogStorage`` closed without closing the backends first: a ``with`` block ending, a
runtime dropping its backend objects). The checkpoint is committed, so the restart must restore
it; the storage must keep every file a handle it handed out names, whatever closes first.
"""

from __future__ import annotations

from pathlib import Path

from backend.core.descriptors import ValueStateDescriptor
from backend.core.serializers import Int64Serializer
from backend.job import JobOptions, LocalJob, OperatorSpec
from dstl import ChangelogConfig, KeyGroupRange, StateChangelogStorage
from materializer.options import MaterializationOptions

WAIT_S = 30.0
NEVER = 10**12  # ms: no materialization unless asked
COUNT = ValueStateDescriptor("count", Int64Serializer())
VALUES = {f"user-{i}": i for i in range(20)}
RANGE = KeyGroupRange(0, 7)


def make_job(tmp_path: Path) -> LocalJob:
    options = JobOptions(materialization=MaterializationOptions(interval_ms=NEVER, size_trigger_bytes=None))
    return LocalJob(tmp_path / "ckpt", "job", [OperatorSpec("op", 2)], tmp_path / "local", options)


def write(job: LocalJob, values: dict[str, int]) -> None:
    for key, value in values.items():
        job.backend_for("op", key).get_state(COUNT).update(value)


def read(job: LocalJob, keys: list[str]) -> dict[str, int | None]:
    return {key: job.backend_for("op", key).get_state(COUNT).value() for key in keys}


def test_a_checkpoint_stored_before_the_storage_closes_restores(tmp_path: Path) -> None:
    job = make_job(tmp_path)
    write(job, VALUES)
    pending = job.trigger_checkpoint()
    for subtask, future in pending.futures:
        job.coordinator.acknowledge(pending.checkpoint_id, subtask.uid, subtask.index, future.result(WAIT_S))
    meta = job.coordinator.complete(pending.checkpoint_id)  # committed; no subtask notified yet
    assert all(h.changelog for h in meta.handles("op"))  # the state is in the log only
    job.storage.close()  # the log shuts down before the backends hear of the checkpoint
    job.close()
    restarted = make_job(tmp_path)
    try:
        assert restarted.restored_from is not None
        assert restarted.restored_from.checkpoint_id == meta.checkpoint_id
        assert read(restarted, list(VALUES)) == VALUES
    finally:
        restarted.close()


def test_closing_the_storage_keeps_the_files_of_handles_handed_out(tmp_path: Path) -> None:
    """At the log's own level: a held handle (neither confirmed nor released) survives the close
    and reads back; a released one's file goes."""
    storage = StateChangelogStorage(ChangelogConfig.local(tmp_path / "dfs", persist_delay_ms=0))
    writer = storage.create_writer("op", RANGE)
    writer.append(1, b"held")
    held = writer.persist_durably(0).result(WAIT_S)
    writer.append(1, b"released")
    released = writer.persist_durably(held.upto).result(WAIT_S)
    assert not held.files & released.files
    writer.release(released)
    storage.close()
    dfs = {p.relative_to(tmp_path / "dfs").as_posix() for p in (tmp_path / "dfs").rglob("*") if p.is_file()}
    assert dfs == set(held.files)
    with StateChangelogStorage(ChangelogConfig.local(tmp_path / "dfs")) as reader:
        assert list(reader.read(held)) == [(1, b"held")]
