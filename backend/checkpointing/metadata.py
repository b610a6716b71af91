"""The layout of a job directory and the ``_metadata`` of its snapshots: the one home of both.

Layout of a job directory (the changelog storage's base path is ``<root>/<job>``)::

    <root>/<job>/chk-<n>/_metadata               one per completed checkpoint (JSON, relative paths)
    <root>/<job>/chk-<n>/_aborted                the fence of a checkpoint whose _metadata write failed
    <root>/<job>/_ids/<start>-<end>               checkpoint ids start..end reserved by one run
    <root>/<job>/_void/<first>-<last>             checkpoint ids a restart voided: a _metadata of one of
                                                  them landing later is never a checkpoint
    <root>/<job>/_owner/<epoch>.run.<run>         the claim of the run owning the directory from epoch on
    <root>/<job>/_owner/<epoch>.bind.<hash>.<n>   a Spark query binding the directory (``ownership``)
    <root>/<job>/shared/<uuid>.chunk              materialized chunks, back to back (packs)
    <root>/<job>/dstl/<xx>/<uuid>                 changelog files
    <root>/<job>/pending/<b>/<uid>/<uuid>.dstl    Spark: changelog files of batch b whose notes are the
                                                  subtasks' records (handles) of that batch

A savepoint directory holds ``_metadata`` at its top and the files it names below it.

Why one module: the coordinator, the completed-checkpoint store, savepoints, the Spark driver and
tasks and the command line all find checkpoints by these names; a second spelling of the
``chk-<n>`` rule would let one of them miss (or delete) what another wrote. The parsing of
``_metadata`` lives here too because every reader must apply the same checks (format tag,
version, checksum, every path relative and inside) before trusting a path it names.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from backend.core.errors import CheckpointError, StateRestoreError
from backend.core.handles import KeyedStateHandle
from dstl.api import DfsFiles
from dstl.paths import check_relative, local_path

__all__ = [
    "ABORTED_NAME",
    "CHECKPOINT_PREFIX",
    "IDS_DIR",
    "METADATA_FORMAT",
    "METADATA_NAME",
    "METADATA_VERSION",
    "OWNER_DIR",
    "PENDING_DIR",
    "VOID_DIR",
    "Progress",
    "SnapshotMetadata",
    "aborted_path",
    "checked_path",
    "checkpoint_dir",
    "id_block_path",
    "in_checkpoint_dir",
    "is_inside",
    "is_noted_pending",
    "metadata_path",
    "no_progress",
    "parse_checkpoint_dir",
    "parse_id_block_path",
    "parse_metadata_path",
    "parse_pending_path",
    "parse_void_range_path",
    "pending_dir",
    "read_snapshot",
    "snapshot_location",
    "void_range_path",
]

METADATA_VERSION = 1
METADATA_FORMAT = "dstl-snapshot"
METADATA_NAME = "_metadata"
ABORTED_NAME = "_aborted"
CHECKPOINT_PREFIX = "chk-"
PENDING_DIR = "pending"
IDS_DIR = "_ids"
VOID_DIR = "_void"
OWNER_DIR = "_owner"

_CHECKPOINT_DIR = re.compile(rf"^{CHECKPOINT_PREFIX}(\d+)$")
_PENDING_PATH = re.compile(rf"^{PENDING_DIR}/(\d+)/([^/]+)/(?:[0-9a-f]{{32}}\.dstl|\d+(?:-\d+)?\.json)$")
#: the suffix of a changelog file with notes (``dstl.scheduler`` names them so)
NOTED_SUFFIX = ".dstl"
_ID_BLOCK_PATH = re.compile(rf"^{IDS_DIR}/(\d+)-(\d+)$")
_VOID_RANGE_PATH = re.compile(rf"^{VOID_DIR}/(\d+)-(\d+)$")

#: A progress report: ``(what, done, total)``, e.g. ``("copy", 3, 10)``; called after each unit.
Progress = Callable[[str, int, int], None]


def no_progress(what: str, done: int, total: int) -> None:
    """The default ``Progress``: report nothing."""
    return None


# -- names in a job directory -----------------------------------------------------------------


def checkpoint_dir(checkpoint_id: int) -> str:
    """``chk-<n>``: the directory of checkpoint ``n``, relative to the job directory."""
    return f"{CHECKPOINT_PREFIX}{checkpoint_id}"


def metadata_path(checkpoint_id: int) -> str:
    """``chk-<n>/_metadata``: the commit point of checkpoint ``n``, relative to the job directory."""
    return f"{checkpoint_dir(checkpoint_id)}/{METADATA_NAME}"


def aborted_path(checkpoint_id: int) -> str:
    """``chk-<n>/_aborted``: the fence of checkpoint ``n``, written when its ``_metadata`` write
    failed; recovery ignores a ``_metadata`` next to it (a write the client gave up on may land later)."""
    return f"{checkpoint_dir(checkpoint_id)}/{ABORTED_NAME}"


def parse_checkpoint_dir(name: str) -> int | None:
    """The ``n`` of a ``chk-<n>`` directory name, or None for any other name."""
    match = _CHECKPOINT_DIR.match(name)
    return int(match.group(1)) if match else None


def parse_metadata_path(path: str) -> int | None:
    """The ``n`` of a ``chk-<n>/_metadata`` path, or None for any other path."""
    head, _, rest = path.partition("/")
    return parse_checkpoint_dir(head) if rest == METADATA_NAME else None


def id_block_path(start: int, end: int) -> str:
    """``_ids/<start>-<end>``: the reservation of checkpoint ids ``start..end`` by one run
    (``backend.checkpointing.ids``)."""
    return f"{IDS_DIR}/{start}-{end}"


def parse_id_block_path(path: str) -> tuple[int, int] | None:
    """``(start, end)`` of an ``id_block_path``, or None for any other path."""
    match = _ID_BLOCK_PATH.match(path)
    return (int(match.group(1)), int(match.group(2))) if match else None


def void_range_path(first: int, last: int) -> str:
    """``_void/<first>-<last>``: checkpoint ids ``first..last`` that a restart voided (a run that
    crashed or was fenced may still have a ``_metadata`` put of one of them in flight)."""
    return f"{VOID_DIR}/{first}-{last}"


def parse_void_range_path(path: str) -> tuple[int, int] | None:
    """``(first, last)`` of a ``void_range_path``, or None for any other path."""
    match = _VOID_RANGE_PATH.match(path)
    return (int(match.group(1)), int(match.group(2))) if match else None


def in_checkpoint_dir(path: str) -> bool:
    """Whether ``path`` lies in (or is) a directory named like a checkpoint's. Looser than
    ``parse_checkpoint_dir`` on purpose: no state file may hide under a ``chk-`` name at all."""
    return path.partition("/")[0].startswith(CHECKPOINT_PREFIX)


def pending_dir(batch: int, uid: str | None = None) -> str:
    """``pending/<b>`` (or ``pending/<b>/<uid>``): where Spark tasks leave the handles of batch ``b``."""
    return f"{PENDING_DIR}/{batch}" if uid is None else f"{PENDING_DIR}/{batch}/{uid}"


def parse_pending_path(path: str) -> tuple[int, str] | None:
    """``(batch, uid)`` of a file the Spark tasks left under ``pending/<b>/<uid>/``, or None for
    any other path: a changelog file whose notes are the subtasks' records (``<uuid>.dstl``), or a
    JSON record of an earlier version (``<i>.json``, ``<i>-<j>.json``)."""
    match = _PENDING_PATH.match(path)
    return (int(match.group(1)), match.group(2)) if match else None


def is_noted_pending(path: str) -> bool:
    """Whether a pending file is a changelog file whose notes hold the records (not JSON)."""
    return path.endswith(NOTED_SUFFIX)


def snapshot_location(url: str) -> tuple[str, str]:
    """(directory the snapshot's paths are relative to, path of its ``_metadata`` in it) for a
    savepoint directory, a ``chk-<n>`` directory, or either's ``_metadata`` file."""
    url = url.rstrip("/")
    local = local_path(url)
    if local is not None:  # one spelling of a local directory: absolute, ``file://`` dropped
        url = os.path.abspath(local)
    url = url.removesuffix(f"/{METADATA_NAME}")
    parent, _, last = url.rpartition("/")
    if parse_checkpoint_dir(last) is not None and parent:
        return parent, f"{last}/{METADATA_NAME}"
    return url, METADATA_NAME


def is_inside(path_or_url: str | os.PathLike[str], directory: str | os.PathLike[str]) -> bool:
    """Whether ``path_or_url`` is ``directory`` or lies below it (a job directory, a snapshot's).

    Local paths (``file://`` or none) are compared by ``os.path.realpath``, so that neither a
    relative spelling nor a symlink hides that a savepoint would land in a job directory (where
    the job's cleanup would delete it); other URLs are compared as strings without a trailing slash.
    """

    def norm(u: str) -> str:
        local = local_path(u)
        return u.rstrip("/") if local is None else os.path.realpath(local)

    a, b = norm(os.fspath(path_or_url)), norm(os.fspath(directory))
    return a == b or a.startswith(b.rstrip("/") + "/")


def checked_path(path: Any, where: str) -> str:
    """A path named by a snapshot, refused unless it is relative and stays inside its directory."""
    if not isinstance(path, str):
        raise CheckpointError(f"{where}: path {path!r} is not a string")
    try:
        return check_relative(path)
    except ValueError as exc:
        raise CheckpointError(f"{where}: {exc}") from None


# -- _metadata ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SnapshotMetadata:
    """The ``_metadata`` of a checkpoint or savepoint.

    ``operators`` maps an operator uid to its part: for native snapshots
    ``{"max_parallelism": m, "subtasks": [KeyedStateHandle JSON, ...]}``; canonical savepoints
    (``backend.checkpointing.savepoints``) store ``{"max_parallelism", "states", "files": [...]}`` instead.
    """

    checkpoint_id: int
    operators: Mapping[str, Mapping[str, Any]]
    kind: str = "checkpoint"  # or "savepoint"
    format: str = "native"  # or "canonical"
    job_id: str = ""
    timestamp_ms: int = 0
    properties: Mapping[str, Any] = field(default_factory=dict)

    def handles(self, uid: str) -> list[KeyedStateHandle]:
        """The subtask handles of operator ``uid`` (native snapshots only)."""
        part = self.operators[uid]
        try:
            return [KeyedStateHandle.from_json(h) for h in part["subtasks"]]
        except (KeyError, TypeError) as exc:
            raise CheckpointError(f"operator {uid!r} has no subtask handles: {exc}") from None

    def all_handles(self) -> list[KeyedStateHandle]:
        return [h for uid in self.operators if self.format == "native" for h in self.handles(uid)]

    def referenced_files(self) -> set[str]:
        """Every file (relative to the snapshot's directory) a restore reads."""
        where = f"{self.kind} {self.checkpoint_id}"
        if self.format == "canonical":
            paths = {
                checked_path(f.get("path") if isinstance(f, dict) else f, where)
                for part in self.operators.values()
                for f in part.get("files", [])
            }
        else:
            paths = {checked_path(p, where) for h in self.all_handles() for p in h.referenced_files()}
        bad = [p for p in paths if in_checkpoint_dir(p) or p == METADATA_NAME]
        if bad:
            raise CheckpointError(f"{where}: a state file may not live in a checkpoint's own directory: {bad[0]!r}")
        return paths

    def to_json(self) -> dict[str, Any]:
        body = {
            "format": METADATA_FORMAT,
            "version": METADATA_VERSION,
            "kind": self.kind,
            "type": self.format,
            "checkpoint_id": self.checkpoint_id,
            "job_id": self.job_id,
            "timestamp_ms": self.timestamp_ms,
            "properties": dict(self.properties),
            "operators": {uid: dict(part) for uid, part in self.operators.items()},
        }
        return {**body, "crc32": _crc(body)}

    def dumps(self) -> bytes:
        return json.dumps(self.to_json(), sort_keys=True, indent=1).encode()

    @classmethod
    def loads(cls, data: bytes, where: str) -> SnapshotMetadata:
        """Parse and check a ``_metadata`` file; any problem raises ``CheckpointError`` naming ``where``."""
        try:
            value = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise CheckpointError(f"{where} is not a snapshot metadata file (not JSON: {exc})") from None
        if not isinstance(value, dict) or value.get("format") != METADATA_FORMAT:
            raise CheckpointError(f"{where} is not a snapshot metadata file (no {METADATA_FORMAT!r} format tag)")
        if value.get("version") != METADATA_VERSION:
            raise CheckpointError(
                f"{where} has metadata format version {value.get('version')!r}; this build reads {METADATA_VERSION}"
            )
        crc = value.pop("crc32", None)
        if crc != _crc(value):
            raise CheckpointError(f"{where} is corrupt: checksum mismatch")
        try:
            meta = cls(
                checkpoint_id=_typed(value["checkpoint_id"], int),
                operators=_typed(value["operators"], dict),
                kind=_choice(value["kind"], ("checkpoint", "savepoint")),
                format=_choice(value["type"], ("native", "canonical")),
                job_id=_typed(value.get("job_id", ""), str),
                timestamp_ms=_typed(value.get("timestamp_ms", 0), int),
                properties=_typed(value.get("properties", {}), dict),
            )
            if not all(isinstance(p, dict) for p in meta.operators.values()):
                raise TypeError("an operator entry is not an object")
            meta.referenced_files()  # every path checked, every handle parsed
        except (KeyError, TypeError, ValueError, RecursionError) as exc:
            raise CheckpointError(f"{where} is malformed: {exc}") from None
        except (CheckpointError, StateRestoreError) as exc:
            raise CheckpointError(f"{where}: {exc}") from None
        return meta


def read_snapshot(files: DfsFiles, where: str = METADATA_NAME) -> SnapshotMetadata:
    """Read the ``_metadata`` at ``where`` in ``files`` (whose base path is the snapshot's directory)."""
    try:
        data = files.get(where)
    except FileNotFoundError:
        raise CheckpointError(f"no {METADATA_NAME} in {files.base_path}: not a checkpoint or savepoint") from None
    return SnapshotMetadata.loads(data, f"{files.base_path.rstrip('/')}/{where}")


def _crc(body: Mapping[str, Any]) -> int:
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def _typed(value: Any, kind: type) -> Any:
    if type(value) is not kind:
        raise TypeError(f"expected {kind.__name__}, got {value!r}")
    return value


def _choice(value: Any, allowed: Sequence[str]) -> str:
    if value not in allowed:
        raise ValueError(f"{value!r} is not one of {list(allowed)}")
    return str(value)
