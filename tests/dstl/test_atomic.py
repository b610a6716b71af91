"""Local files are written whole and durably (``dstl.atomic``): the file fsynced under a temporary
name in its directory, renamed, then the directory fsynced, so a crash leaves the old file or the
new one and a write that returned survives a machine crash; the local DFS puts its files so."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from dstl.atomic import is_temporary, write_atomically
from dstl.uploaders import FsspecUploader


@pytest.fixture
def synced(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths fsynced from now on, in order (os.fsync recorded, then done)."""
    paths: list[str] = []
    fsync: Callable[[int], None] = os.fsync

    def recording_fsync(fd: int) -> None:
        paths.append(os.readlink(f"/proc/self/fd/{fd}"))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    return paths


def test_a_write_syncs_its_file_then_its_directory(tmp_path: Path, synced: list[str]) -> None:
    target = tmp_path / "state.json"
    target.write_text("old")
    write_atomically(target, "new")
    assert target.read_text() == "new"
    written, directory = synced
    assert is_temporary(written) and Path(written).parent == tmp_path  # renamed within its directory
    assert directory == str(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["state.json"]


def test_a_write_that_need_not_be_durable_syncs_nothing(tmp_path: Path, synced: list[str]) -> None:
    write_atomically(tmp_path / "marker", b"x", durable=False)
    assert (tmp_path / "marker").read_bytes() == b"x"
    assert synced == []


def test_a_failed_write_keeps_what_was_there_and_leaves_no_temporary(tmp_path: Path) -> None:
    occupied = tmp_path / "occupied"
    (occupied / "inside").mkdir(parents=True)  # a non-empty directory cannot be replaced by a file
    with pytest.raises(OSError):
        write_atomically(occupied, b"data")
    assert occupied.is_dir() and [p for p in tmp_path.iterdir() if is_temporary(p.name)] == []
    with pytest.raises(FileNotFoundError):  # a missing directory is not created
        write_atomically(tmp_path / "gone" / "file", b"data")
    assert not (tmp_path / "gone").exists()


def test_a_local_dfs_put_is_durable_with_its_directory(tmp_path: Path, synced: list[str]) -> None:
    uploader = FsspecUploader(str(tmp_path))

    async def put() -> None:
        try:
            await uploader.put("dstl/00/file", b"changes")
        finally:
            await uploader.close()

    asyncio.run(put())
    assert (tmp_path / "dstl" / "00" / "file").read_bytes() == b"changes"
    here = [p for p in synced if p.startswith(str(tmp_path))]
    assert len(here) == 2 and is_temporary(here[0])
    assert here[1] == str(tmp_path / "dstl" / "00")  # without it a machine crash may lose the rename
