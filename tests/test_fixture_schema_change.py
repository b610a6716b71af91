"""A checkpoint written before state schema changes were supported (commit 12e5607) restores under an
evolved schema with today's code: a field added (null), a field removed, fields reordered, int
widened to float, a NOT NULL field made nullable, for value, list (with TTL) and map state, at the
parallelism it was written with and rescaled; a refused change names the state, the field and both
types and leaves the checkpoint as it was.

The fixture (tests/fixtures/12e5607, written by ``tests/support/write_schema_fixture.py`` as its
docstring says) holds a materialization and a log after it; its ``expected.json`` has the values
in the old schema. Every path in it is relative, so each test restores a copy in another place.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from backend import ListStateDescriptor, MapStateDescriptor, StateTtl, StrSerializer, ValueStateDescriptor
from backend.core.errors import SchemaEvolutionError
from backend.core.serializers import Float64Serializer, Int64Serializer, OptionalSerializer, RowSerializer
from backend.job import JobOptions, LocalJob, OperatorSpec
from backend.tools.cli import main
from materializer.options import MaterializationOptions
from tests.support import write_schema_fixture as written

FIXTURE = Path(__file__).parent / "fixtures" / "12e5607"
EXPECTED: dict[str, Any] = json.loads((FIXTURE / "expected.json").read_text())
UID, MAX_P = EXPECTED["operator"]["uid"], EXPECTED["operator"]["max_parallelism"]
MANUAL = JobOptions(materialization=MaterializationOptions(interval_ms=10**12, size_trigger_bytes=None))
OPT_F64, OPT_I64, OPT_STR = (OptionalSerializer(s) for s in (Float64Serializer(), Int64Serializer(), StrSerializer()))
TTL = StateTtl(EXPECTED["ttl_ms"])

#: reordered, ``total`` widened to float, ``gone`` removed, ``added`` added
ACC = ValueStateDescriptor("acc", RowSerializer([("label", OPT_STR), ("total", OPT_F64), ("added", OPT_I64)]))
#: ``n`` NOT NULL int -> nullable float, ``extra`` added
EVENTS = ListStateDescriptor("events", RowSerializer([("n", OPT_F64), ("kind", OPT_STR), ("extra", OPT_I64)]), ttl=TTL)
#: ``v`` widened, ``note`` added
ATTRS = MapStateDescriptor(
    "attrs", RowSerializer([("v", OPT_F64), ("note", OPT_STR)]), user_key_serializer=StrSerializer()
)


def _float(value: int | None) -> float | None:
    return None if value is None else float(value)


def expected_state() -> dict[str, dict[str, Any]]:
    """``expected.json``'s old rows as the evolved schemas read them."""
    old = EXPECTED["state"]
    return {
        "acc": {k: (label, _float(total), None) for k, (total, label, _) in old["acc"].items()},
        "events": {k: [(_float(n), kind, None) for kind, n in rows] for k, rows in old["events"].items()},
        "attrs": {k: {u: (_float(v), None) for u, (v,) in m.items()} for k, m in old["attrs"].items()},
    }


def keys() -> list[str]:
    old = EXPECTED["state"]
    return sorted(set(old["acc"]) | set(old["events"]) | set(old["attrs"]))


def assert_reads(job: LocalJob, expected: dict[str, dict[str, Any]]) -> None:
    for key in keys():
        b = job.backend_for(UID, key)
        assert b.get_state(ACC).value() == expected["acc"].get(key), key
        assert b.get_state(EVENTS).get() == expected["events"].get(key, []), key
        assert dict(b.get_state(ATTRS).items()) == expected["attrs"].get(key, {}), key


@pytest.fixture
def fixture(tmp_path: Path) -> Path:
    """A copy in another place (restoring it may write and delete files)."""
    return Path(shutil.copytree(FIXTURE, tmp_path / "moved" / "fixture"))


def operators(parallelism: int) -> list[OperatorSpec]:
    return [OperatorSpec(UID, parallelism, MAX_P)]


def metadata_paths(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "path" and isinstance(value, str):
                yield value
            yield from metadata_paths(value)
    elif isinstance(node, list):
        for value in node:
            yield from metadata_paths(value)


def test_the_fixture_is_an_old_writers_small_relative_checkpoint() -> None:
    assert EXPECTED["written_by"].startswith("12e5607"), EXPECTED["written_by"]
    body = json.loads((FIXTURE / EXPECTED["checkpoint"] / "_metadata").read_text())
    handles = body["operators"][UID]["subtasks"]
    assert all(h["materialized"] and h["changelog"] for h in handles)
    for handle in handles:  # before schema versions: the metadata of a state is its schema alone
        for meta in handle["states"].values():
            assert set(meta) - {"user_key_serializer"} == {"kind", "serializer", "ttl_ms"}, meta
    paths = list(metadata_paths(body))
    assert paths and not any(p.startswith("/") or ":" in p or ".." in p.split("/") for p in paths)
    assert sum(p.stat().st_size for p in FIXTURE.rglob("*") if p.is_file()) < 32 * 1024
    old = {"acc": written.ACC, "events": written.EVENTS, "attrs": written.ATTRS}
    assert EXPECTED["fields"] == {name: list(d.serializer.names) for name, d in old.items()}


def test_the_job_resumes_under_an_evolved_schema_and_folds_it(fixture: Path, tmp_path: Path) -> None:
    expected = expected_state()
    root = fixture / "checkpoints"
    job = LocalJob(root, EXPECTED["job"], operators(EXPECTED["operator"]["parallelism"]), tmp_path / "l1", MANUAL)
    try:
        assert job.restored_from is not None
        assert_reads(job, expected)
        for key in keys()[::4]:  # writes in the new schema next to old values
            b = job.backend_for(UID, key)
            b.get_state(ACC).update(("new", 0.5, 1))
            expected["acc"][key] = ("new", 0.5, 1)
            b.get_state(EVENTS).add((None, "new", 2))
            expected["events"][key] = [*expected["events"].get(key, []), (None, "new", 2)]
        job.checkpoint()
        for subtask in job.all_subtasks():  # the first materialization after the change folds it
            subtask.materializer.trigger()
            subtask.materializer.wait()
        meta = job.checkpoint()
    finally:
        job.close()
    for handle in meta.handles(UID):
        assert all("older" not in m and m.get("version") == 1 for m in handle.states.values()), handle.states
    job = LocalJob(root, EXPECTED["job"], operators(2), tmp_path / "l2", MANUAL)
    try:
        assert_reads(job, expected)
    finally:
        job.close()


@pytest.mark.parametrize("parallelism", [1, 3])
def test_a_new_job_restores_it_rescaled_under_an_evolved_schema(
    fixture: Path, tmp_path: Path, parallelism: int, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = fixture / EXPECTED["checkpoint"]
    options = JobOptions(restore_from=str(checkpoint), materialization=MANUAL.materialization)
    job = LocalJob(tmp_path / "jobs", "rescaled", operators(parallelism), tmp_path / "local", options)
    try:
        assert_reads(job, expected_state())
    finally:
        job.close()
    # `dstl state read` of the old checkpoint shows it as written (its current schema is the old one)
    capsys.readouterr()
    assert main(["state", "read", str(checkpoint), "--operator", UID, "--state", "acc"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {r["key"]: r["value"] for r in rows} == EXPECTED["state"]["acc"]


def test_a_refused_change_names_the_state_field_and_types(fixture: Path, tmp_path: Path) -> None:
    checkpoint = fixture / EXPECTED["checkpoint"]
    before = {p: p.read_bytes() for p in checkpoint.parent.rglob("*") if p.is_file() and "_owner" not in p.parts}
    narrowed = ValueStateDescriptor("acc", RowSerializer([("total", OPT_STR), ("label", OPT_STR)]))
    root = fixture / "checkpoints"
    job = LocalJob(root, EXPECTED["job"], operators(2), tmp_path / "l1", MANUAL)
    try:
        with pytest.raises(SchemaEvolutionError) as refused:
            job.backend_for(UID, keys()[0]).get_state(narrowed)
    finally:
        job.close()
    error = refused.value
    assert (error.state, error.field, error.old, error.new) == ("acc", "total", "int64/1", "str/1")
    assert "'acc'" in str(error) and "'total'" in str(error) and "int64/1" in str(error) and "str/1" in str(error)
    after = {p: p.read_bytes() for p in checkpoint.parent.rglob("*") if p.is_file() and "_owner" not in p.parts}
    assert {p: b for p, b in after.items() if p in before} == before  # nothing of the checkpoint changed
    job = LocalJob(root, EXPECTED["job"], operators(2), tmp_path / "l2", MANUAL)
    try:  # the old schema still restores: its values as written
        for key in keys():
            value = job.backend_for(UID, key).get_state(written.ACC).value()
            assert (None if value is None else list(value)) == EXPECTED["state"]["acc"].get(key), key
    finally:
        job.close()


def test_the_writer_still_runs_and_writes_the_same_state(tmp_path: Path) -> None:
    """The script that wrote the fixture runs on today's code too (so it can be rerun on the old one)."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    done = subprocess.run(
        [sys.executable, written.__file__, str(out), str(tmp_path / "scratch")],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    again = json.loads((out / "expected.json").read_text())
    assert {k: v for k, v in again.items() if k != "written_by"} == {
        k: v for k, v in EXPECTED.items() if k != "written_by"
    }
    assert (out / again["checkpoint"] / "_metadata").is_file()
