"""Completed checkpoints, the shared-state registry and the checkpoint coordinator.

Layout of a job directory (the changelog storage's base path is ``<root>/<job>``)::

    <root>/<job>/chk-<n>/_metadata     one per completed checkpoint (JSON, relative paths)
    <root>/<job>/shared/<uuid>.chunk    materialized chunks
    <root>/<job>/dstl/<xx>/<uuid>       changelog files

Why these rules (Flink's, with the holes Flink users fell into closed):

- **The commit point is the ``_metadata`` write.** It is one atomic put (tmp + rename locally; a
  PUT on S3); a checkpoint without it never happened, whatever files it uploaded.
- **Reference counts over every shared file.** A file (chunk or log file, possibly holding changes
  of many writers) is deleted when no *retained* completed checkpoint references it, never
  earlier: the registry counts, per file, the retained checkpoints naming it. Subsumption
  (dropping checkpoints beyond ``num_retained``) first deletes the old ``_metadata``, then the
  files whose count fell to zero, so a crash in between leaves unreferenced files, never a
  checkpoint naming a deleted file.
- **Only files of confirmed checkpoints may be referenced by new ones.** A completing checkpoint
  may name a file the registry knows (some retained checkpoint owns it) or a new file; naming a file
  the registry has deleted, or a new file that does not exist, fails the completion with
  ``CheckpointError`` instead of writing a checkpoint that cannot be restored.
- **Restart rebuilds, then cleans.** ``recover()`` reads every ``chk-*/_metadata``, keeps the
  newest ``num_retained``, rebuilds the counts from them and deletes every other file under the job
  directory (pending checkpoints' uploads, subsumed leftovers, tmp files) before a new checkpoint
  starts (Flink's changelog backend leaked these: FLINK-25511).
- **Nothing escapes the job directory.** Every path in ``_metadata`` and its handles must be
  relative and stay inside; anything else is rejected with ``CheckpointError`` naming the path.
"""

from __future__ import annotations

import enum
import json
import re
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from backend.core.errors import CheckpointError, StateRestoreError
from backend.core.handles import KeyedStateHandle
from dstl import StateChangelogStorage, StorageClosedError
from dstl.uploaders import check_relative

METADATA_VERSION = 1
METADATA_FORMAT = "dstl-snapshot"
METADATA_NAME = "_metadata"
_CHK_DIR = re.compile(r"^chk-(\d+)$")


class CheckpointRetention(enum.Enum):
    """What happens to the retained checkpoints when the job is cancelled (Flink's
    ``execution.checkpointing.externalized-checkpoint-retention``)."""

    RETAIN_ON_CANCELLATION = "RETAIN_ON_CANCELLATION"
    DELETE_ON_CANCELLATION = "DELETE_ON_CANCELLATION"


def checkpoint_dir(checkpoint_id: int) -> str:
    return f"chk-{checkpoint_id}"


def metadata_path(checkpoint_id: int) -> str:
    return f"{checkpoint_dir(checkpoint_id)}/{METADATA_NAME}"


def checked_path(path: Any, where: str) -> str:
    """A path named by a snapshot, refused unless it is relative and stays inside its directory."""
    if not isinstance(path, str):
        raise CheckpointError(f"{where}: path {path!r} is not a string")
    try:
        return check_relative(path)
    except ValueError as exc:
        raise CheckpointError(f"{where}: {exc}") from None


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
        bad = [p for p in paths if p.split("/", 1)[0].startswith("chk-") or p == METADATA_NAME]
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
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
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
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{where} is malformed: {exc}") from None
        except (CheckpointError, StateRestoreError) as exc:
            raise CheckpointError(f"{where}: {exc}") from None
        return meta


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


class SharedStateRegistry:
    """Per shared file, the number of retained completed checkpoints that reference it."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._by_checkpoint: dict[int, frozenset[str]] = {}
        self.deleted: set[str] = set()

    def register(self, checkpoint_id: int, files: Iterable[str]) -> None:
        files = frozenset(files)
        if checkpoint_id in self._by_checkpoint:
            raise CheckpointError(f"checkpoint {checkpoint_id} is registered already")
        self._by_checkpoint[checkpoint_id] = files
        self._counts.update(files)

    def unregister(self, checkpoint_id: int) -> list[str]:
        """Drop a checkpoint's references; returns the files nothing references any more."""
        unused = []
        for path in self._by_checkpoint.pop(checkpoint_id, frozenset()):
            self._counts[path] -= 1
            if self._counts[path] <= 0:
                del self._counts[path]
                unused.append(path)
        return sorted(unused)

    def count(self, path: str) -> int:
        return self._counts.get(path, 0)

    def files(self) -> set[str]:
        return set(self._counts)

    def checkpoints(self) -> list[int]:
        return sorted(self._by_checkpoint)


@dataclass
class PendingCheckpoint:
    checkpoint_id: int
    timestamp_ms: int
    acks: dict[str, dict[int, KeyedStateHandle]] = field(default_factory=dict)
    max_parallelism: dict[str, int] = field(default_factory=dict)


#: A hook the tests of the checkpoint protocol use to stop the process at a named step.
StepHook = Callable[[str], None]


class CheckpointCoordinator:
    """Triggers, collects, completes and subsumes the checkpoints of one job directory.

    Standalone use (``backend.checkpointing.job.LocalJob``) and the Spark driver both drive it: ``trigger`` a
    checkpoint id, ``acknowledge`` every subtask's handle, ``complete`` (or ``abort``). Call
    ``recover`` once before the first trigger.
    """

    def __init__(
        self,
        storage: StateChangelogStorage,
        *,
        job_id: str = "",
        num_retained: int = 1,
        retention: CheckpointRetention = CheckpointRetention.RETAIN_ON_CANCELLATION,
        clock_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
        on_step: StepHook | None = None,
    ) -> None:
        if num_retained < 1:
            raise ValueError(f"num_retained must be >= 1, got {num_retained}")
        self.storage = storage
        self.job_id = job_id
        self.num_retained = num_retained
        self.retention = retention
        self.registry = SharedStateRegistry()
        self.completed: list[SnapshotMetadata] = []
        self.pending: dict[int, PendingCheckpoint] = {}
        self._clock_ms = clock_ms
        self._step = on_step or (lambda _: None)
        self._last_id = -1  # the highest checkpoint id used or seen; automatic ids start at 1
        self._recovered = False
        #: deletions that failed after a commit (left to the next ``recover()``), for logs and metrics
        self.cleanup_errors: list[str] = []
        #: called with the first checkpoint completed after a restore (CLAIM drops its source then)
        self.on_first_completion: Callable[[SnapshotMetadata], None] | None = None

    # -- restart --------------------------------------------------------------------------

    def recover(self, protect: Iterable[str] = ()) -> SnapshotMetadata | None:
        """Rebuild the registry from the completed checkpoints, delete every unreferenced file
        under the job directory (except ``protect``); returns the latest completed checkpoint
        (None for a new job)."""
        found: list[SnapshotMetadata] = []
        highest = -1
        all_files = self.storage.list_all("")
        for path in all_files:
            head, _, rest = path.partition("/")
            match = _CHK_DIR.match(head)
            if match is None:
                continue
            highest = max(highest, int(match.group(1)))
            if rest == METADATA_NAME:
                found.append(self._read_metadata(path))
        found.sort(key=lambda m: m.checkpoint_id)
        self.completed = found[-self.num_retained :]
        for meta in self.completed:
            self.registry.register(meta.checkpoint_id, meta.referenced_files())
        keep = self.registry.files() | {metadata_path(m.checkpoint_id) for m in self.completed} | set(protect)
        for path in all_files:
            if path not in keep:
                self.storage.delete_file(path)
                if _CHK_DIR.match(path.partition("/")[0]):
                    self.storage.remove_empty_directory(path.partition("/")[0])
        self._last_id = highest
        self._recovered = True
        return self.completed[-1] if self.completed else None

    def _read_metadata(self, path: str) -> SnapshotMetadata:
        try:
            data = self.storage.get_file(path)
        except FileNotFoundError:
            raise CheckpointError(f"{path} disappeared while recovering") from None
        return SnapshotMetadata.loads(data, path)

    def latest(self) -> SnapshotMetadata | None:
        return self.completed[-1] if self.completed else None

    # -- the protocol ---------------------------------------------------------------------

    def trigger(self, checkpoint_id: int | None = None) -> int:
        """A new pending checkpoint: the next id, or ``checkpoint_id`` (a Spark batch id) if it
        is larger than every id used before."""
        if not self._recovered:
            raise CheckpointError("call recover() before the first checkpoint: orphan files must be cleaned first")
        if checkpoint_id is not None and checkpoint_id <= self._last_id:
            raise CheckpointError(f"checkpoint id {checkpoint_id} is not after the last one ({self._last_id})")
        checkpoint_id = max(1, self._last_id + 1) if checkpoint_id is None else checkpoint_id
        self._last_id = checkpoint_id
        self.pending[checkpoint_id] = PendingCheckpoint(checkpoint_id, self._clock_ms())
        return checkpoint_id

    def acknowledge(self, checkpoint_id: int, uid: str, subtask: int, handle: KeyedStateHandle) -> None:
        pending = self.pending.get(checkpoint_id)
        if pending is None:
            raise CheckpointError(f"checkpoint {checkpoint_id} is not pending (aborted, subsumed or unknown)")
        known = pending.max_parallelism.setdefault(uid, handle.max_parallelism)
        if known != handle.max_parallelism:
            raise CheckpointError(f"operator {uid!r}: subtasks disagree about max parallelism")
        pending.acks.setdefault(uid, {})[subtask] = handle

    def complete(self, checkpoint_id: int, properties: Mapping[str, Any] | None = None) -> SnapshotMetadata:
        """Write ``chk-<n>/_metadata`` from the acknowledged handles, register its files, abort
        older pending checkpoints and subsume completed ones beyond ``num_retained``."""
        pending = self.pending.get(checkpoint_id)
        if pending is None:
            raise CheckpointError(f"checkpoint {checkpoint_id} is not pending (aborted, subsumed or unknown)")
        operators = {
            uid: {
                "max_parallelism": pending.max_parallelism[uid],
                "subtasks": [acks[i].to_json() for i in sorted(acks)],
            }
            for uid, acks in sorted(pending.acks.items())
        }
        meta = SnapshotMetadata(
            checkpoint_id,
            operators,
            job_id=self.job_id,
            timestamp_ms=pending.timestamp_ms,
            properties=dict(properties or {}),
        )
        files = meta.referenced_files()
        self._check_references(checkpoint_id, files)
        self._step("before-metadata")
        self._commit(metadata_path(checkpoint_id), meta.dumps())
        # Committed (or possibly committed): from here on nothing may fail the checkpoint, or the
        # caller would abort it and release files that its _metadata names.
        del self.pending[checkpoint_id]
        self._step("after-metadata")
        self.registry.register(checkpoint_id, files)
        for older in [c for c in self.pending if c < checkpoint_id]:
            self.abort(older)
        first = not self.completed
        self.completed.append(meta)
        self._subsume()
        if first and self.on_first_completion is not None:
            try:
                self.on_first_completion(meta)
            except Exception as exc:
                self.cleanup_errors.append(f"after checkpoint {checkpoint_id}: {exc}")
        return meta

    def _commit(self, path: str, data: bytes) -> None:
        """Write ``_metadata``. Raises only when the checkpoint is certainly not committed: a failed
        put may still have landed (a lost response, a timeout), so its object is removed first; if
        that fails too, the checkpoint counts as committed (its files stay owned; recover() cleans
        up if the write had not landed after all)."""
        try:
            self.storage.put_file(path, data)
        except StorageClosedError:
            raise  # refused before it started: certainly not written
        except Exception as exc:
            try:
                self.storage.delete_file(path)
            except Exception:
                self.cleanup_errors.append(f"{path}: write failed ({exc}), its removal too: kept as committed")
                return
            raise

    def _check_references(self, checkpoint_id: int, files: set[str]) -> None:
        for path in sorted(files):
            if path in self.registry.deleted:
                raise CheckpointError(
                    f"checkpoint {checkpoint_id} references {path}, which was deleted with a subsumed checkpoint"
                )
            if self.registry.count(path) == 0 and not self._exists(path):
                raise CheckpointError(f"checkpoint {checkpoint_id} references {path}, which does not exist")

    def _exists(self, path: str) -> bool:
        try:
            self.storage.read_range(path, 0, 1)
        except FileNotFoundError:
            return False
        return True

    def _subsume(self) -> None:
        """Best effort: the new checkpoint is committed already, so a failed deletion must not fail
        it; what stays behind is deleted by the next ``recover()``."""
        while len(self.completed) > self.num_retained:
            old = self.completed.pop(0)
            self._step("before-subsume")
            unused = self.registry.unregister(old.checkpoint_id)
            try:
                self.storage.delete_file(metadata_path(old.checkpoint_id))
            except Exception as exc:
                # The old _metadata still names its files: keep them (recover() drops both).
                self.cleanup_errors.append(f"subsuming checkpoint {old.checkpoint_id}: {exc}")
                self.registry.deleted.update(unused)  # never referenced again by a new checkpoint
                continue
            self.storage.remove_empty_directory(checkpoint_dir(old.checkpoint_id))
            self._step("after-subsume-metadata")
            self._delete(unused)

    def _delete(self, paths: Sequence[str]) -> None:
        for i, path in enumerate(paths):
            self.registry.deleted.add(path)
            try:
                self.storage.delete_file(path)
            except Exception as exc:
                self.cleanup_errors.append(f"{path}: {exc}")  # an orphan for the next recover()
            if i == 0:
                self._step("during-file-deletion")

    def abort(self, checkpoint_id: int) -> None:
        """Forget a pending checkpoint; its uploads are released by the backends
        (``notify_checkpoint_aborted``) and, after a crash, removed by ``recover``."""
        self.pending.pop(checkpoint_id, None)

    def shutdown(self, cancelled: bool) -> None:
        """On cancellation with DELETE_ON_CANCELLATION, delete every retained checkpoint and its
        files; otherwise keep them (a later run resumes from the latest)."""
        self.pending.clear()
        if not (cancelled and self.retention is CheckpointRetention.DELETE_ON_CANCELLATION):
            return
        while self.completed:
            old = self.completed.pop(0)
            self.storage.delete_file(metadata_path(old.checkpoint_id))
            self.storage.remove_empty_directory(checkpoint_dir(old.checkpoint_id))
            self._delete(self.registry.unregister(old.checkpoint_id))


def read_snapshot(storage: StateChangelogStorage, where: str = METADATA_NAME) -> SnapshotMetadata:
    """Read the ``_metadata`` of a snapshot directory (the storage's base path)."""
    try:
        data = storage.get_file(where)
    except FileNotFoundError:
        raise CheckpointError(
            f"no {METADATA_NAME} in {storage.config.base_path}: not a checkpoint or savepoint"
        ) from None
    return SnapshotMetadata.loads(data, f"{storage.config.base_path.rstrip('/')}/{where}")
