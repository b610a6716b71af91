"""Hands a materialization that finished in the background to whichever worker runs its subtask next.

Why: a task only starts its subtask's materialization; the upload goes on in the background, so
no batch waits for it. The next batch of that subtask may run in another Python worker of the
host, which adopts the local tables with a changelog writer of its own and never sees the first
worker's materializer (and idle workers exit). So the upload, once its chunks are durable, leaves
its result in the subtask's local directory: ``materialized-<random>.json`` holding the chunks,
the log and SQN they cover and the directory's life (``result_writer``). A task that finds the
materialization done in its own process applies it there (``PeriodicMaterializer.poll``);
the file is for the others.

Each task offers the results it finds to its backend while it holds the subtask's lock, right
after acquiring the backend (``take_results``), so only a task that starts after a result was
written can apply it, and only through ``ChangelogKeyedStateBackend.adopt_materialization``,
which takes it only if the lineage still ends with the log it covers. Before that the chunks are
checked to be on the DFS: a result left by a worker of an earlier application may name chunks
the driver's start-up cleanup has deleted since. Everything that does not apply (the state moved
on to another log, the directory was rebuilt from the DFS since: another life, the chunks are
gone) is deleted, except a result of the backend's own log that its materializer has yet to
apply; the chunks such a result uploaded are orphans the driver's cleanup deletes (workers never
delete DFS files).

A result is written whole and durably (``dstl.atomic``) and never under the subtask's
lock, so a running task never waits for an upload to finish, nor a finished upload for a task.
"""

from __future__ import annotations

import contextlib
import json
import logging
import posixpath
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backend.core.handles import check_chunk_entry
from backend.state.keyed_backend import ChangelogKeyedStateBackend
from dstl import ChangelogStorage, KeyGroupRange
from dstl.atomic import write_atomically
from materializer.periodic import MaterializationResult

__all__ = ["RESULT_PREFIX", "result_writer", "take_results"]

_log = logging.getLogger(__name__)

RESULT_PREFIX = "materialized-"


@dataclass(frozen=True)
class _Found:
    path: Path
    life: str
    result: MaterializationResult


def result_writer(directory: Path, life: str) -> Callable[[MaterializationResult], None]:
    """An ``on_result`` for the materializer of the subtask whose local directory is ``directory``
    in its life ``life``; runs in the upload thread."""

    def write(result: MaterializationResult) -> None:
        name = f"{RESULT_PREFIX}{uuid.uuid4().hex}.json"
        body = {
            "life": life,
            "log_id": result.log_id,
            "sqn": result.sqn,
            "key_groups": result.key_group_range.to_json(),
            "chunks": list(result.chunks),
        }
        # never creates the directory: gone means a task rebuilt it, and this result is void
        with contextlib.suppress(OSError):
            write_atomically(directory / name, json.dumps(body))

    return write


def take_results(directory: Path, life: str, backend: ChangelogKeyedStateBackend, storage: ChangelogStorage) -> bool:
    """Offer the results in ``directory`` to ``backend``, newest first; True if it took one. The
    caller holds the subtask's lock."""
    assert backend.writer is not None
    own = backend.writer.log_id
    taken = False
    for found in sorted(_results(directory), key=lambda f: -f.result.sqn):
        result = found.result
        if found.life == life and result.log_id == own and result.sqn > backend.materialized_sqn:
            continue  # this backend's own materialization, which its materializer applies
        if not taken and found.life == life and result.log_id != own and _on_the_dfs(storage, result):
            taken = backend.adopt_materialization(result.log_id, result.sqn, result.key_group_range, result.chunks)
        with contextlib.suppress(OSError):
            found.path.unlink()  # applied now, or it never will be
    return taken


def _results(directory: Path) -> list[_Found]:
    found: list[_Found] = []
    for path in directory.glob(f"{RESULT_PREFIX}*.json"):
        try:
            value = json.loads(path.read_text())
            result = MaterializationResult(
                log_id=_typed(value["log_id"], str),
                sqn=_typed(value["sqn"], int),
                key_group_range=KeyGroupRange.from_json(value["key_groups"]),
                chunks=tuple(check_chunk_entry(c) for c in _typed(value["chunks"], list)),
            )
            found.append(_Found(path, _typed(value["life"], str), result))
        except FileNotFoundError:
            continue
        except (OSError, ValueError, KeyError, TypeError):
            with contextlib.suppress(OSError):
                path.unlink()  # damaged: never applies
    return found


def _typed(value: Any, kind: type) -> Any:
    if type(value) is not kind:
        raise TypeError(f"expected {kind.__name__}, got {value!r}")
    return value


def _on_the_dfs(storage: ChangelogStorage, result: MaterializationResult) -> bool:
    """Whether every chunk of ``result`` exists (one listing per directory of chunks)."""
    paths = {str(c["path"]) for c in result.chunks}
    try:
        for parent in {posixpath.dirname(p) for p in paths}:
            paths -= set(storage.files.list(parent))
    except Exception as exc:  # the result is an optimization: a DFS hiccup here must not fail the task
        _log.warning("cannot check the chunks of a materialization in %s: %s", storage.config.base_path, exc)
        return False
    return not paths
