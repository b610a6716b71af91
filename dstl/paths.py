"""Paths and names: the "inside the root" check, log file names, local URLs, operator uids.

Each is one rule, defined here, the lowest layer that needs it.

Every path the log hands to an uploader is relative to the base path. Handles and checkpoint
metadata come from storage, so a crafted one must not make us read or delete foreign files:
``check_relative`` is the single place that refuses a path leaving the root, and every uploader
and caller above the log (``backend.checkpointing``) goes through it.

An operator uid (and a job id) becomes a directory name, on the DFS (``pending/<b>/<uid>``), on
local disk (each subtask's LMDB directory) and in log ids, so what one may be is one rule,
``check_name``: not empty, no ``/``, ``\\`` or NUL, not ``.`` or ``..``. It is checked where
a name enters (``OperatorSpec`` and ``LocalJob``, Spark's ``operator_uid`` on the driver, a
writer of the storage), so a bad one is refused at once, naming it, never later on an executor.
``as_name`` makes a valid name of any text (a routed operator's class name), keeping only letters,
digits, ``_``, ``-`` and ``.``, as routed uids always were.

A base path is local when it has no URL scheme or is a ``file://`` URL (``local_path``): callers
that work on a local directory directly (comparing real paths, removing empty directories, listing
snapshots) ask this one rule, so that a plain path and its ``file://`` spelling always agree.
"""

from __future__ import annotations

import posixpath
import re
import uuid

from dstl.errors import ConfigurationError

__all__ = [
    "LOG_DIRECTORY",
    "as_name",
    "check_name",
    "check_relative",
    "is_local",
    "local_path",
    "new_file_name",
]

#: the directory, under the base path, of the changelog files (``dstl/<prefix>/<uuid>``)
LOG_DIRECTORY = "dstl"
#: what a name (an operator uid, a job id) may not hold: it names one directory level of a local
#: path and of an object store key alike
_NOT_IN_NAME = re.compile(r"[/\\\x00]")
#: what a name derived from other text (``as_name``) replaces: kept conservative, since the names it
#: derives (a routed operator's uid) name existing state directories
_NOT_IN_DERIVED_NAME = re.compile(r"[^A-Za-z0-9_.\-]")


def check_name(name: str, what: str = "operator uid") -> str:
    """``name`` if it may name an operator (``what``: or a job, ...), else ``ConfigurationError``
    naming it and the rule: not empty, no ``/``, ``\\`` or NUL, and not ``.`` or ``..``."""
    if not isinstance(name, str) or not name or _NOT_IN_NAME.search(name) or name in (".", ".."):
        raise ConfigurationError(
            f"{what} {name!r} must be a non-empty name without '/', '\\' or NUL, and not '.' or '..': "
            "it names a directory"
        )
    return name


def as_name(text: str) -> str:
    """``text`` as a valid name: every character but letters, digits, ``_``, ``-`` and ``.``
    replaced by ``-`` (the rule ``routed_uid`` has always derived uids by)."""
    return _NOT_IN_DERIVED_NAME.sub("-", text)


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
