"""Paths under the storage's base path: the one "inside the root" check, new log file names, and
the one rule for what a local base path or URL is.

Every path the log hands to an uploader is relative to the base path. Handles and checkpoint
metadata come from storage, so a crafted one must not make us read or delete foreign files:
``check_relative`` is the single place that refuses a path leaving the root, and every uploader
and caller above the log (``backend.checkpointing``) goes through it.

A base path is local when it has no URL scheme or is a ``file://`` URL (``local_path``): callers
that work on a local directory directly (comparing real paths, removing empty directories, listing
snapshots) ask this one rule, so that a plain path and its ``file://`` spelling always agree.
"""

from __future__ import annotations

import posixpath
import uuid

from dstl.errors import ConfigurationError

__all__ = ["LOG_DIRECTORY", "check_relative", "is_local", "local_path", "new_file_name"]

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


def local_path(url: str) -> str | None:
    """The local path ``url`` names (a plain path, or a ``file://`` URL without its scheme), or
    None for a URL of another file system (``s3://``, ``memory://``, ...)."""
    if "://" not in url:
        return url
    if url.startswith("file://"):
        return url.removeprefix("file://")
    return None


def is_local(url: str) -> bool:
    """Whether ``url`` is a local directory or file (``local_path``)."""
    return local_path(url) is not None
