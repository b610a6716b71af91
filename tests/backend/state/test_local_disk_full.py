"""A local directory with no room left: the failed write fails its operation, loses nothing (issue 25).

The local tables are a cache of the durable state: when a write to them fails (the file system is
full, LMDB's map size is used up, the disk fails), the operation that needed it fails with
``LocalStateError`` naming the directory, and every change stays where reads find it, so reads,
the changelog and what a checkpoint restores keep agreeing. Once there is room again, the next
write puts everything into the tables.

Three ways to run out of room, all real: LMDB's map size (``local_map_size``); a child process
whose file size limit (``RLIMIT_FSIZE``) stops LMDB's writes short, which LMDB reports as an I/O
error at commit; and a small tmpfs (skipped where mounting is not permitted).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from backend.core.errors import LocalStateError
from backend.core.handles import KeyedStateHandle
from backend.state.keyed_backend import ChangelogKeyedStateBackend
from dstl import ChangelogConfig, StateChangelogStorage
from materializer.periodic import restore
from tests.support.local_disk_child import (
    CACHE_LIMIT,
    KEYS,
    NO_SPILL,
    PAD,
    VALUE,
    Model,
    checkpoint,
    fill,
    materialize,
    open_backend,
    read_all,
)

PROJECT_ROOT = Path(__file__).resolve().parents[3]
CHILD_TIMEOUT_S = 300
#: LMDB's map, and the child's file size limit: a few rounds of ``fill`` fit, not many
ROOM = 1 << 20
#: which write of the local tables fails: a spill of small caches, or (caches that never spill) a
#: checkpoint's write of list, map and timer changes; the operation its error names
WRITES = pytest.mark.parametrize(
    ("cache_limit", "operation"),
    [
        (CACHE_LIMIT, "a flush of the write-back caches"),
        (NO_SPILL, "a checkpoint's write of list, map and timer changes"),
    ],
    ids=["spill", "checkpoint"],
)


def restored(local: Path, storage: StateChangelogStorage, handle: str) -> Model:
    """What a fresh backend over ``local`` reads after restoring ``handle``."""
    b = open_backend(local, storage)
    try:
        restore(b, [KeyedStateHandle.loads(handle)])
        return read_all(b)
    finally:
        b.close()


def values(b: ChangelogKeyedStateBackend) -> dict[int, str | None]:
    state = b.get_state(VALUE)
    out: dict[int, str | None] = {}
    for key in range(KEYS):
        b.set_current_key(key)
        out[key] = state.value()
    return out


@WRITES
def test_a_full_lmdb_map_fails_the_write_and_loses_no_change(
    tmp_path: Path, local_storage: StateChangelogStorage, cache_limit: int, operation: str
) -> None:
    local = tmp_path / "local"
    b = open_backend(local, local_storage, cache_limit, local_map_size=ROOM)
    try:
        error, model = fill(b, itertools.count(1))
        assert error.full
        assert str(error).startswith(f"{operation} failed: the local state directory {local} is full")
        assert "map size" in str(error)
        assert read_all(b) == model
        with pytest.raises(LocalStateError, match="is full"):  # no room yet: the next write fails alike
            b.flush()
        assert read_all(b) == model
    finally:
        b.close()


def test_a_full_lmdb_map_keeps_a_spill_of_logged_values_readable_and_checkpointed(
    tmp_path: Path, local_storage: StateChangelogStorage
) -> None:
    """Value state alone, values growing every round: a checkpoint only logs value changes, so it
    succeeds with the tables full, and what it restores is what the backend reads, the values of
    the failed spill included (the checkpoint before it logged them; they are in memory only)."""
    b = open_backend(tmp_path / "local", local_storage, local_map_size=ROOM)
    state = b.get_state(VALUE)
    written: dict[int, str | None] = dict.fromkeys(range(KEYS))
    ids = itertools.count(1)
    try:
        with pytest.raises(LocalStateError, match="is full") as failed:
            for r in range(200):
                for key in range(KEYS):
                    b.set_current_key(key)
                    written[key] = f"{r}:{key}:{PAD * (r + 1)}"
                    state.update(written[key])  # kept even when the spill it triggers fails
                checkpoint(b, next(ids))
        assert str(tmp_path / "local") in str(failed.value)
        assert next(ids) > 2, "the tables filled up before a checkpoint logged a spill's values"
        assert values(b) == written
        handle = checkpoint(b, next(ids))  # logs only: succeeds with the tables full
        fresh = open_backend(tmp_path / "fresh", local_storage)
        try:
            fresh.restore([KeyedStateHandle.loads(handle)])
            assert values(fresh) == written
        finally:
            fresh.close()
        small = open_backend(tmp_path / "small", local_storage, local_map_size=ROOM // 8)
        try:  # a restore into tables too small for the state fails the same way
            with pytest.raises(LocalStateError, match=r"^the replay of log .* is full"):
                small.restore([KeyedStateHandle.loads(handle)])
        finally:
            small.close()
    finally:
        b.close()


@WRITES
def test_a_short_write_at_commit_fails_the_write_and_the_backend_goes_on_when_there_is_room(
    tmp_path: Path, cache_limit: int, operation: str
) -> None:
    out = tmp_path / "out.json"
    local = tmp_path / "local"
    args = [tmp_path / "dfs", local, ROOM, cache_limit, out]
    cmd = [sys.executable, "-m", "tests.support.local_disk_child", *map(str, args)]
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
    proc = subprocess.run(cmd, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(out.read_text())
    model = seen["model"]
    assert seen["error"]["type"] == "LocalStateError"
    assert seen["error"]["message"].startswith(f"{operation} failed: the local state directory {local} is full")
    assert "file size limit" in seen["error"]["message"]
    assert seen["again"]["type"] == "LocalStateError"
    assert seen["reads"] == model
    assert seen["reads_after"] == model
    with StateChangelogStorage(ChangelogConfig.local(tmp_path / "dfs")) as storage:
        assert restored(tmp_path / "fresh", storage, seen["handle"]) == model


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs of ``ROOM`` bytes; skips where mounting is not permitted (not root, no CAP_SYS_ADMIN)."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    try:
        proc = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={ROOM}", "tmpfs", str(mount)], capture_output=True, text=True
        )
    except OSError as exc:  # no mount command
        pytest.skip(f"cannot mount a tmpfs here: {exc}")
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


@WRITES
def test_a_full_file_system_fails_the_write_and_the_backend_goes_on_when_there_is_room(
    tmp_path: Path, small_tmpfs: Path, local_storage: StateChangelogStorage, cache_limit: int, operation: str
) -> None:
    spare = small_tmpfs / "spare"
    spare.write_bytes(b"\0" * (ROOM // 2))  # freed later: room again
    local = small_tmpfs / "local"
    b = open_backend(local, local_storage, cache_limit)
    try:
        ids = itertools.count(1)
        error, model = fill(b, ids)
        assert error.full
        assert str(error).startswith(f"{operation} failed: the local state directory {local} is full")
        assert read_all(b) == model
        with pytest.raises(LocalStateError, match="is full"):
            b.flush()
        spare.unlink()
        b.flush()
        materialize(b)
        assert read_all(b) == model
        handle = checkpoint(b, next(ids))
    finally:
        b.close()
    assert restored(tmp_path / "fresh", local_storage, handle) == model
