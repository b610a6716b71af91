"""What the ``dstl`` command line does with a snapshot: open it, summarize it, restore it, decode it.

A *snapshot* is a completed checkpoint (``<job>/chk-<n>/_metadata``, paths relative to the job
directory) or a savepoint (``<dir>/_metadata``, paths relative to ``<dir>``); see
``backend.checkpointing.metadata``. Nothing here writes to a snapshot: state is restored into scratch
backends (LMDB in a temporary directory, no changelog) and read from there. Nothing read from a
snapshot is unpickled: values of a ``pickle/1`` state (or of a serializer this build does not
know) are dumped as hex.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backend.checkpointing.metadata import (
    METADATA_NAME,
    Progress,
    SnapshotMetadata,
    aborted_path,
    is_inside,
    metadata_path,
    parse_checkpoint_dir,
    parse_metadata_path,
    snapshot_location,
)
from backend.checkpointing.savepoints import handles_of
from backend.core.handles import KeyedStateHandle
from backend.state.keyed_backend import ChangelogKeyedStateBackend
from backend.tools.errors import CliError
from dstl import ChangelogConfig, ChangelogStorage, StateChangelogStorage
from dstl.paths import is_local, local_path
from materializer.periodic import restore

# -- paths and storages ----------------------------------------------------------------------


def normalize(url: str) -> str:
    """An absolute local path (``file://`` dropped), or the URL without a trailing slash."""
    local = local_path(url)
    return os.path.abspath(local) if local is not None else url.rstrip("/")


def require_directory(url: str) -> None:
    """A local ``url`` must be an existing directory (opening a storage would create it)."""
    if not is_local(url):
        return
    if not os.path.exists(url):
        raise CliError(f"{url}: no such file or directory")
    if not os.path.isdir(url):
        raise CliError(f"{url} is not a directory")


@contextlib.contextmanager
def open_storage(url: str) -> Iterator[ChangelogStorage]:
    storage = StateChangelogStorage(ChangelogConfig(base_path=url))
    try:
        yield storage
    finally:
        storage.close()


def file_sizes(base: str, storage: ChangelogStorage, paths: Sequence[str]) -> dict[str, int | None]:
    """Size of each file (relative to ``base``); None for a missing one. Remote files are read."""
    sizes: dict[str, int | None] = {}
    for path in paths:
        try:
            if is_local(base):
                sizes[path] = os.path.getsize(os.path.join(base, path))
            else:
                sizes[path] = len(storage.files.get(path))
        except FileNotFoundError:
            sizes[path] = None
    return sizes


def iso_time(timestamp_ms: int) -> str:
    if timestamp_ms <= 0:
        return "-"
    moment = datetime.datetime.fromtimestamp(timestamp_ms / 1000, tz=datetime.UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


# -- snapshots -------------------------------------------------------------------------------


@dataclass
class Snapshot:
    base: str  # the directory its paths are relative to
    where: str  # its _metadata, relative to base
    storage: ChangelogStorage  # base path: ``base``
    meta: SnapshotMetadata
    metadata_size: int

    @property
    def metadata_url(self) -> str:
        return f"{self.base}/{self.where}"

    def handles(self, uid: str) -> list[KeyedStateHandle]:
        return handles_of(self.meta, uid)


def _not_a_snapshot(directory: str) -> CliError:
    hint = ""
    names = os.listdir(directory) if is_local(directory) and os.path.isdir(directory) else []
    if any(parse_checkpoint_dir(name) is not None for name in names):
        hint = f"; it looks like a job directory: run `dstl checkpoints list {directory}` and pass a chk-<n> of it"
    return CliError(f"no {METADATA_NAME} in {directory}: not a completed checkpoint or a savepoint{hint}")


@contextlib.contextmanager
def open_snapshot(path: str) -> Iterator[Snapshot]:
    """The snapshot at ``path``: a ``chk-<n>`` directory, a savepoint directory or a ``_metadata``."""
    url = normalize(path)
    if is_local(url):
        if not os.path.exists(url):
            raise CliError(f"{url}: no such file or directory")
        if os.path.isfile(url) and os.path.basename(url) != METADATA_NAME:
            raise CliError(f"{url} is a file, not a checkpoint or savepoint directory or a {METADATA_NAME} file")
    base, where = snapshot_location(url)
    directory = f"{base}/{where}".rsplit("/", 1)[0]
    require_directory(base)
    with open_storage(base) as storage:
        try:
            data = storage.files.get(where)
        except (FileNotFoundError, IsADirectoryError):
            raise _not_a_snapshot(directory) from None
        meta = SnapshotMetadata.loads(data, f"{base}/{where}")
        yield Snapshot(base, where, storage, meta, len(data))


def operator_parallelism(meta: SnapshotMetadata, uid: str) -> int:
    part = meta.operators[uid]
    items = part.get("subtasks" if meta.format == "native" else "files", [])
    return len(items) if isinstance(items, list) else 0


def list_checkpoints(job_dir: str) -> list[dict[str, Any]]:
    """One entry per ``chk-<n>/_metadata`` of a job directory, oldest first; a metadata file that
    cannot be read gives an entry with ``error``."""
    url = normalize(job_dir)
    require_directory(url)
    with open_storage(url) as storage:
        if is_local(url):
            names = [n for n in os.listdir(url) if os.path.isfile(os.path.join(url, n, METADATA_NAME))]
            found = map(parse_checkpoint_dir, names)
        else:
            found = map(parse_metadata_path, storage.files.list(""))
        ids = sorted({i for i in found if i is not None})
        if not ids and is_local(url) and not {"dstl", "shared"} & set(os.listdir(url)):
            if os.path.isfile(os.path.join(url, METADATA_NAME)):
                raise CliError(f"{url} is a snapshot, not a job directory: use `dstl checkpoints inspect {url}`")
            raise CliError(f"{url} is not a job directory: no chk-<n>/{METADATA_NAME} in it")
        out = []
        for cid in ids:
            where = metadata_path(cid)
            entry: dict[str, Any] = {"id": cid, "path": f"{url}/{where}"}
            if _is_fenced(storage, cid):
                entry["error"] = f"fenced by {aborted_path(cid)}: its commit failed, it is not a completed checkpoint"
                out.append(entry)
                continue
            try:
                meta = SnapshotMetadata.loads(storage.files.get(where), f"{url}/{where}")
                files = sorted(meta.referenced_files())
            except Exception as exc:  # reported per checkpoint; the others are still listed
                entry["error"] = str(exc)
                out.append(entry)
                continue
            sizes = file_sizes(url, storage, files)
            entry.update(
                time=iso_time(meta.timestamp_ms),
                timestamp_ms=meta.timestamp_ms,
                kind=meta.kind,
                format=meta.format,
                job=meta.job_id,
                operators={uid: operator_parallelism(meta, uid) for uid in sorted(meta.operators)},
                files=len(files),
                bytes=sum(s or 0 for s in sizes.values()),
                missing=sorted(p for p, s in sizes.items() if s is None),
            )
            out.append(entry)
        return out


def _is_fenced(storage: ChangelogStorage, checkpoint_id: int) -> bool:
    """Whether the coordinator fenced this checkpoint (its ``_metadata`` may still be there)."""
    try:
        storage.files.get(aborted_path(checkpoint_id))
    except FileNotFoundError:
        return False
    return True


def summarize(snapshot: Snapshot) -> dict[str, Any]:
    """The JSON summary ``dstl checkpoints inspect`` prints."""
    meta = snapshot.meta
    files = sorted(meta.referenced_files())
    sizes = file_sizes(snapshot.base, snapshot.storage, files)
    chunk_paths: set[str] = set()
    operators: dict[str, Any] = {}
    for uid in sorted(meta.operators):
        subtasks = []
        for handle in snapshot.handles(uid):
            chunk_paths.update(str(c["path"]) for c in handle.materialized)
            segments = [seg for entry in handle.changelog for seg in entry.log.segments]
            subtasks.append(
                {
                    "key_group_range": handle.key_group_range.to_json(),
                    "states": handle.states,
                    "materialized": {
                        "chunks": len(handle.materialized),
                        "bytes": sum(int(c.get("size", 0)) for c in handle.materialized),
                        "entries": sum(int(c.get("entries", 0)) for c in handle.materialized),
                    },
                    "changelog": {
                        "entries": len(handle.changelog),
                        "segments": len(segments),
                        "bytes": sum(seg.length for seg in segments),
                        "records": sum(seg.records for seg in segments),
                    },
                }
            )
        operators[uid] = {
            "max_parallelism": meta.operators[uid].get("max_parallelism"),
            "parallelism": operator_parallelism(meta, uid),
            "subtasks": subtasks,
        }
    return {
        "path": snapshot.metadata_url,
        "directory": snapshot.base,
        "id": meta.checkpoint_id,
        "kind": meta.kind,
        "format": meta.format,
        "job": meta.job_id,
        "timestamp_ms": meta.timestamp_ms,
        "time": iso_time(meta.timestamp_ms),
        "properties": dict(meta.properties),
        "operators": operators,
        "files": [
            {"path": p, "kind": "chunk" if p in chunk_paths else "log", "size": sizes[p], "missing": sizes[p] is None}
            for p in files
        ],
        "total_files": len(files),
        "total_bytes": sum(s or 0 for s in sizes.values()),
    }


# -- restoring into scratch backends ---------------------------------------------------------


def restore_subtask(
    snapshot: Snapshot, uid: str, handles: Sequence[KeyedStateHandle], index: int, local_dir: Path
) -> ChangelogKeyedStateBackend:
    """A backend (LMDB in a new directory under ``local_dir``, no changelog) holding subtask
    ``index``'s key groups (the directory name does not come from the snapshot: uids are data)."""
    handle = handles[index]
    tables = tempfile.mkdtemp(prefix=f"subtask-{index}-", dir=local_dir)
    backend = ChangelogKeyedStateBackend(
        uid, handle.key_group_range, tables, storage=None,
        max_parallelism=handle.max_parallelism, log_enabled=False,
    )  # fmt: skip
    try:
        restore(backend, handles, source=snapshot.storage)
    except BaseException:
        backend.close()
        raise
    return backend


# -- offline savepoints ---------------------------------------------------------------------


def check_savepoint_target(target: str, source_base: str) -> None:
    """A new savepoint goes to a new or empty directory outside the source's directory."""
    if is_inside(target, source_base):
        raise CliError(f"the savepoint directory {target} must not lie inside {source_base} (a job would delete it)")
    if is_inside(source_base, target):
        raise CliError(f"the savepoint directory {target} must not contain the source {source_base}")
    if is_local(target) and os.path.exists(target):
        if not os.path.isdir(target):
            raise CliError(f"{target} exists and is not a directory")
        if os.listdir(target):
            raise CliError(f"{target} is not empty; choose a new or empty directory")
    elif not is_local(target):
        with open_storage(target) as storage:
            if storage.files.list(""):
                raise CliError(f"{target} is not empty; choose a new or empty directory")


def restore_all(
    snapshot: Snapshot, scratch: Path, stack: contextlib.ExitStack[Any], progress: Progress
) -> dict[str, list[ChangelogKeyedStateBackend]]:
    """Every subtask of every operator restored under ``scratch``; ``stack`` closes them."""
    operators: dict[str, list[ChangelogKeyedStateBackend]] = {}
    for uid in sorted(snapshot.meta.operators):
        handles = snapshot.handles(uid)
        backends = operators[uid] = []
        for index in range(len(handles)):
            progress(f"restore {uid}", index + 1, len(handles))
            backend = restore_subtask(snapshot, uid, handles, index, scratch)
            stack.callback(backend.close)
            backends.append(backend)
    return operators


def remove_partial(target: str, created: bool) -> None:
    """A failed savepoint leaves nothing: the target was new or empty (checked before)."""
    with contextlib.suppress(Exception):
        if not is_local(target):
            with open_storage(target) as storage:
                for path in storage.files.list(""):
                    storage.files.delete(path)
        elif created:
            shutil.rmtree(target, ignore_errors=True)
        else:
            for entry in os.listdir(target):
                full = os.path.join(target, entry)
                shutil.rmtree(full) if os.path.isdir(full) else os.unlink(full)
