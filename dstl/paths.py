"""Paths under the storage's base path: the one "inside the root" check and new log file names.

Every path the log hands to an uploader is relative to the base path. Handles and checkpoint
metadata come from storage, so a crafted one must not make us read or delete foreign files:
``check_relative`` is the single place that refuses a path leaving the root, and every uploader
and caller above the log (``backend.checkpointing``) goes through it.
"""

from __future__ import annotations

import posixpath
import uuid

from dstl.errors import ConfigurationError

__all__ = ["LOG_DIRECTORY", "check_relative", "new_file_name"]

#: the directory, under the base path, of the changelog files (``dstl/<prefix>/<uuid>``)
LOG_DIRECTORY = "dstl"


def check_relative(path: str) -> str:
    """Normalize a storage-relative path, refusing anything that leaves the base directory
    (``ConfigurationError``; a caller reading the path from stored data wraps it in its own
    corrupt-data error, e.g. ``CheckpointError``)."""
    if not path or path.startswith("/") or "\\" in path or "://" in path:
        raise ConfigurationError(f"path {path!r} is not relative to the changelog base path")
    norm = posixpath.normpath(path)
    if norm == ".." or norm.startswith("../") or norm == ".":
        raise ConfigurationError(f"path {path!r} points outside the changelog base path")
    return norm


def new_file_name(prefix_count: int) -> str:
    """``dstl/<prefix>/<uuid>``: random names spread over many prefixes (S3 partitions by prefix;
    Flink users hit "too many files in one directory")."""
    ident = uuid.uuid4()
    return f"{LOG_DIRECTORY}/{ident.int % prefix_count:02x}/{ident.hex}"
