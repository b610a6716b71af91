"""``dstl state read`` of a checkpoint whose states changed schema and were not folded yet: every
value shows in the state's current schema, converted, one row per key (a map: per user key), the
same as the state API reads (``backend.state.versions``).

The job writes under schema A, is checkpointed and materialized, restarts under schema B, changes
the keys of one subtask only (so its handle has the new version over the old one, the other's
the old version alone), and checkpoints without materializing again: the old values are in the
old version's table, the changed ones in the new one's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from backend import ListStateDescriptor, MapStateDescriptor, StateTtl, StrSerializer, ValueStateDescriptor
from backend.core.serializers import Float64Serializer, Int64Serializer, OptionalSerializer, RowSerializer
from backend.job import JobOptions, LocalJob, OperatorSpec
from backend.tools.cli import main
from materializer.options import MaterializationOptions

MANUAL = MaterializationOptions(interval_ms=10**12, size_trigger_bytes=None)
UID = "op"
KEYS = [f"k{i}" for i in range(12)]
TTL = StateTtl(10**12)  # never expires in a test
OLD = RowSerializer([("gone", OptionalSerializer(StrSerializer())), ("total", OptionalSerializer(Int64Serializer()))])
NEW = RowSerializer([("total", OptionalSerializer(Float64Serializer())), ("n", OptionalSerializer(Int64Serializer()))])


def states(schema: RowSerializer) -> dict[str, Any]:
    return {
        "value": ValueStateDescriptor("value", schema, ttl=TTL),
        "list": ListStateDescriptor("list", schema),
        "map": MapStateDescriptor("map", schema, user_key_serializer=StrSerializer()),
    }


def in_new(total: int) -> list[Any]:
    """An old row ("x", total) read in the new schema, as JSON."""
    return [float(total), None]


@pytest.fixture(scope="module")
def changed_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict[Any, Any]]]:
    """The checkpoint after the change, and what each state holds per key (the JSON of its rows)."""
    root = tmp_path_factory.mktemp("versions")
    options = JobOptions(materialization=MANUAL)
    ops = [OperatorSpec(UID, 2)]
    expected: dict[str, dict[Any, Any]] = {"value": {}, "list": {}, "map": {}}
    job = LocalJob(root / "ckpt", "job", ops, root / "local-1", options)
    try:
        old = states(OLD)
        for i, key in enumerate(KEYS):
            b = job.backend_for(UID, key)
            b.get_state(old["value"]).update(("x", i))
            b.get_state(old["list"]).update([("x", i), ("y", -i)])
            b.get_state(old["map"]).put_all({"a": ("x", i), "b": ("y", 2 * i)})
            expected["value"][key] = in_new(i)
            expected["list"][key] = [in_new(i), in_new(-i)]
            expected["map"][key] = {"a": in_new(i), "b": in_new(2 * i)}
        job.checkpoint()
        for subtask in job.all_subtasks():
            subtask.materializer.trigger()
            subtask.materializer.wait()
        job.checkpoint()
    finally:
        job.close()
    job = LocalJob(root / "ckpt", "job", ops, root / "local-2", options)
    try:
        new = states(NEW)
        first = job.all_subtasks().__next__().backend
        for i, key in enumerate(KEYS):
            b = job.backend_for(UID, key)
            if b is not first:
                continue  # the other subtask never registers the new schema
            if i % 2:
                b.get_state(new["value"]).update((0.5, i))
                expected["value"][key] = [0.5, i]
                b.get_state(new["list"]).add((1.5, i))
                expected["list"][key].append([1.5, i])
                b.get_state(new["map"]).remove("a")
                del expected["map"][key]["a"]
            else:
                b.get_state(new["value"]).clear()
                del expected["value"][key]
                b.get_state(new["map"]).put("c", (2.5, None))
                expected["map"][key]["c"] = [2.5, None]
        meta = job.checkpoint()
        assert any(key for key in KEYS if job.backend_for(UID, key) is not first), "both subtasks own keys"
    finally:
        job.close()
    return root / "ckpt" / "job" / f"chk-{meta.checkpoint_id}", expected


def rows_of(path: Path, capsys: pytest.CaptureFixture[str], *argv: str) -> list[dict[str, Any]]:
    capsys.readouterr()
    assert main(["state", "read", str(path), "--operator", UID, *argv]) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return [json.loads(line) for line in out.splitlines()]


def test_every_value_shows_in_the_current_schema_once(
    changed_checkpoint: tuple[Path, dict[str, dict[Any, Any]]], capsys: pytest.CaptureFixture[str]
) -> None:
    path, expected = changed_checkpoint
    rows = rows_of(path, capsys)
    seen: dict[str, dict[Any, Any]] = {"value": {}, "list": {}, "map": {}}
    for row in rows:
        if row["state"] == "_timers":
            continue
        name, key = row["state"], row["key"]
        if name == "map":
            assert row["user_key"] not in seen["map"].setdefault(key, {}), row
            seen["map"][key][row["user_key"]] = row["value"]
        else:
            assert key not in seen[name], row  # one row per key
            seen[name][key] = row["value"]
        if name == "value":
            assert isinstance(row["ttl_expiry_ms"], int), row
    assert seen == expected


def test_one_state_of_a_changed_schema(
    changed_checkpoint: tuple[Path, dict[str, dict[Any, Any]]], capsys: pytest.CaptureFixture[str]
) -> None:
    path, expected = changed_checkpoint
    rows = rows_of(path, capsys, "--state", "list")
    assert {r["state"] for r in rows} == {"list"}
    assert {r["key"]: r["value"] for r in rows} == expected["list"]
    assert len(rows) == len(expected["list"])
