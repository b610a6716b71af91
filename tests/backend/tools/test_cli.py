"""The ``dstl`` command line on real checkpoints and savepoints of a ``LocalJob``.

One job is built per module (value, list, map, TTL and pickle states, timers; a checkpoint of logs
only, a materialization, a checkpoint of chunks plus logs); tests that damage files work on a copy.
Commands run in-process through ``main([...])``; one test runs the installed ``dstl`` script.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass
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
from backend.checkpointing.metadata import SnapshotMetadata
from backend.core.serializers import PickleSerializer
from backend.job import JobOptions, LocalJob, OperatorSpec
from backend.tools.cli import main
from backend.tools.state_rows import jsonable
from materializer.options import MaterializationOptions

NEVER = 10**12  # ms: an interval no test reaches
MANUAL = MaterializationOptions(interval_ms=NEVER, size_trigger_bytes=None)  # only when a test says so
TOTAL = ValueStateDescriptor("total", Int64Serializer())
EVENTS = ListStateDescriptor("events", StrSerializer())
BY_DAY = MapStateDescriptor("by_day", Int64Serializer(), user_key_serializer=StrSerializer())
SEEN = ValueStateDescriptor("seen", StrSerializer(), ttl=StateTtl(7 * 86_400_000))
RECENT = ListStateDescriptor("recent", Int64Serializer(), ttl=StateTtl(7 * 86_400_000))
DOC = ValueStateDescriptor("doc", JsonSerializer())
BLOB = ValueStateDescriptor("blob", PickleSerializer())
COUNTS_KEYS = [f"u{i}" for i in range(10)]
OTHER_KEYS = [0, 1, 2, 3]

Model = dict[str, dict[Any, Any]]
STATES = ("total", "events", "by_day", "seen", "recent", "_timers", "doc", "blob")


def apply(job: LocalJob, model: Model, start: int, stop: int) -> None:
    """Events ``start..stop-1``: every state of ``counts`` for key u<i%10>; ``other`` every 2nd."""
    for i in range(start, stop):
        key = COUNTS_KEYS[i % 10]
        b = job.backend_for("counts", key)
        total = b.get_state(TOTAL)
        total.update((total.value() or 0) + i)
        b.get_state(EVENTS).add(f"e{i}")
        by_day = b.get_state(BY_DAY)
        day = f"d{i % 3}"
        by_day.put(day, (by_day.get(day) or 0) + 1)
        b.get_state(SEEN).update(f"s{i}")
        if i % 5 == 0:
            b.get_state(RECENT).add(i)
            model["recent"].setdefault(key, []).append(i)
        if i % 7 == 0:
            b.register_event_time_timer(1000 + i)
            model["_timers"].setdefault(key, []).append(1000 + i)
        model["total"][key] = model["total"].get(key, 0) + i
        model["events"].setdefault(key, []).append(f"e{i}")
        model["by_day"].setdefault(key, {})[day] = model["by_day"].get(key, {}).get(day, 0) + 1
        model["seen"][key] = f"s{i}"
        if i % 2 == 0:
            other = OTHER_KEYS[(i // 2) % 4]
            o = job.backend_for("other", other)
            o.get_state(DOC).update({"n": i, "tags": ["a", str(i)]})
            o.get_state(BLOB).update({"x": i})
            model["doc"][other] = {"n": i, "tags": ["a", str(i)]}
            model["blob"][other] = {"x": i}


def read_job(job: LocalJob) -> Model:
    """The state of a running job, through the state API, in the shape of the model."""
    out: Model = {name: {} for name in STATES}
    for key in COUNTS_KEYS:
        b = job.backend_for("counts", key)
        values: list[tuple[str, Any]] = [
            ("total", b.get_state(TOTAL).value()),
            ("events", b.get_state(EVENTS).get() or None),
            ("by_day", dict(b.get_state(BY_DAY).items()) or None),
            ("seen", b.get_state(SEEN).value()),
            ("recent", b.get_state(RECENT).get() or None),
            ("_timers", sorted(ts for _, ts in b.timers.list()) or None),
        ]
        for name, value in values:
            if value is not None:
                out[name][key] = value
    for other in OTHER_KEYS:
        o = job.backend_for("other", other)
        for name, found in (("doc", o.get_state(DOC).value()), ("blob", o.get_state(BLOB).value())):
            if found is not None:
                out[name][other] = found
    return out


def model_of_rows(rows: list[dict[str, Any]]) -> Model:
    """``dstl state read`` rows in the shape of the model (pickle hex unpickled: our own test data)."""
    out: Model = {name: {} for name in STATES}
    for row in rows:
        name, key, value = row["state"], row["key"], row["value"]
        if name == "by_day":
            out[name].setdefault(key, {})[row["user_key"]] = value
        elif name == "_timers":
            assert row["user_key"] == "event_time"
            out[name].setdefault(key, []).append(value)
        elif name == "blob":
            out[name][key] = pickle.loads(bytes.fromhex(value["$raw"]))
        elif name == "recent":  # a list with TTL: each element with its own expiry
            assert all(isinstance(e["ttl_expiry_ms"], int) and e["ttl_expiry_ms"] > 0 for e in value)
            out[name][key] = [e["value"] for e in value]
        else:
            out[name][key] = value
    for timers in out["_timers"].values():
        timers.sort()
    return out


@dataclass
class Built:
    root: Path
    job_dir: Path
    model: Model


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    root = tmp_path_factory.mktemp("cli")
    ops = [OperatorSpec("counts", 2), OperatorSpec("other", 1)]
    options = JobOptions(num_retained=2, materialization=MANUAL)
    job = LocalJob(root / "ckpt", "job1", ops, root / "local", options)
    model: Model = {name: {} for name in STATES}
    try:
        apply(job, model, 0, 40)
        job.checkpoint({"phase": 1})  # chk-1: log files only
        for st in job.all_subtasks():
            st.materializer.trigger()
            st.materializer.wait()
        apply(job, model, 40, 60)
        job.checkpoint({"phase": 2})  # chk-2: chunks and log files
        assert read_job(job) == model
    finally:
        job.close()
    return Built(root, root / "ckpt" / "job1", model)


@pytest.fixture
def job_dir(built: Built, tmp_path: Path) -> Path:
    """A private copy of the job directory (paths in _metadata are relative: it moves)."""
    copy = tmp_path / "ckpt" / "job1"
    shutil.copytree(built.job_dir, copy)
    return copy


Run = Callable[..., tuple[int, str, str]]


@pytest.fixture
def run(capsys: pytest.CaptureFixture[str]) -> Run:
    def run(*argv: str | Path) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main([str(a) for a in argv])
        out, err = capsys.readouterr()
        assert "Traceback" not in err
        return code, out, err

    return run


def metadata_of(chk: Path) -> SnapshotMetadata:
    return SnapshotMetadata.loads((chk / "_metadata").read_bytes(), str(chk))


def files_of(job_dir: Path, chk: str, kind: str) -> list[str]:
    meta = metadata_of(job_dir / chk)
    chunks = {str(c["path"]) for h in meta.all_handles() for c in h.materialized}
    files = sorted(meta.referenced_files())
    return [p for p in files if (p in chunks) == (kind == "chunk")]


def rewrite_metadata(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Hand-edit a _metadata and give it a valid checksum again (what a careless operator does)."""
    body = json.loads(path.read_bytes())
    body.pop("crc32")
    edit(body)
    body["crc32"] = zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    path.write_text(json.dumps(body, sort_keys=True, indent=1))


def flip(path: Path, position: int) -> None:
    data = bytearray(path.read_bytes())
    data[position] ^= 0xFF
    path.write_bytes(bytes(data))


# -- checkpoints list / inspect ----------------------------------------------------------------


def test_list_one_line_per_checkpoint_newest_last(run: Run, job_dir: Path) -> None:
    code, out, _ = run("checkpoints", "list", job_dir)
    assert code == 0
    lines = out.splitlines()
    assert [line.split()[0] for line in lines] == ["chk-1", "chk-2"]
    for line, chk in zip(lines, ("chk-1", "chk-2"), strict=True):
        files = sorted(metadata_of(job_dir / chk).referenced_files())
        size = sum((job_dir / p).stat().st_size for p in files)
        assert "checkpoint/native" in line
        assert "operators=counts[2],other[1]" in line
        assert f"files={len(files)}" in line and f"bytes={size}" in line

    code, out, _ = run("checkpoints", "list", "--json", job_dir)
    assert code == 0
    entries = json.loads(out)
    assert [e["id"] for e in entries] == [1, 2]
    assert entries[1]["operators"] == {"counts": 2, "other": 1}
    assert entries[1]["files"] == len(metadata_of(job_dir / "chk-2").referenced_files())
    assert entries[1]["missing"] == [] and entries[1]["time"].endswith("Z")


def test_list_reports_a_corrupt_checkpoint_and_lists_the_others(run: Run, job_dir: Path) -> None:
    flip(job_dir / "chk-1" / "_metadata", 10)
    code, out, err = run("checkpoints", "list", job_dir)
    assert code == 1
    assert "chk-2" in out and "ERROR" in out
    assert "dstl: error: chk-1" in err and "chk-1/_metadata" in err


def test_list_reports_a_fenced_checkpoint_as_not_completed(run: Run, job_dir: Path) -> None:
    """A checkpoint whose commit failed keeps a fence (chk-<n>/_aborted) beside a _metadata that may
    have landed anyway: listing it as completed would send an operator to a state the job refused."""
    (job_dir / "chk-2" / "_aborted").write_bytes(b"")
    code, out, err = run("checkpoints", "list", job_dir)
    assert code == 1
    assert "chk-1" in out and "checkpoint/native" in out
    assert "chk-2  ERROR fenced by chk-2/_aborted" in out and "dstl: error: chk-2" in err


def test_list_refuses_what_is_not_a_job_directory(run: Run, tmp_path: Path, job_dir: Path) -> None:
    (tmp_path / "empty").mkdir()
    code, _, err = run("checkpoints", "list", tmp_path / "empty")
    assert code == 1 and "not a job directory" in err
    code, _, err = run("checkpoints", "list", tmp_path / "nope")
    assert code == 1 and "no such file or directory" in err
    code, _, err = run("savepoint", "trigger", "--from", job_dir / "chk-2", "--to", tmp_path / "sp")
    assert code == 0
    code, _, err = run("checkpoints", "list", tmp_path / "sp")
    assert code == 1 and "is a snapshot, not a job directory" in err


def test_inspect_summarizes_operators_subtasks_and_files(run: Run, job_dir: Path) -> None:
    code, out, _ = run("checkpoints", "inspect", job_dir / "chk-2")
    assert code == 0
    summary = json.loads(out)
    code, out2, _ = run("checkpoints", "inspect", job_dir / "chk-2" / "_metadata")
    assert code == 0 and json.loads(out2) == summary
    assert (summary["id"], summary["kind"], summary["format"], summary["job"]) == (2, "checkpoint", "native", "job1")
    assert summary["properties"] == {"phase": 2}
    counts = summary["operators"]["counts"]
    assert counts["max_parallelism"] == 128 and counts["parallelism"] == 2
    assert [s["key_group_range"] for s in counts["subtasks"]] == [[0, 63], [64, 127]]
    for sub in counts["subtasks"]:
        assert {"total", "events", "by_day", "seen"} <= set(sub["states"])  # registered where used
        assert sub["states"]["by_day"]["user_key_serializer"] == "str/1"
        assert sub["materialized"]["chunks"] > 0 and sub["materialized"]["bytes"] > 0
        assert sub["changelog"]["entries"] >= 1 and sub["changelog"]["bytes"] > 0
    assert set().union(*(s["states"] for s in counts["subtasks"])) == {"total", "events", "by_day", "seen", "recent"}
    files = {f["path"]: f for f in summary["files"]}
    assert set(files) == metadata_of(job_dir / "chk-2").referenced_files()
    assert {f["kind"] for f in files.values()} == {"chunk", "log"}
    assert all(f["size"] == (job_dir / p).stat().st_size and not f["missing"] for p, f in files.items())
    assert summary["total_bytes"] == sum(f["size"] for f in files.values())

    code, out, _ = run("checkpoints", "inspect", job_dir / "chk-1")
    chk1 = json.loads(out)
    assert code == 0 and {f["kind"] for f in chk1["files"]} == {"log"}
    assert all(s["materialized"]["chunks"] == 0 for s in chk1["operators"]["counts"]["subtasks"])


# -- checkpoints verify ------------------------------------------------------------------------


def test_verify_ok_counts_every_file_and_byte(run: Run, job_dir: Path) -> None:
    files = sorted(metadata_of(job_dir / "chk-2").referenced_files())
    size = sum((job_dir / p).stat().st_size for p in files) + (job_dir / "chk-2" / "_metadata").stat().st_size
    code, out, err = run("checkpoints", "verify", job_dir / "chk-2")
    assert code == 0
    assert out.strip() == f"OK: {len(files) + 1} files, {size} bytes verified"
    assert "%|" not in err  # stderr is not a terminal: no progress bar unless asked


def test_verify_progress_on_request(run: Run, job_dir: Path) -> None:
    n = len(metadata_of(job_dir / "chk-2").referenced_files())
    code, _, err = run("checkpoints", "verify", "--progress", job_dir / "chk-2")
    assert code == 0
    assert "\r" in err and f"| {n}/{n} [" in err  # tqdm's bar, drawn up to the last file


@pytest.mark.parametrize("kind", ["log", "chunk", "metadata"])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_verify_catches_a_flipped_byte(run: Run, job_dir: Path, kind: str, where: str) -> None:
    path = job_dir / "chk-2" / "_metadata" if kind == "metadata" else job_dir / files_of(job_dir, "chk-2", kind)[0]
    size = path.stat().st_size
    flip(path, {"first": 0, "middle": size // 2, "last": size - 1}[where])
    code, out, err = run("checkpoints", "verify", job_dir / "chk-2")
    assert code == 1
    if kind == "metadata":
        assert err.startswith("dstl: error: ") and str(path) in err
    else:
        assert f"BAD {path}: " in out and "FAILED: 1 bad or missing files" in out
        assert out.count("BAD ") >= 1 and all(str(path) in line for line in out.splitlines() if "BAD" in line)


def test_verify_reports_every_bad_and_missing_file(run: Run, job_dir: Path) -> None:
    chunks = files_of(job_dir, "chk-2", "chunk")
    logs = files_of(job_dir, "chk-2", "log")
    (job_dir / chunks[0]).unlink()
    flip(job_dir / chunks[1], 20)
    flip(job_dir / logs[0], 40)
    code, out, _ = run("checkpoints", "verify", job_dir / "chk-2")
    assert code == 1
    assert f"BAD {job_dir / chunks[0]}: missing" in out
    assert f"BAD {job_dir / chunks[1]}: " in out and f"BAD {job_dir / logs[0]}: " in out
    assert "FAILED: 3 bad or missing files" in out


def test_verify_checks_each_referenced_segment_against_its_file(run: Run, job_dir: Path) -> None:
    meta_path = job_dir / "chk-2" / "_metadata"
    original = meta_path.read_bytes()

    def segment(body: dict[str, Any]) -> dict[str, Any]:
        handle = body["operators"]["counts"]["subtasks"][0]
        seg: dict[str, Any] = handle["changelog"][-1]["log"]["segments"][0]
        return seg

    rewrite_metadata(meta_path, lambda body: segment(body).update(length=segment(body)["length"] + 10**6))
    code, out, _ = run("checkpoints", "verify", job_dir / "chk-2")
    assert code == 1 and "ends past the file's end" in out

    meta_path.write_bytes(original)
    rewrite_metadata(meta_path, lambda body: segment(body).update(offset=segment(body)["offset"] + 1))
    code, out, _ = run("checkpoints", "verify", job_dir / "chk-2")
    assert code == 1 and "segment sqn" in out and "no segment at the referenced offset" in out


def test_verify_checks_each_chunk_of_a_pack_by_its_range(run: Run, job_dir: Path) -> None:
    """Chunks share files (packs): an entry reaching past its file, or naming another chunk's
    range of the same file, is reported with the file and the offset."""
    meta_path = job_dir / "chk-2" / "_metadata"
    original = meta_path.read_bytes()

    def chunks(body: dict[str, Any]) -> list[dict[str, Any]]:
        handle = body["operators"]["counts"]["subtasks"][0]
        found: list[dict[str, Any]] = handle["materialized"]
        return found

    def past_the_end(body: dict[str, Any]) -> None:
        chunks(body)[-1]["offset"] += 10**6

    rewrite_metadata(meta_path, past_the_end)
    code, out, _ = run("checkpoints", "verify", job_dir / "chk-2")
    assert code == 1 and "lies outside the file" in out

    def swapped(body: dict[str, Any]) -> None:
        first, second = chunks(body)[:2]
        assert first["path"] == second["path"]  # one materialization: one file
        first["offset"], first["size"] = second["offset"], second["size"]

    meta_path.write_bytes(original)
    rewrite_metadata(meta_path, swapped)
    code, out, _ = run("checkpoints", "verify", job_dir / "chk-2")
    assert code == 1 and "the chunk at offset" in out and "key groups" in out


def pack_entries(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chunk entries of subtask 0 of ``counts``: one pack file, chunks at offsets."""
    entries: list[dict[str, Any]] = body["operators"]["counts"]["subtasks"][0]["materialized"]
    assert len({e["path"] for e in entries}) == 1 and all("offset" in e for e in entries)
    return entries


def test_verify_reports_bytes_after_a_packs_last_chunk(run: Run, job_dir: Path) -> None:
    """A restore reads a pack by its chunks' ranges and never sees bytes after the last one:
    verify reads the whole file and reports them."""
    meta_path = job_dir / "chk-2" / "_metadata"
    pack = job_dir / pack_entries(json.loads(meta_path.read_bytes()))[0]["path"]
    size = pack.stat().st_size
    with pack.open("ab") as f:
        f.write(b"appended after the last chunk")
    code, out, _ = run("checkpoints", "verify", job_dir / "chk-2")
    assert code == 1
    assert f"BAD {pack}: the file is {size + 29} bytes, but its chunks end at byte {size}" in out


def test_verify_accepts_a_pack_whose_last_chunk_no_handle_names_any_more(run: Run, job_dir: Path) -> None:
    """A pack stays while any of its chunks is referenced (``materializer.packs``): a superseded
    chunk at its end is a chunk, not stray bytes; anything after it is."""
    meta_path = job_dir / "chk-2" / "_metadata"
    rewrite_metadata(meta_path, lambda body: pack_entries(body).pop())
    assert run("checkpoints", "verify", job_dir / "chk-2")[0] == 0
    pack = job_dir / pack_entries(json.loads(meta_path.read_bytes()))[0]["path"]
    with pack.open("ab") as f:
        f.write(b"stray")
    code, out, _ = run("checkpoints", "verify", job_dir / "chk-2")
    assert code == 1 and f"BAD {pack}: the file is " in out


# -- savepoint trigger / dispose ---------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["canonical", "native"])
def test_savepoint_trigger_restores_the_same_state(run: Run, built: Built, job_dir: Path, fmt: str) -> None:
    target = job_dir.parent.parent / f"sp-{fmt}"
    before = sorted(p.relative_to(job_dir) for p in job_dir.rglob("*"))
    code, out, _ = run("savepoint", "trigger", "--from", job_dir / "chk-2", "--to", target, "--format", fmt)
    assert code == 0 and f"{fmt} savepoint of checkpoint 2 written to {target}" in out
    assert sorted(p.relative_to(job_dir) for p in job_dir.rglob("*")) == before  # the source is untouched
    code, out, _ = run("checkpoints", "inspect", target)
    summary = json.loads(out)
    assert (summary["id"], summary["kind"], summary["format"]) == (2, "savepoint", fmt)
    assert run("checkpoints", "verify", target)[0] == 0

    moved = job_dir.parent.parent / f"moved-{fmt}"
    target.rename(moved)  # a savepoint is self-contained
    ops = [OperatorSpec("counts", 3), OperatorSpec("other", 2)]
    root = job_dir.parent.parent
    options = JobOptions(restore_from=str(moved), materialization=MANUAL)
    job = LocalJob(root / "restored", "job2", ops, root / "local2", options)
    try:
        assert read_job(job) == built.model
    finally:
        job.close()


def test_savepoint_trigger_refuses_bad_targets(run: Run, job_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    code, _, err = run("savepoint", "trigger", "--from", job_dir / "chk-2", "--to", tmp_path / "full")
    assert code == 1 and "is not empty" in err
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    code, _, err = run("savepoint", "trigger", "--from", job_dir / "chk-2", "--to", job_dir / "sp")
    assert code == 1 and "must not lie inside" in err and not (job_dir / "sp").exists()
    code, _, err = run("savepoint", "trigger", "--from", job_dir / "chk-9", "--to", tmp_path / "sp")
    assert code == 1 and "no such file or directory" in err and not (tmp_path / "sp").exists()
    assert run("savepoint", "trigger", "--to", tmp_path / "sp")[0] == 2  # --from is required
    assert run("savepoint", "trigger", "--from", job_dir / "chk-2", "--to", tmp_path / "canonical")[0] == 0
    code, _, err = run("savepoint", "trigger", "--from", tmp_path / "canonical", "--to", tmp_path / "native",
                       "--format", "native")  # fmt: skip
    assert code == 1 and "only --format canonical can copy it" in err and not (tmp_path / "native").exists()


def test_savepoint_trigger_leaves_nothing_when_it_fails(run: Run, job_dir: Path, tmp_path: Path) -> None:
    (job_dir / files_of(job_dir, "chk-2", "chunk")[0]).unlink()
    for fmt in ("native", "canonical"):
        code, _, err = run("savepoint", "trigger", "--from", job_dir / "chk-2", "--to", tmp_path / fmt, "--format", fmt)
        assert code == 1 and "missing" in err
        assert not (tmp_path / fmt).exists()


def test_dispose_removes_a_savepoint_and_refuses_checkpoints(run: Run, job_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "sp"
    assert run("savepoint", "trigger", "--from", job_dir / "chk-2", "--to", target, "--format", "native")[0] == 0
    code, _, err = run("savepoint", "dispose", job_dir / "chk-2")
    assert code == 1 and "not a savepoint" in err
    code, _, err = run("savepoint", "dispose", job_dir)
    assert code == 1 and "looks like a job directory" in err
    assert run("checkpoints", "verify", job_dir / "chk-2")[0] == 0  # nothing was deleted
    n = len(metadata_of(target).referenced_files()) + 1
    code, out, _ = run("savepoint", "dispose", target)
    assert code == 0 and f"{n} files deleted" in out
    assert not target.exists()
    code, _, err = run("savepoint", "dispose", target)
    assert code == 1 and "no such file or directory" in err


# -- state read --------------------------------------------------------------------------------


def read_rows(run: Run, *argv: str | Path) -> tuple[list[dict[str, Any]], str]:
    code, out, err = run("state", "read", *argv)
    assert code == 0, err
    return [json.loads(line) for line in out.splitlines()], err


@pytest.mark.parametrize("snapshot", ["chk-2", "canonical", "native"])
def test_state_read_jsonl_equals_the_state_written(run: Run, built: Built, job_dir: Path, snapshot: str) -> None:
    path = job_dir / "chk-2"
    if snapshot != "chk-2":
        path = job_dir.parent.parent / snapshot
        assert run("savepoint", "trigger", "--from", job_dir / "chk-2", "--to", path, "--format", snapshot)[0] == 0
    counts, _ = read_rows(run, path, "--operator", "counts")
    other, err = read_rows(run, path, "--operator", "other")
    assert model_of_rows(counts + other) == built.model
    assert "pickle is never unpickled" in err and err.count("pickle/1") == 1
    by_state: dict[str, list[dict[str, Any]]] = {}
    for row in counts + other:
        by_state.setdefault(row["state"], []).append(row)
    kinds = {name: {r["kind"] for r in rows} for name, rows in by_state.items()}
    assert kinds == {"total": {"value"}, "events": {"list"}, "by_day": {"map"}, "seen": {"value"},
                     "recent": {"list"}, "_timers": {"timer"}, "doc": {"value"}, "blob": {"value"}}  # fmt: skip
    assert all(isinstance(r["ttl_expiry_ms"], int) and r["ttl_expiry_ms"] > 0 for r in by_state["seen"])
    assert all(r["ttl_expiry_ms"] is None for r in by_state["total"] + by_state["by_day"])
    assert all(r["operator"] == "counts" and 0 <= r["key_group"] < 128 for r in counts)


def test_state_read_one_state_to_a_file(run: Run, built: Built, job_dir: Path, tmp_path: Path) -> None:
    rows, _ = read_rows(run, job_dir / "chk-2", "--operator", "counts", "--state", "events")
    assert {r["state"] for r in rows} == {"events"}
    assert {r["key"]: r["value"] for r in rows} == built.model["events"]
    out_file = tmp_path / "timers.jsonl"
    code, out, _ = run("state", "read", job_dir / "chk-2", "--operator", "counts", "--state", "_timers",
                       "--output", out_file)  # fmt: skip
    assert code == 0 and out == ""
    timers = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert model_of_rows(timers)["_timers"] == built.model["_timers"]


def test_state_read_operator_defaults_to_the_only_one(run: Run, built: Built, job_dir: Path) -> None:
    code, _, err = run("state", "read", job_dir / "chk-2")
    assert code == 2 and "counts, other" in err and "--operator" in err
    path = job_dir.parent.parent / "counts-only"
    meta_path = job_dir / "chk-2" / "_metadata"
    rewrite_metadata(meta_path, lambda body: body["operators"].pop("other"))
    shutil.copytree(job_dir, path)
    rows, _ = read_rows(run, path / "chk-2")
    assert {r["operator"] for r in rows} == {"counts"}
    assert model_of_rows(rows)["total"] == built.model["total"]


def test_state_read_parquet_equals_jsonl(run: Run, job_dir: Path, tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    jsonl, _ = read_rows(run, job_dir / "chk-2", "--operator", "counts")
    code, out, _ = run("state", "read", job_dir / "chk-2", "--operator", "counts", "--format", "parquet",
                       "--output", tmp_path / "state.parquet")  # fmt: skip
    assert code == 0 and out == ""
    table = pq.read_table(tmp_path / "state.parquet")
    assert table.column_names == ["operator", "state", "kind", "key_group", "key", "user_key", "value", "ttl_expiry_ms"]
    rows = table.to_pylist()
    for row in rows:
        for column in ("key", "user_key", "value"):
            row[column] = None if row[column] is None else json.loads(row[column])
    assert rows == jsonl


def test_state_read_parquet_without_pyarrow_is_a_clear_error(
    run: Run, job_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    out_file = tmp_path / "state.parquet"
    code, _, err = run("state", "read", job_dir / "chk-2", "--operator", "counts", "--format", "parquet",
                       "--output", out_file)  # fmt: skip
    assert code == 1 and "needs pyarrow" in err
    assert not out_file.exists()


def test_state_read_usage_errors(run: Run, job_dir: Path) -> None:
    code, _, err = run("state", "read", job_dir / "chk-2", "--operator", "nope")
    assert code == 2 and "operator 'nope' is not in the snapshot" in err and "counts, other" in err
    code, _, err = run("state", "read", job_dir / "chk-2", "--operator", "counts", "--state", "nope")
    assert code == 2 and "state 'nope'" in err and "by_day, events, recent, seen, total, _timers" in err
    code, _, err = run("state", "read", job_dir / "chk-2", "--operator", "counts", "--format", "parquet")
    assert code == 2 and "needs --output" in err
    assert run("state", "read", job_dir / "chk-2", "--format", "csv")[0] == 2


def test_state_read_dumps_unknown_serializers_as_hex(run: Run, built: Built, job_dir: Path) -> None:
    def rename_serializer(body: dict[str, Any]) -> None:
        for handle in body["operators"]["counts"]["subtasks"]:
            handle["states"]["total"]["serializer"] = "mystery/7"

    rewrite_metadata(job_dir / "chk-2" / "_metadata", rename_serializer)
    rows, err = read_rows(run, job_dir / "chk-2", "--operator", "counts", "--state", "total")
    assert "mystery/7 (unknown to this build)" in err
    decoded = {r["key"]: int.from_bytes(bytes.fromhex(r["value"]["$raw"]), "big", signed=True) for r in rows}
    assert decoded == built.model["total"]


def test_jsonable_keeps_json_unambiguous() -> None:
    value = (1, "a", b"\x00\xff", float("nan"), float("-inf"), 2.5, None, True, {"k": [b"x"]})
    assert jsonable(value) == [1, "a", {"$bytes": "00ff"}, {"$float": "nan"}, {"$float": "-inf"}, 2.5, None, True,
                               {"k": [{"$bytes": "78"}]}]  # fmt: skip
    json.dumps(jsonable(value), allow_nan=False)


# -- errors ------------------------------------------------------------------------------------

COMMANDS: list[Callable[[Path, Path], list[str | Path]]] = [
    lambda p, t: ["checkpoints", "inspect", p],
    lambda p, t: ["checkpoints", "verify", p],
    lambda p, t: ["state", "read", p, "--operator", "counts"],
    lambda p, t: ["savepoint", "trigger", "--from", p, "--to", t],
    lambda p, t: ["savepoint", "dispose", p],
]


@pytest.mark.parametrize("command", range(len(COMMANDS)))
@pytest.mark.parametrize("case", ["missing", "no-metadata", "corrupt", "escape", "a-file"])
def test_bad_paths_are_clear_errors(run: Run, job_dir: Path, tmp_path: Path, command: int, case: str) -> None:
    if case == "missing":
        path, expected = tmp_path / "nowhere", "no such file or directory"
    elif case == "no-metadata":
        path, expected = tmp_path / "empty", "no _metadata in"
        path.mkdir()
    elif case == "a-file":
        path, expected = tmp_path / "notes.txt", "is a file, not a checkpoint or savepoint directory"
        path.write_text("hello")
    elif case == "corrupt":
        path, expected = job_dir / "chk-2", "chk-2/_metadata"
        (path / "_metadata").write_bytes(b"\x00garbage")
    else:

        def escape(body: dict[str, Any]) -> None:
            body["operators"]["counts"]["subtasks"][0]["materialized"][0]["path"] = "../../../outside.chunk"

        path, expected = job_dir / "chk-2", "points outside"
        rewrite_metadata(path / "_metadata", escape)
    code, _, err = run(*COMMANDS[command](path, tmp_path / "target"))
    assert code == 1
    assert err.startswith("dstl: error: ") and expected in err, err
    assert not (tmp_path / "target").exists()


def test_escape_in_a_savepoint_is_refused_by_dispose(run: Run, job_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "sp"
    assert run("savepoint", "trigger", "--from", job_dir / "chk-2", "--to", target, "--format", "native")[0] == 0
    victim = tmp_path / "victim.chunk"
    victim.write_text("not yours")

    def escape(body: dict[str, Any]) -> None:
        body["operators"]["counts"]["subtasks"][0]["materialized"][0]["path"] = "../victim.chunk"

    rewrite_metadata(target / "_metadata", escape)
    code, _, err = run("savepoint", "dispose", target)
    assert code == 1 and "points outside" in err
    assert victim.read_text() == "not yours" and (target / "_metadata").exists()


def test_usage_errors_exit_2(run: Run) -> None:
    assert run()[0] == 2
    assert run("nonsense")[0] == 2
    assert run("checkpoints")[0] == 2
    assert run("checkpoints", "verify")[0] == 2
    assert run("savepoint", "trigger", "--from", "x", "--to", "y", "--format", "zip")[0] == 2


@pytest.mark.parametrize(
    ("argv", "phrase"),
    [
        (["--help"], "Inspect, verify, convert and read"),
        (["checkpoints", "list", "--help"], "List the completed checkpoints"),
        (["checkpoints", "inspect", "--help"], "JSON summary"),
        (["checkpoints", "verify", "--help"], "Read and check every file"),
        (["savepoint", "trigger", "--help"], "without a running job"),
        (["savepoint", "dispose", "--help"], "Refuses a checkpoint directory"),
        (["state", "read", "--help"], "one row per entry"),
    ],
)
def test_help_says_what_each_command_does(run: Run, argv: list[str], phrase: str) -> None:
    code, out, _ = run(*argv)
    assert code == 0 and phrase in " ".join(out.split())


def test_installed_entry_point(job_dir: Path, tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "dstl"
    found = str(script) if script.exists() else shutil.which("dstl")
    command = [found] if found else [sys.executable, "-m", "backend.tools.cli"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    ok = subprocess.run([*command, "checkpoints", "verify", str(job_dir / "chk-2")],
                        capture_output=True, text=True, env=env, timeout=300, check=False)  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("OK: ")
    bad = subprocess.run([*command, "checkpoints", "inspect", str(tmp_path / "missing")],
                         capture_output=True, text=True, env=env, timeout=300, check=False)  # fmt: skip
    assert bad.returncode == 1
    assert bad.stderr.startswith("dstl: error: ") and "Traceback" not in bad.stderr
