"""Snapshots written before the layered layout (commit e01875d) restore with today's code.

The fixture (tests/fixtures/e01875d, made as its README says) holds a completed checkpoint with a
materialization and log after it, a native and a canonical savepoint of the same state, and
expected.json: the state per key, the timers, and what ``dstl state read`` printed for them then.
Each test works on a copy, since starting a job on a directory may delete files no checkpoint
references.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from backend import (
    Int64Serializer,
    JsonSerializer,
    ListStateDescriptor,
    MapStateDescriptor,
    StateTtl,
    StrSerializer,
    ValueStateDescriptor,
)
from backend.checkpointing.savepoints import StateLoading
from backend.job import JobOptions, LocalJob, OperatorSpec
from backend.tools.cli import main

FIXTURE = Path(__file__).parent / "fixtures" / "e01875d"
EXPECTED: dict[str, Any] = json.loads((FIXTURE / "expected.json").read_text())
UID: str = EXPECTED["operator"]["uid"]
MAX_PARALLELISM: int = EXPECTED["operator"]["max_parallelism"]
KEYS = sorted({row["key"] for row in EXPECTED["rows"]})
COUNT = ValueStateDescriptor("count", Int64Serializer())
EVENTS = ListStateDescriptor("events", StrSerializer())
ATTRS = MapStateDescriptor("attrs", JsonSerializer(), user_key_serializer=StrSerializer())
SESSION = ValueStateDescriptor("session", StrSerializer(), ttl=StateTtl(EXPECTED["ttl_ms"]))
FAR_FUTURE_MS = 1 << 62


@pytest.fixture
def fixture(tmp_path: Path) -> Path:
    return Path(shutil.copytree(FIXTURE, tmp_path / "fixture"))


def operators(parallelism: int) -> list[OperatorSpec]:
    return [OperatorSpec(UID, parallelism, MAX_PARALLELISM)]


def read_rows(path: Path, capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    capsys.readouterr()
    assert main(["state", "read", str(path), "--operator", UID]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    return sorted(rows, key=lambda row: json.dumps(row, sort_keys=True))


def assert_state(job: LocalJob) -> None:
    """Every key's value, list and map state and TTL'd value through the state API."""
    state = EXPECTED["state"]
    for key in KEYS:
        backend = job.backend_for(UID, key)
        assert backend.get_state(COUNT).value() == state["count"].get(key), key
        assert backend.get_state(EVENTS).get() == state["events"].get(key, []), key
        assert dict(backend.get_state(ATTRS).items()) == state["attrs"].get(key, {}), key
        assert backend.get_state(SESSION).value() == state["session"].get(key), key


def assert_timers(job: LocalJob) -> None:
    """The timers fire as registered (firing removes them: do this last)."""
    fired: dict[str, list[list[Any]]] = {"event_time": [], "processing_time": []}
    for subtask in job.all_subtasks():
        subtask.backend.advance_watermark(FAR_FUTURE_MS, lambda key, ts: fired["event_time"].append([key, ts]))
        subtask.backend.advance_processing_time(
            FAR_FUTURE_MS, lambda key, ts: fired["processing_time"].append([key, ts])
        )
    assert {domain: sorted(timers) for domain, timers in fired.items()} == EXPECTED["timers"]


@pytest.mark.parametrize("name", sorted(EXPECTED["snapshots"]))
def test_state_read_prints_the_rows_it_printed_then(
    name: str, fixture: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = fixture / EXPECTED["snapshots"][name]
    assert read_rows(path, capsys) == EXPECTED["rows"]
    assert main(["checkpoints", "verify", str(path)]) == 0


@pytest.mark.parametrize("loading", ["lazy", "eager"])
def test_the_job_resumes_its_checkpoint(
    loading: StateLoading, fixture: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = fixture / EXPECTED["snapshots"]["checkpoint"]
    root, job_id = checkpoint.parent.parent, checkpoint.parent.name
    options = JobOptions(state_loading=loading)
    job = LocalJob(root, job_id, operators(EXPECTED["operator"]["parallelism"]), tmp_path / "local", options)
    try:
        assert job.restored_from is not None
        assert f"chk-{job.restored_from.checkpoint_id}" == checkpoint.name
        # a lazy restore of the old chunks (format version 1) loads nothing before the first access
        assert all(s.backend.fully_local for s in job.all_subtasks()) == (loading == "eager")
        assert_state(job)
        meta = job.checkpoint()  # today's code writes on top of the old files
    finally:
        job.close()
    assert read_rows(checkpoint.parent / f"chk-{meta.checkpoint_id}", capsys) == EXPECTED["rows"]
    job = LocalJob(root, job_id, operators(EXPECTED["operator"]["parallelism"]), tmp_path / "local")
    try:
        assert_state(job)
        assert_timers(job)
    finally:
        job.close()


@pytest.mark.parametrize(
    ("name", "parallelism"),
    [("native_savepoint", 2), ("native_savepoint", 3), ("canonical_savepoint", 1), ("canonical_savepoint", 3)],
)
def test_a_new_job_restores_the_savepoint(name: str, parallelism: int, fixture: Path, tmp_path: Path) -> None:
    savepoint = fixture / EXPECTED["snapshots"][name]
    options = JobOptions(restore_from=str(savepoint))  # lazily, the default
    job = LocalJob(tmp_path / "jobs", "restored", operators(parallelism), tmp_path / "local", options)
    try:
        assert job.restored_from is not None
        assert_state(job)
        assert_timers(job)
    finally:
        job.close()


def test_the_fixture_is_small() -> None:
    files: Iterator[Path] = (p for p in FIXTURE.rglob("*") if p.is_file())
    assert sum(p.stat().st_size for p in files) < 64 * 1024
