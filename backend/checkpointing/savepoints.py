"""Savepoints (native and canonical), restore modes, and restoring a job's operators by uid.

A savepoint is a directory with a ``_metadata`` (``backend.checkpointing.metadata.SnapshotMetadata``, kind
``savepoint``) and the files it names, every path relative to the directory: move the directory
and it still restores.

- **native**: the handles of a checkpoint plus a copy of every file they name (materialized chunks
  and log files, same relative paths). Restores exactly like the checkpoint; cheap to take.
- **canonical**: per operator and subtask, one file with every key/value record of every state
  (chunk format of ``materializer.chunks``: per state, sorted ``(key group | key | user key,
  value)`` records) and the state metadata; no log, no materialization history, nothing of the
  backend's incremental structure: any backend that reads the chunk format can load it, at any
  parallelism. A file entry may also name a chunk at an ``offset`` of a file holding several, and
  entries may cover the same key groups where they hold other keys or states (the state data
  source writes one state at a time, ``backend.spark.bootstrap``).

Restore modes (Flink's ``execution.savepoint-restore-mode``), for a snapshot outside the job
directory:

- ``NO_CLAIM`` (default): the snapshot is read and never touched again; each subtask materializes
  its whole state into the job's own files before the first checkpoint, so no checkpoint depends
  on the snapshot (Flink's changelog backend does not support this mode).
- ``CLAIM``: the job takes the snapshot over. Checkpoints only ever name files inside the job
  directory, so native files are copied in and restored from there (no re-materialization), and
  the snapshot directory is deleted once the first checkpoint completes (it is subsumed).
- ``LEGACY``: like CLAIM's copy, but the snapshot is never deleted.

Canonical savepoints have no native files, so every mode restores them as NO_CLAIM does; CLAIM
still deletes the savepoint after the first checkpoint.

State loading (``StateLoading``, the option ``state_loading`` of ``LocalJob`` and of the Spark
operators, default "lazy" in both; a name of its own, as ``restore_mode`` is taken by the modes
above), for any restore:

- ``"eager"``: every owned chunk is loaded and the log replayed before the first key is served;
- ``"lazy"`` (``backend.state.lazy``): the restore reads the chunks' indexes, the timers and the
  log, a key is loaded when first used, and its owner loads the rest between units of work
  (``hydrate_step``) until the backend is ``fully_local``. A NO_CLAIM restore reads the snapshot's
  files until then, and is fully loaded before the first checkpoint, whose materialization needs
  every key.
"""

from __future__ import annotations

import contextlib
import enum
import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Literal

from backend.checkpointing.metadata import METADATA_NAME, Progress, SnapshotMetadata, no_progress, read_snapshot
from backend.core.errors import CheckpointError
from backend.core.handles import (
    CHUNK_HASH,
    HANDLE_VERSION,
    OLDEST_HANDLE_VERSION,
    KeyedStateHandle,
    check_chunk_entry,
    chunk_digest,
)
from backend.state.keyed_backend import ChangelogKeyedStateBackend
from backend.state.restore import merge_metadata
from dstl.api import DfsFiles
from dstl.errors import ConfigurationError
from dstl.paths import local_path
from dstl.types import KeyGroupRange
from materializer.chunks import encode_chunk
from materializer.periodic import read_sections

#: how a restore loads the state (module docstring)
StateLoading = Literal["eager", "lazy"]
STATE_LOADINGS: tuple[StateLoading, ...] = ("eager", "lazy")


def check_state_loading(value: object, option: str = "state_loading") -> StateLoading:
    """``value`` as a ``StateLoading``, or ``ConfigurationError`` naming ``option`` and the choices."""
    if value not in STATE_LOADINGS:
        raise ConfigurationError(
            f"{option} must be 'eager' (load everything at restore) or 'lazy' (load a key when first used), "
            f"got {value!r}"
        )
    return value


class RestoreMode(enum.Enum):
    CLAIM = "CLAIM"
    NO_CLAIM = "NO_CLAIM"
    LEGACY = "LEGACY"


def copy_files(source: DfsFiles, target: DfsFiles, paths: Sequence[str], progress: Progress) -> int:
    copied = 0
    for i, path in enumerate(sorted(paths)):
        try:
            data = source.get(path)
        except FileNotFoundError:
            raise CheckpointError(f"{source.base_path}/{path} is missing: the snapshot is incomplete") from None
        target.put(path, data)
        copied += len(data)
        progress("copy", i + 1, len(paths))
    return copied


def write_native_savepoint(
    checkpoint: SnapshotMetadata,
    source: DfsFiles,
    target: DfsFiles,
    progress: Progress = no_progress,
) -> SnapshotMetadata:
    """Copy a checkpoint's files from ``source`` (its job directory) into ``target`` and write
    ``_metadata`` last: a savepoint directory without it is an aborted savepoint."""
    if checkpoint.format != "native":
        raise CheckpointError("a native savepoint is made from a native checkpoint")
    _refuse_existing(target)
    copy_files(source, target, sorted(checkpoint.referenced_files()), progress)
    meta = replace(checkpoint, kind="savepoint")
    target.put(METADATA_NAME, meta.dumps())
    return meta


def write_canonical_savepoint(
    operators: Mapping[str, Sequence[ChangelogKeyedStateBackend]],
    target: DfsFiles,
    *,
    checkpoint_id: int,
    job_id: str = "",
    timestamp_ms: int = 0,
    progress: Progress = no_progress,
) -> SnapshotMetadata:
    """Dump every subtask's full state, one file per subtask, from a consistent view of its tables."""
    _refuse_existing(target)
    parts: dict[str, dict[str, Any]] = {}
    total = sum(len(b) for b in operators.values())
    done = 0
    for index, (uid, backends) in enumerate(sorted(operators.items())):
        files: list[dict[str, Any]] = []
        states: dict[str, dict[str, Any]] = {}
        max_parallelism = backends[0].max_parallelism if backends else 0
        for backend in backends:
            txn, databases = backend.consistent_view()
            try:
                rng = backend.key_group_range
                sections = read_sections(txn, databases, rng)
                merge_metadata(states, backend.state_metadata())  # subtasks may differ in schema versions
            finally:
                txn.abort()
            if sections:
                data = encode_chunk(rng, 0, sections)
                path = f"canonical/op-{index}/kg-{rng.start}-{rng.end}.chunk"
                target.put(path, data)
                entries = sum(len(v) for v in sections.values())
                files.append({"path": path, "key_groups": rng.to_json(), "size": len(data), "entries": entries,
                              CHUNK_HASH: chunk_digest(data)})  # fmt: skip
            done += 1
            progress("dump", done, total)
        parts[uid] = {"max_parallelism": max_parallelism, "states": states, "files": files}
    meta = SnapshotMetadata(
        checkpoint_id, parts, kind="savepoint", format="canonical", job_id=job_id, timestamp_ms=timestamp_ms
    )
    target.put(METADATA_NAME, meta.dumps())
    return meta


def _refuse_existing(target: DfsFiles) -> None:
    if target.list(""):
        raise CheckpointError(f"{target.base_path} is not empty (it may hold a snapshot already)")


def handles_of(meta: SnapshotMetadata, uid: str) -> list[KeyedStateHandle]:
    """The handles to restore operator ``uid`` from; canonical files become handles of one
    materialized chunk each (their bulk load is the same as a materialization's)."""
    if meta.format == "native":
        return meta.handles(uid)
    part = meta.operators[uid]
    try:
        max_parallelism = int(part["max_parallelism"])
        states = dict(part["states"])
        handles = []
        for f in part["files"]:
            rng = KeyGroupRange.from_json(f["key_groups"])
            chunk = {"path": f["path"], "key_groups": rng.to_json(), "scope": rng.to_json(), "sqn": 0,
                     "size": int(f["size"]), "entries": int(f["entries"])}  # fmt: skip
            if CHUNK_HASH in f:  # savepoints written before the hash: bound by size and entries only
                chunk[CHUNK_HASH] = f[CHUNK_HASH]
            if "offset" in f:  # a chunk inside a file of several (the state data source's bootstrap writes)
                chunk["offset"] = f["offset"]
            check_chunk_entry(chunk, HANDLE_VERSION if CHUNK_HASH in f else OLDEST_HANDLE_VERSION)
            handles.append(KeyedStateHandle(uid, max_parallelism, rng, states, (), (chunk,)))
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"canonical savepoint entry of operator {uid!r} is malformed: {exc}") from None
    return handles


def check_operators(meta: SnapshotMetadata, uids: Sequence[str], allow_non_restored_state: bool) -> None:
    """Every operator in the snapshot must exist in the job, unless ``allow_non_restored_state``."""
    missing = sorted(set(meta.operators) - set(uids))
    if missing and not allow_non_restored_state:
        raise CheckpointError(
            f"the snapshot holds state of operators {missing} that this job does not have; "
            "restore with allow_non_restored_state=True to drop it"
        )


def dispose_savepoint(directory: DfsFiles, progress: Progress = no_progress) -> int:
    """Delete a savepoint: ``_metadata`` first (from then on it is gone, a crash leaves only
    unreferenced files), then every file it names. Returns the number of files deleted."""
    meta = read_snapshot(directory)
    if meta.kind != "savepoint":
        raise CheckpointError(f"{directory.base_path} is a checkpoint, not a savepoint: not disposing it")
    files = sorted(meta.referenced_files())
    directory.delete(METADATA_NAME)
    for i, path in enumerate(files):
        directory.delete(path)
        progress("delete", i + 1, len(files))
    _remove_empty_dirs(directory.base_path)
    return len(files) + 1


def _remove_empty_dirs(base: str) -> None:
    root = local_path(base)
    if root is None:
        return
    for current, _, _ in sorted(os.walk(root), key=lambda w: -len(w[0])):
        with contextlib.suppress(OSError):
            os.rmdir(current)
