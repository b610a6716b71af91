"""A local file written whole: the one atomic write of the project.

Why one helper: a crash (of the process or of the machine) must never leave a partial file under a
final name, and every local file we write is read back by a process that trusts it (a log file of
the local DFS, the changelog service's epoch, a Spark subtask's marker or handed-over
materialization, a routed operator's state directory, the Spark demo's input). So each is written
the same way: a temporary file in the same directory (a rename is atomic only within one file
system), written, fsynced, renamed over the final name, and the directory fsynced (without it the
rename itself may be lost by a machine crash, and the file with it).

``durable=False`` skips both fsyncs: the file is still whole or absent after a process crash, but
a machine crash may lose it or leave the previous one. Only a file that describes something not
synced itself wants that, where the fsyncs would be paid on a hot path for nothing: the markers
of ``backend.spark.tasks`` describe LMDB tables opened without fsync (a cache of the DFS), and
are written twice per subtask and batch.

The temporary name is ``.<name>.tmp-<8 hex>``: hidden (Spark's file source skips names starting
with a dot), never a final name of any caller, and its own per write (two writers of one name never
share a temporary). ``is_temporary`` tells one that a crash left behind.
"""

from __future__ import annotations

import contextlib
import os
import uuid

__all__ = ["fsync_directory", "is_temporary", "temporary_path", "write_atomically"]

#: what every temporary name holds (``is_temporary``)
TEMPORARY_MARK = ".tmp-"


def temporary_path(path: str | os.PathLike[str]) -> str:
    """A fresh temporary name for ``path``, in its directory (``.<name>.tmp-<8 hex>``)."""
    directory, name = os.path.split(os.fspath(path))
    return os.path.join(directory, f".{name}{TEMPORARY_MARK}{uuid.uuid4().hex[:8]}")


def is_temporary(name: str) -> bool:
    """Whether the file ``name`` (a path or a base name) is a temporary of ``write_atomically``."""
    base = os.path.basename(name)
    return base.startswith(".") and TEMPORARY_MARK in base


def fsync_directory(directory: str | os.PathLike[str]) -> None:
    """Make the entries of ``directory`` (a rename into it) durable."""
    fd = os.open(os.fspath(directory) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: str | os.PathLike[str], data: bytes | str, *, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` (a ``str`` is written as UTF-8), all or nothing; durable on
    return unless ``durable=False`` (module docstring). The directory must exist: it is never
    created (a caller whose directory is gone learns it, as ``FileNotFoundError``). On any error the
    temporary is removed and the error raised."""
    path = os.fspath(path)
    tmp = temporary_path(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_directory(os.path.dirname(path))
