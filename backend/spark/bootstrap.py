"""Bootstrap savepoints: the canonical savepoint the state data source writes, and a query starting from one.

**The savepoint.** ``df.write.format("dstl-state")...save(path)`` (``backend.spark.state_writer``)
writes one state of one operator per write. It is a canonical savepoint
(``backend.checkpointing.savepoints``) that restores at any parallelism::

    <path>/_metadata                                  kind savepoint, format canonical
    <path>/bootstrap/<write>/part-<task>-<attempt>.chunk   a write task's chunks, one per run of its key groups

Each write adds its state: its tasks write their files under a directory of the write's own,
then the commit on the driver, once every task succeeded, reads the ``_metadata`` there is (none
for the first write), adds the state (its metadata and its files, each file entry tagged with
the state's name) and puts the new ``_metadata``, the one commit point. So after every write the
savepoint is complete for the states it names, and the states of one operator are written by as
many writes as it has states, one after the other (two writes into one path at once may lose one
of them: the second commit reads the ``_metadata`` before the first put its own). Why not a
staging area and a final "finish" call: the savepoint of the states written so far is useful as it
is (a query started from it begins the others empty, as Spark begins a state a processor adds), and
a data source write has no call after its last task but its commit. ``mode("append")`` refuses a
state the savepoint holds already, ``mode("overwrite")`` replaces that state (its files are
deleted once the new ``_metadata`` is durable); the other states stay either way.

A failed write changes nothing a reader trusts: the first write's ``_metadata`` is put only by its
commit, so a directory without one is no savepoint (``read_snapshot`` refuses it), and a later
write leaves the ``_metadata`` as it was. Its files are deleted by ``abort`` (Spark calls it after
a task or the commit failed; what it cannot delete is named by no ``_metadata`` and is harmless),
unless the commit had begun the ``_metadata`` put (a put the client saw fail may land later and
name them: ``discard_write``), and the commit deletes the files of failed task attempts.

Every key group comes from one task: the commit refuses a write whose tasks wrote the same key
group (a list's elements or a map's entries split over two tasks, or a key twice, cannot be told
apart there), naming the key groups and the remedy, ``df.repartition(n, "key")`` with ``n``
dividing the max parallelism (Spark's hash partitioning of the ``key`` struct is the key group's
hash: ``backend.spark.spark_hash``). A DataFrame read from the state source and transformed row by
row keeps its partitions, each a range of key groups.

**Starting from it.** The operator option ``restore_from`` (a savepoint directory, or a ``chk-<b>``
of another state directory) is honoured while the operator's state directory holds no state, as
Flink's ``execution.savepoint.path`` is ignored once a job has checkpoints. The driver checks it
when the operator is bound (``check_restore_from``): the savepoint exists and holds the operator's
uid, with the same max parallelism and grouping key types (else the state would sit in key groups
no task looks in), and, before the state directory is even opened (its recovery deletes every file
there no checkpoint names: ``check_restore_location``), that it lies outside it. The tasks of the first batch that runs
restore their key groups of it (``restore_savepoint``: eagerly, through the savepoint's storage)
and materialize them fully into the state directory before their first snapshot (NO_CLAIM: no
checkpoint ever names a file of the savepoint, which may be deleted once the first checkpoint is
complete). A batch retried, or re-run after a driver restart before any checkpoint, restores it
again. The processor's schemas are checked against the written ones when it registers its states,
by Spark's evolution rules (``backend.spark.state_schemas``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

from backend.checkpointing.metadata import (
    METADATA_NAME,
    SnapshotMetadata,
    is_inside,
    read_snapshot,
    snapshot_location,
)
from backend.checkpointing.savepoints import handles_of
from backend.core.errors import CheckpointError
from backend.spark.config import OperatorConfig
from backend.spark.errors import GroupingKeyChangedError, StateSourceError
from backend.state.keyed_backend import ChangelogKeyedStateBackend
from dstl import ChangelogConfig, StateChangelogStorage
from dstl.api import DfsFiles
from dstl.paths import local_path
from materializer.periodic import PeriodicMaterializer, restore

__all__ = [
    "BOOTSTRAP_DIR",
    "check_restore_from",
    "check_restore_location",
    "check_savepoint_directory",
    "commit_state",
    "delete_write",
    "directory_url",
    "discard_write",
    "open_storage",
    "restore_savepoint",
    "write_dir",
]

_log = logging.getLogger(__name__)

#: the directory of the state data source's files in a savepoint
BOOTSTRAP_DIR = "bootstrap"
#: the file entry field naming the state a bootstrap file holds
STATE_FIELD = "state"
#: the operator part's field recording its grouping columns (name, Spark type)
GROUPING_KEY_FIELD = "grouping_key"
#: put in a write's directory before its ``_metadata`` put: from then on the put may land
COMMITTING = "_committing"


def directory_url(url: str) -> str:
    """A directory as every process reads it: a local one absolute (the tasks' working directory
    is not the driver's), a URL as given, without a trailing slash."""
    url = url.strip()
    local = local_path(url)
    return url.rstrip("/") if local is None else os.path.abspath(local)


def write_dir(write_id: str) -> str:
    """Where the tasks of one write put their files, relative to the savepoint."""
    return f"{BOOTSTRAP_DIR}/{write_id}"


@contextlib.contextmanager
def open_storage(config: ChangelogConfig, base: str) -> Iterator[StateChangelogStorage]:
    """A storage on ``base`` with ``config``'s DFS settings that never deletes a file by itself
    (the state data source's reads and writes, a restore from a savepoint)."""
    storage = StateChangelogStorage(replace(config, base_path=base), owns_files=False)
    try:
        yield storage
    finally:
        storage.close()


def _existing(files: DfsFiles) -> SnapshotMetadata | None:
    try:
        return read_snapshot(files)
    except CheckpointError:
        if METADATA_NAME in files.list(""):
            raise
        return None


def check_savepoint_directory(files: DfsFiles) -> SnapshotMetadata | None:
    """The bootstrap savepoint at ``files`` (None: an empty directory, or one holding only files of
    writes that failed); anything else is refused, so that no write lands in a checkpoint, a native
    savepoint or a directory of other files."""
    where = files.base_path
    meta = _existing(files)
    if meta is None:
        others = [p for p in files.list("") if not p.startswith(f"{BOOTSTRAP_DIR}/")]
        if others:
            raise StateSourceError(
                f"{where} is not empty and holds no savepoint (it has {others[0]}, ...): write the state into an empty "
                "directory, or into a savepoint the state data source wrote"
            )
        return None
    if meta.kind != "savepoint" or meta.format != "canonical":
        raise StateSourceError(
            f"{where} holds a {meta.format} {meta.kind}: the state data source adds states to canonical "
            "savepoints only (write into an empty directory)"
        )
    return meta


def check_operator(meta: SnapshotMetadata | None, where: str, uid: str, max_parallelism: int,
                   key: Sequence[tuple[str, str]], state: str, overwrite: bool) -> None:  # fmt: skip
    """Refuse adding ``state`` of operator ``uid`` to the savepoint ``meta`` where it would not fit:
    another max parallelism or grouping key types than the operator's states there, or a state it
    holds already (unless ``overwrite``) or that a job's savepoint holds in files of all states."""
    part = None if meta is None else meta.operators.get(uid)
    if part is None:
        return
    held = int(part.get("max_parallelism", 0))
    if held != max_parallelism:
        raise StateSourceError(
            f"{where}: operator {uid!r} has max parallelism {held} there, this write {max_parallelism} "
            "(option maxParallelism): the states of one operator share their key groups"
        )
    recorded = part.get(GROUPING_KEY_FIELD)
    if recorded is not None and [str(t) for _, t in recorded] != [t for _, t in key]:
        raise StateSourceError(
            f"{where}: operator {uid!r} has grouping key ({_columns(recorded)}) there, this write's key is "
            f"({_columns(key)}): the states of one operator share their keys"
        )
    if state in part.get("states", {}):
        if not overwrite:
            raise StateSourceError(
                f"{where}: operator {uid!r} has state {state!r} already; write with mode('overwrite') to replace it"
            )
        if any(STATE_FIELD not in f for f in part.get("files", ())):
            raise StateSourceError(
                f"{where}: state {state!r} of operator {uid!r} was written by a job's savepoint together with its "
                "other states and cannot be replaced alone; write into a new directory"
            )


def _columns(key: Sequence[Sequence[str]]) -> str:
    return ", ".join(f"{name} {dtype}" for name, dtype in key)


def commit_state(
    files: DfsFiles,
    *,
    write_id: str,
    uid: str,
    max_parallelism: int,
    key: Sequence[tuple[str, str]],
    state: str,
    state_meta: Mapping[str, Any],
    written: Sequence[Mapping[str, Any]],
    overwrite: bool,
) -> SnapshotMetadata:
    """Add ``state`` of operator ``uid`` (its metadata and the file entries ``written`` of write
    ``write_id``) to the savepoint at ``files`` and put its ``_metadata``; then delete the files the
    state had there before (``overwrite``). Checks the directory again: another write may have
    committed since. A marker put first (``COMMITTING``) tells ``discard_write`` that the put may
    land, whatever the client saw."""
    where = files.base_path
    meta = check_savepoint_directory(files)
    check_operator(meta, where, uid, max_parallelism, key, state, overwrite)
    operators = dict(meta.operators) if meta is not None else {}
    part = dict(operators.get(uid) or {"max_parallelism": max_parallelism, "states": {}, "files": []})
    replaced = [f for f in part.get("files", ()) if f.get(STATE_FIELD) == state]
    part["states"] = {**part.get("states", {}), state: dict(state_meta)}
    part["files"] = [f for f in part.get("files", ()) if f.get(STATE_FIELD) != state]
    part["files"] += [{**f, STATE_FIELD: state} for f in written]
    part.setdefault(GROUPING_KEY_FIELD, [list(column) for column in key])
    operators[uid] = part
    properties = dict(meta.properties) if meta is not None else {}
    properties["written_by"] = "dstl-state data source"
    new = SnapshotMetadata(
        meta.checkpoint_id if meta is not None else 0, operators, kind="savepoint", format="canonical",
        job_id=meta.job_id if meta is not None else "", timestamp_ms=time.time_ns() // 1_000_000,
        properties=properties,
    )  # fmt: skip
    new.referenced_files()  # every path checked before anything is written
    files.put(f"{write_dir(write_id)}/{COMMITTING}", b"")
    files.put(METADATA_NAME, new.dumps())
    still = new.referenced_files()
    _delete_quietly(files, sorted({str(f["path"]) for f in replaced} - still))
    return new


def delete_write(files: DfsFiles, write_id: str, keep: Sequence[str] = ()) -> None:
    """Delete the files of write ``write_id`` but ``keep`` (a failed write: all; a committed one:
    those of failed task attempts), never raising: a file left is named by no ``_metadata``."""
    try:
        found = files.list(write_dir(write_id))
    except Exception as exc:
        _log.warning("cannot list the files of state write %s in %s: %s", write_id, files.base_path, exc)
        return
    _delete_quietly(files, [p for p in found if p not in set(keep)])
    with contextlib.suppress(Exception):
        if files.remove_empty_directory(write_dir(write_id)):
            files.remove_empty_directory(BOOTSTRAP_DIR)


def discard_write(files: DfsFiles, write_id: str) -> None:
    """Delete the files of a failed write, unless its commit began the ``_metadata`` put
    (``COMMITTING``): a put the client saw fail may land later and name them, so they stay (named
    then, else harmless). Also when the directory cannot be listed. Never raises."""
    try:
        found = files.list(write_dir(write_id))
    except Exception as exc:
        _log.warning("state write %s in %s: its files stay, the directory cannot be listed: %s",
                     write_id, files.base_path, exc)  # fmt: skip
        return
    if f"{write_dir(write_id)}/{COMMITTING}" in found:
        _log.warning("state write %s in %s failed after its metadata put began: its files stay (the put may land)",
                     write_id, files.base_path)  # fmt: skip
        return
    delete_write(files, write_id)


def _delete_quietly(files: DfsFiles, paths: Sequence[str]) -> None:
    for path in paths:
        try:
            files.delete(path)
        except Exception as exc:
            _log.warning("cannot delete %s/%s (named by no savepoint metadata now): %s", files.base_path, path, exc)


# -- starting a query from a savepoint ---------------------------------------------------------------


def check_restore_location(cfg: OperatorConfig) -> None:
    """Before the driver opens the operator's state directory (whose recovery deletes every file
    there no checkpoint names): refuse a ``restore_from`` inside it, or around it."""
    if cfg.restore_from is None:
        return
    base, _ = snapshot_location(cfg.restore_from)
    if is_inside(base, cfg.job_dir) or is_inside(cfg.job_dir, base):
        raise CheckpointError(
            f"restore_from {cfg.restore_from} and the state directory {cfg.job_dir} of operator {cfg.uid!r} overlap: "
            "the operator's cleanup deletes every file there no checkpoint names; keep the savepoint elsewhere"
        )


def check_restore_from(cfg: OperatorConfig) -> None:
    """On the driver, when the operator is bound and its state directory holds no state: refuse a
    ``restore_from`` the tasks could not start from (module docstring), naming the problem."""
    assert cfg.restore_from is not None
    base, where = snapshot_location(cfg.restore_from)
    with open_storage(cfg.changelog, base) as storage:
        meta = read_snapshot(storage.files, where)
    if cfg.uid not in meta.operators:
        held = ", ".join(repr(u) for u in sorted(meta.operators)) or "none"
        raise CheckpointError(
            f"restore_from {cfg.restore_from} holds no state of operator {cfg.uid!r} (it holds operators {held}): "
            "write the state with option operatorId set to the operator's uid"
        )
    part = meta.operators[cfg.uid]
    held_parallelism = int(part.get("max_parallelism", 0)) if meta.format == "canonical" else None
    if held_parallelism is None and meta.handles(cfg.uid):
        held_parallelism = meta.handles(cfg.uid)[0].max_parallelism
    if held_parallelism is not None and held_parallelism != cfg.max_parallelism:
        raise CheckpointError(
            f"restore_from {cfg.restore_from}: operator {cfg.uid!r} has max parallelism {held_parallelism} there and "
            f"{cfg.max_parallelism} in this query: its keys would be looked for in other key groups; start the query "
            f"with max_parallelism={held_parallelism}"
        )
    recorded = part.get(GROUPING_KEY_FIELD)
    if recorded is not None and cfg.grouping_key:
        old, new = [str(t) for _, t in recorded], [t for _, t in cfg.grouping_key]
        if old != new:
            raise GroupingKeyChangedError(
                cfg.uid, ", ".join(n for n, _ in cfg.grouping_key), ", ".join(old), ", ".join(new)
            )


def restore_savepoint(
    cfg: OperatorConfig, backend: ChangelogKeyedStateBackend, materializer: PeriodicMaterializer
) -> None:
    """In a task, on a fresh backend: load its key groups of ``cfg.restore_from`` and materialize
    them into the state directory, so that its first snapshot names files of its own only."""
    assert cfg.restore_from is not None
    base, where = snapshot_location(cfg.restore_from)
    with open_storage(cfg.changelog, base) as storage:
        meta = read_snapshot(storage.files, where)
        if cfg.uid not in meta.operators:
            raise CheckpointError(f"restore_from {cfg.restore_from} holds no state of operator {cfg.uid!r}")
        restore(backend, handles_of(meta, cfg.uid), source=storage, mode="eager")
    backend.disown_restored()
    materializer.wait()
    materializer.trigger()
    materializer.wait()
    if backend.needs_full_materialization:
        raise CheckpointError(
            f"operator {cfg.uid!r} (key groups {backend.key_group_range.start}-{backend.key_group_range.end}): the "
            f"materialization of the state restored from {cfg.restore_from} into {cfg.job_dir} failed"
        )
