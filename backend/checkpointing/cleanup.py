"""Orphan cleanup: delete the DFS files that no retained snapshot references.

The storage deletes the log files it owns once nothing uses them; files a *confirmed* checkpoint
owns (log files and materialized chunks) are the business of whoever retains checkpoints. Jobs
have ``backend.checkpointing.store.CompletedCheckpointStore.recover`` for that (registry + whole job
directory); this helper applies the same rule to bare backends that keep their own handles: keep
exactly what the retained handles reference, under the storage's ``dstl/`` and ``shared/``.

Only call it when no checkpoint or materialization is in flight: their files are not referenced
by any retained handle yet.
"""

from __future__ import annotations

from collections.abc import Iterable

from backend.core.handles import KeyedStateHandle
from dstl.api import DfsFiles

PREFIXES = ("dstl", "shared")


def referenced_files(handles: Iterable[KeyedStateHandle]) -> set[str]:
    paths: set[str] = set()
    for handle in handles:
        paths |= handle.referenced_files()
    return paths


def delete_unreferenced(files: DfsFiles, retained: Iterable[KeyedStateHandle]) -> list[str]:
    """Delete every file under ``dstl/`` and ``shared/`` that ``retained`` does not reference;
    returns the deleted paths."""
    keep = referenced_files(retained)
    deleted = []
    for prefix in PREFIXES:
        for path in files.list(prefix):
            if path not in keep:
                files.delete(path)
                deleted.append(path)
    return deleted
