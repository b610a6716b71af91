"""The DSTL on fsspec file systems: a plain local directory, a ``file://`` URL and ``memory://``.

Same contracts as against S3: one file per flush under ``dstl/<2 hex>/<32 hex>``, reads (whole,
ranged, key-group filtered) return exactly what was appended, reference counting deletes files,
confirmed files survive ``close``, and a JSON handle reads back from a new storage (a restart).
Local writes are atomic: no temporary file is ever left behind, not even by a failed write.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest

from dstl import (
    ChangelogConfig,
    ChangelogHandle,
    ChangelogWriter,
    HedgingPolicy,
    KeyGroupRange,
    StateChangelogStorage,
    UploadFailedError,
)
from dstl.atomic import is_temporary

WAIT_S = 30.0
FILE_NAME = re.compile(r"dstl/[0-9a-f]{2}/[0-9a-f]{32}")

Records = list[tuple[int, bytes]]


@pytest.fixture(params=["plain", "file-url", "memory"])
def base_path(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    kind = request.param
    if kind == "plain":
        yield str(tmp_path / "checkpoints" / "job1")
    elif kind == "file-url":
        yield f"file://{tmp_path}/checkpoints/job1"
    else:
        # The memory file system is global to the process: a unique prefix isolates the test.
        base = f"memory://dstl-test-{uuid.uuid4().hex}/job1"
        yield base
        fs, root = fsspec.core.url_to_fs(base)
        if fs.exists(root):
            fs.rm(root, recursive=True)


@pytest.fixture
def local_base_path(tmp_path: Path) -> str:
    return str(tmp_path / "checkpoints" / "job1")


def files_under(base: str) -> dict[str, int]:
    """Every file below ``base``, as base-relative path -> size (read with fsspec, not the storage)."""
    fs, root = fsspec.core.url_to_fs(base)
    root = root.rstrip("/")
    if not fs.exists(root):
        return {}
    return {name[len(root) + 1 :]: info["size"] for name, info in fs.find(root, detail=True).items()}


def append_records(writer: ChangelogWriter, key_groups: Iterable[int], tag: str, count: int) -> Records:
    kgs = list(key_groups)
    records = [(kgs[i % len(kgs)], f"{tag}:{i}:{'y' * (i % 41)}".encode()) for i in range(count)]
    for kg, data in records:
        writer.append(kg, data)
    return records


def config(base: str, **overrides: Any) -> ChangelogConfig:
    return ChangelogConfig(base_path=base, **overrides)


def test_round_trip_one_file_per_flush_and_ranged_reads(base_path: str) -> None:
    ranges = [KeyGroupRange(0, 9), KeyGroupRange(10, 19), KeyGroupRange(20, 29)]
    # No timer flushes: a flush happens exactly when every writer has asked to persist.
    with StateChangelogStorage(config(base_path, persist_delay_ms=30_000)) as storage:
        writers = [storage.create_writer(f"op{i}", rng) for i, rng in enumerate(ranges)]
        appended = [
            append_records(w, rng, f"a{i}", 200) for i, (w, rng) in enumerate(zip(writers, ranges, strict=True))
        ]
        handles = [f.result(WAIT_S) for f in [w.persist_durably(0) for w in writers]]

        assert storage.metrics.flushes == 1
        files = files_under(base_path)
        assert len(files) == 1, files
        (name,) = files
        assert FILE_NAME.fullmatch(name)
        assert all(h.files == {name} for h in handles)
        assert storage.run(storage.list_files(), WAIT_S) == [name]

        for h, records in zip(handles, appended, strict=True):
            assert list(storage.read(h)) == records

        # Ranged read: the middle writer's segment lies strictly inside the shared file.
        (segment,) = handles[1].segments
        assert segment.offset > 0 and segment.offset + segment.length < files[name]
        wanted = KeyGroupRange(15, 17)
        assert list(storage.read(handles[1], wanted)) == [(kg, d) for kg, d in appended[1] if kg in wanted]
        assert list(storage.read(handles[1], ranges[0])) == []

        # A second round is a second file; a persist from the start spans both, in SQN order.
        more = [append_records(w, rng, f"b{i}", 50) for i, (w, rng) in enumerate(zip(writers, ranges, strict=True))]
        second = [f.result(WAIT_S) for f in [w.persist_durably(h.upto) for w, h in zip(writers, handles, strict=True)]]
        assert storage.metrics.flushes == 2 and len(files_under(base_path)) == 2
        assert len({p for h in second for p in h.files}) == 1 and second[0].files != handles[0].files
        full = writers[2].persist_durably(0).result(WAIT_S)
        assert storage.metrics.flushes == 2  # nothing uploaded twice
        assert list(storage.read(full)) == appended[2] + more[2]


def test_release_and_truncate_delete_the_file(base_path: str) -> None:
    with StateChangelogStorage(config(base_path)) as storage:
        writer = storage.create_writer("op", KeyGroupRange(0, 7))
        append_records(writer, range(8), "r", 100)
        handle = writer.persist_durably(0).result(WAIT_S)
        assert set(files_under(base_path)) == handle.files

        writer.release(handle)
        storage.flush(WAIT_S)
        assert set(files_under(base_path)) == handle.files  # the changeset still references it
        writer.truncate(handle.upto + 1)
        storage.flush(WAIT_S)
        assert files_under(base_path) == {}
        assert storage.metrics.files_deleted == 1
        assert storage.tracked_files() == {}


def test_handle_reads_back_after_restart_and_confirmed_file_survives_close(base_path: str) -> None:
    with StateChangelogStorage(config(base_path)) as storage:
        kept = storage.create_writer("kept", KeyGroupRange(0, 63))
        dropped = storage.create_writer("dropped", KeyGroupRange(64, 127))
        records = append_records(kept, range(64), "k1", 300)
        first = kept.persist_durably(0).result(WAIT_S)
        records += append_records(kept, range(64), "k2", 300)
        handle = kept.persist_durably(0).result(WAIT_S)
        assert len(handle.segments) == 2
        append_records(dropped, range(64, 128), "d", 100)
        unconfirmed = dropped.persist_durably(0).result(WAIT_S)
        dropped.release(unconfirmed)  # its checkpoint aborted (a handle still held would be kept)
        kept.confirm(handle)
        kept.release(first)
        text = handle.dumps()
    assert set(files_under(base_path)) == handle.files
    assert handle.files.isdisjoint(unconfirmed.files)

    restored = ChangelogHandle.loads(text)
    assert restored == handle
    with StateChangelogStorage(config(base_path)) as restarted:
        assert list(restarted.read(restored)) == records
        wanted = KeyGroupRange(10, 20)
        assert list(restarted.read(restored, wanted)) == [(kg, d) for kg, d in records if kg in wanted]
    assert set(files_under(base_path)) == handle.files  # reading never deletes


def test_moved_checkpoint_directory_still_reads(tmp_path: Path) -> None:
    """Handles hold paths relative to the base path, so the whole directory can be moved."""
    old, new = tmp_path / "old" / "job1", tmp_path / "new" / "job1"
    with StateChangelogStorage(config(str(old))) as storage:
        writer = storage.create_writer("op", KeyGroupRange(0, 7))
        records = append_records(writer, range(8), "m", 100)
        handle = writer.persist_durably(0).result(WAIT_S)
        writer.confirm(handle)
    new.parent.mkdir()
    shutil.move(old, new)
    with StateChangelogStorage(config(f"file://{new}")) as moved:
        assert list(moved.read(ChangelogHandle.loads(handle.dumps()))) == records


def test_no_temporary_files_remain(base_path: str) -> None:
    with StateChangelogStorage(config(base_path, persist_delay_ms=0)) as storage:
        writers = [storage.create_writer(f"op{i}", KeyGroupRange(i * 4, i * 4 + 3)) for i in range(4)]
        handles = []
        for round_ in range(3):
            for i, w in enumerate(writers):
                append_records(w, range(i * 4, i * 4 + 4), f"{round_}-{i}", 50)
            handles += [f.result(WAIT_S) for f in [w.persist_durably(w.last_appended_sqn() - 1) for w in writers]]
        storage.flush(WAIT_S)
        names = set(files_under(base_path))
        assert names == {p for h in handles for p in h.files}
        assert all(FILE_NAME.fullmatch(n) for n in names), names
    assert not [n for n in files_under(base_path) if is_temporary(n)]


def test_failed_local_write_leaves_nothing_and_loses_nothing(
    local_base_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    cfg = config(local_base_path, max_attempts=2, retry_delay_ms=10, hedging=HedgingPolicy.disabled())
    with StateChangelogStorage(cfg) as storage:
        writer = storage.create_writer("op", KeyGroupRange(0, 7))
        records = append_records(writer, range(8), "r", 200)
        with monkeypatch.context() as patch:
            patch.setattr(os, "fsync", failing_fsync)
            with pytest.raises(UploadFailedError, match=r"after 2 attempts .*No space left on device"):
                writer.persist_durably(0).result(WAIT_S)
            storage.flush(WAIT_S)
        # Neither a partial file under a final name nor a temporary file.
        assert files_under(local_base_path) == {}

        handle = writer.persist_durably(0).result(WAIT_S)
        assert list(storage.read(handle)) == records
        assert set(files_under(local_base_path)) == handle.files
