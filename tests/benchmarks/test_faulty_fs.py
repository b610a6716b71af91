"""The ``faulty://`` file system: every action on every operation, rule counting, stalls that end.

Calls go through our real ``FsspecUploader`` (and ``StateChangelogStorage`` for the log path), so
the tests also show that the fault layer is reachable from an ordinary ``ChangelogConfig``.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import fsspec
import pytest

from benchmarks.support.faulty_fs import Fault, FaultPlan, StallEnded, faulty_base_path
from dstl import ChangelogConfig, KeyGroupRange, StateChangelogStorage
from dstl.uploaders import FsspecUploader
from tests.support.threads import in_thread

WAIT_S = 30.0
OPS = ["put", "get", "delete", "exists", "list"]


@pytest.fixture
def plan() -> FaultPlan:
    return FaultPlan()


@pytest.fixture
def dfs(tmp_path: Path) -> Path:
    return tmp_path / "dfs"


@pytest.fixture
def uploader(dfs: Path, plan: FaultPlan) -> FsspecUploader:
    up = FsspecUploader(faulty_base_path(dfs, plan))
    asyncio.run(up.put("chk-1/_metadata", b"metadata-1"))
    plan.calls.clear()
    return up


def call(uploader: FsspecUploader, op: str, path: str = "chk-1/_metadata") -> Any:
    """One uploader call of kind ``op`` on ``path`` (list: its parent)."""
    coros: dict[str, Callable[[], Coroutine[Any, Any, Any]]] = {
        "put": lambda: uploader.put(path, b"new"),
        "get": lambda: uploader.get(path),
        "delete": lambda: uploader.delete(path),
        "exists": lambda: uploader.list(path),  # list checks existence first
        "list": lambda: uploader.list(path.rpartition("/")[0]),
    }
    return asyncio.run(coros[op]())


def test_round_trip_through_the_storage_without_faults(dfs: Path, plan: FaultPlan) -> None:
    config = ChangelogConfig(base_path=faulty_base_path(dfs, plan), persist_delay_ms=30_000)
    with StateChangelogStorage(config) as storage:
        writer = storage.create_writer("op", KeyGroupRange(0, 3))
        records = [(i % 4, f"r{i}".encode()) for i in range(50)]
        for kg, data in records:
            writer.append(kg, data)
        handle = writer.persist_durably(0).result(WAIT_S)
        assert list(storage.read(handle)) == records
        (name,) = handle.files
        assert (dfs / name).is_file()
    assert ("put", name, "ok") in plan.calls and ("get", name, "ok") in plan.calls


def test_log_upload_retries_through_injected_failures(dfs: Path, plan: FaultPlan) -> None:
    fault = plan.add(Fault(op="put", path="dstl/*", action="fail", times=2))
    config = ChangelogConfig(base_path=faulty_base_path(dfs, plan), max_attempts=3, retry_delay_ms=1)
    with StateChangelogStorage(config) as storage:
        writer = storage.create_writer("op", KeyGroupRange(0, 0))
        writer.append(0, b"payload")
        handle = writer.persist_durably(0).result(WAIT_S)
        assert list(storage.read(handle)) == [(0, b"payload")]
    assert plan.hits(fault) == 2
    assert [out for op, _, out in plan.calls if op == "put"] == ["fail", "fail", "ok"]


@pytest.mark.parametrize("op", OPS)
def test_fail_names_the_operation_and_path_then_passes(uploader: FsspecUploader, plan: FaultPlan, op: str) -> None:
    plan.add(Fault(op=op, path="chk-1*", action="fail", times=1))  # type: ignore[arg-type]
    with pytest.raises(OSError, match=f"injected failure: {op} chk-1"):
        call(uploader, op)
    call(uploader, op)
    assert [out for o, _, out in plan.calls if o == op] == ["fail", "ok"]


@pytest.mark.parametrize("op", OPS)
def test_reset_raises_connection_reset(uploader: FsspecUploader, plan: FaultPlan, op: str) -> None:
    plan.add(Fault(op=op, action="reset"))  # type: ignore[arg-type]
    with pytest.raises(ConnectionResetError):
        call(uploader, op)


def test_after_skips_then_times_counts(uploader: FsspecUploader, plan: FaultPlan) -> None:
    fault = plan.add(Fault(op="get", action="fail", after=1, times=2))
    outcomes = []
    for _ in range(4):
        try:
            call(uploader, "get")
            outcomes.append("ok")
        except OSError:
            outcomes.append("fail")
    assert outcomes == ["ok", "fail", "fail", "ok"]
    assert plan.hits(fault) == 2


def test_first_applicable_rule_wins_and_globs_match_relative_paths(uploader: FsspecUploader, plan: FaultPlan) -> None:
    plan.add(Fault(op="*", path="*/_metadata", action="fail", error=FileNotFoundError, times=1))
    plan.add(Fault(op="put", path="*/_metadata", action="fail"))
    with pytest.raises(FileNotFoundError):
        call(uploader, "put")
    with pytest.raises(OSError, match="injected failure: put chk-1/_metadata"):
        call(uploader, "put")
    asyncio.run(uploader.put("dstl/ab/chunk", b"x"))  # no rule matches this path
    plan.remove(plan.add(Fault(op="get", action="fail")))
    assert call(uploader, "get") == b"metadata-1"


@pytest.mark.parametrize("op", OPS)
def test_stall_holds_the_call_until_release(uploader: FsspecUploader, plan: FaultPlan, op: str, dfs: Path) -> None:
    plan.add(Fault(op=op, action="stall"))  # type: ignore[arg-type]
    thread, out = in_thread(lambda: call(uploader, op))
    assert plan.wait_stalled(1, WAIT_S)
    assert (dfs / "chk-1" / "_metadata").read_bytes() == b"metadata-1"  # nothing done yet
    assert thread.is_alive()
    plan.release()
    thread.join(WAIT_S)
    assert not thread.is_alive() and "error" not in out
    call(uploader, "exists")  # a released stall rule no longer matches
    assert [o for o, _, outcome in plan.calls if outcome == "stall"] == [op]


def test_stall_ends_with_an_error_when_the_plan_closes(uploader: FsspecUploader, plan: FaultPlan) -> None:
    plan.add(Fault(op="put", action="stall"))
    thread, out = in_thread(lambda: call(uploader, "put"))
    assert plan.wait_stalled(1, WAIT_S)
    plan.close()
    thread.join(WAIT_S)
    assert isinstance(out["error"], StallEnded)
    assert "put chk-1/_metadata" in str(out["error"])


def test_stall_ends_when_the_plan_is_dropped(dfs: Path) -> None:
    plan = FaultPlan()
    fs, root = fsspec.core.url_to_fs(faulty_base_path(dfs, plan))
    plan.add(Fault(op="exists", action="stall"))
    thread, out = in_thread(lambda: fs.exists(f"{root}/x"))
    assert plan.wait_stalled(1, WAIT_S)
    del plan
    gc.collect()
    thread.join(WAIT_S)
    assert isinstance(out["error"], StallEnded)
    with pytest.raises(OSError, match="no live fault plan"):
        fs.exists(f"{root}/x")


def test_stall_limit_ends_a_forgotten_stall(dfs: Path) -> None:
    plan = FaultPlan(stall_limit_s=0.01)
    up = FsspecUploader(faulty_base_path(dfs, plan))
    plan.add(Fault(op="list", action="stall"))
    with pytest.raises(StallEnded, match="stall limit"):
        asyncio.run(up.list())


@pytest.mark.parametrize("op", OPS)
def test_delay_then_the_call_proceeds(uploader: FsspecUploader, plan: FaultPlan, op: str) -> None:
    plan.add(Fault(op=op, action="delay", delay_s=0.05))  # type: ignore[arg-type]
    start = time.monotonic()
    call(uploader, op)
    assert time.monotonic() - start >= 0.05
    assert [outcome for o, _, outcome in plan.calls if o == op] == ["delay"]


@pytest.mark.parametrize("op", ["put", "get"])
def test_trickle_paces_the_bytes(uploader: FsspecUploader, plan: FaultPlan, op: str, dfs: Path) -> None:
    payload = b"z" * 200
    asyncio.run(uploader.put("big", payload))
    plan.add(Fault(op=op, path="big", action="trickle", bytes_per_s=2000))  # type: ignore[arg-type]
    start = time.monotonic()
    if op == "put":
        asyncio.run(uploader.put("big", payload[::-1]))
        assert (dfs / "big").read_bytes() == payload[::-1]
    else:
        assert asyncio.run(uploader.get("big", 0, 100)) == payload[:100]
    assert time.monotonic() - start >= (200 if op == "put" else 100) / 2000


def test_late_put_lands_only_when_told(uploader: FsspecUploader, plan: FaultPlan, dfs: Path) -> None:
    plan.add(Fault(op="put", path="chk-2/_metadata", action="late"))
    with pytest.raises(TimeoutError, match="late put chk-2/_metadata"):
        asyncio.run(uploader.put("chk-2/_metadata", b"metadata-2"))
    assert asyncio.run(uploader.list()) == ["chk-1/_metadata"]
    assert plan.pending_late == [("put", "chk-2/_metadata")]
    # the client's clean-up delete finds nothing, and the held write lands afterwards anyway
    asyncio.run(uploader.delete("chk-2/_metadata"))
    assert plan.land_late() == 1
    assert (dfs / "chk-2" / "_metadata").read_bytes() == b"metadata-2"
    assert plan.pending_late == [] and plan.land_late() == 0
    assert plan.calls[-1] == ("put", "chk-2/_metadata", "landed")


def test_late_delete_lands_only_when_told(uploader: FsspecUploader, plan: FaultPlan, dfs: Path) -> None:
    plan.add(Fault(op="delete", action="late"))
    with pytest.raises(TimeoutError):
        asyncio.run(uploader.delete("chk-1/_metadata"))
    assert (dfs / "chk-1" / "_metadata").exists()
    plan.land_late()
    assert not (dfs / "chk-1").exists()  # the emptied directory goes too, as on an object store


def test_late_is_refused_for_reads() -> None:
    with pytest.raises(ValueError, match="late"):
        Fault(op="get", action="late")


def test_paths_outside_the_base_are_refused(dfs: Path, plan: FaultPlan) -> None:
    fs, root = fsspec.core.url_to_fs(faulty_base_path(dfs, plan))
    with pytest.raises(PermissionError):
        fs.cat_file(f"{root}/../outside")


def test_lag_hides_matching_entries_from_listings_only(uploader: FsspecUploader, plan: FaultPlan) -> None:
    for path in ("chk-1/_metadata", "shared/a.chunk", "shared/b.chunk"):
        asyncio.run(uploader.put(path, b"x"))
    plan.add(Fault(op="list", action="lag", hide="shared/a*"))
    assert asyncio.run(uploader.list("")) == ["chk-1/_metadata", "shared/b.chunk"]
    assert asyncio.run(uploader.get("shared/a.chunk")) == b"x"  # the object is there: only the listing lags
    with pytest.raises(ValueError, match="lag"):
        Fault(op="get", action="lag")
