"""Planning a read of the state data source, on the driver: where the state is, which checkpoint,
which state, its columns, and the Spark partitions that read it.

The path is what the drop-in was given (``load(checkpoint_location)``):

- an operator's ``checkpoint_location`` (its job directory: ``chk-<b>/_metadata``, ``shared/``,
  ``pending/``, ``_keys/``): its operators (usually one) are numbered in uid order;
- a query's ``checkpointLocation`` with routed operators (``use_for_session``), whose state lives
  in ``<checkpointLocation>/dstl/<uid>``, or that ``dstl`` directory itself (with
  ``use_for_session(root)``, the directory under ``root``): the operators are numbered by their place
  in the query (``operators.json``, ``backend.spark.operator_ids``), as Spark numbers its
  stateful operators (counting the routed ones only).

``operatorId`` picks one by that number (default 0) or by its uid. Checkpoint ``b`` is the state
after batch ``b`` (the drop-in's checkpoint id is the batch id); the retained ones are the
completed ``chk-<b>/_metadata`` not fenced (``_aborted``) or voided (``_void``), read without the
coordinator's recovery, which would delete: nothing here writes. The TTL of a value is judged
against the checkpoint's batch timestamp (``batch_timestamp_ms``, recorded by the driver since
this source exists; an older checkpoint's completion time), so a read shows what the processor
saw in that batch, as Spark's state store holds it after its TTL cleanup at the batch's end.

A read is split by key-group ranges (``numPartitions``, default the checkpoint's parallelism;
``snapshotPartitionId``: the one key group it names, as ``partition_id`` is the key group).
Each partition carries only the handles holding its key groups; an executor restores them into a
scratch table (``backend.spark.state_scan``), reading the chunks' byte ranges and the log
segments of its key groups only, so the driver reads nothing but ``_metadata``.

The change feed of batches ``start..end`` reads each batch's own log segments: those in its files
(``pending/<b>/<uid>/``: a batch's final persist, which carries its pending records as notes) and
the segments the same writer uploaded early just before them (a preemptive persist, in a file of no
batch). A batch's checkpoint ``chk-<b>`` always holds them (a materialization in it was taken
before the batch ran), so every batch from ``start`` on must still be retained. A batch that left
no checkpoint (its ``_metadata`` failed, the driver died first) is read from the next retained
one's log, which holds its segments unless a materialization since the checkpoint before it folded
them into a snapshot: a key group whose chunks differ between those two checkpoints refuses the
read, naming the batch, rather than give a feed without that batch's changes. A state whose schema
changed inside the range is refused, naming the batch: read the ranges before and after it apart.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from backend.checkpointing.metadata import (
    ABORTED_NAME,
    METADATA_NAME,
    SnapshotMetadata,
    metadata_path,
    parse_checkpoint_dir,
    parse_pending_path,
    parse_void_range_path,
)
from backend.core.handles import KeyedStateHandle, intersect
from backend.core.keygroups import key_group_range_for_subtask
from backend.core.serializers import Int64Serializer, OptionalSerializer, TupleSerializer
from backend.spark.apply_in_pandas import GROUP_STATE_NAME
from backend.spark.bootstrap import open_storage
from backend.spark.codecs import struct_codec
from backend.spark.driver import KEYS_DIR, SPARK_OPERATORS
from backend.spark.errors import StateSourceError
from backend.spark.operator_ids import OPERATORS_FILE, parse_uids
from backend.spark.state_columns import GROUPING, StateColumns
from backend.spark.state_options import (
    NUM_PARTITIONS,
    OPERATOR_ID,
    READ_REGISTERED_TIMERS,
    SNAPSHOT_PARTITION_ID,
    SNAPSHOT_START_BATCH_ID,
    STATE_VAR_NAME,
    SourceOptions,
    invalid,
    required,
    storage_of,
)
from backend.state import versions
from backend.state.restore import merge_metadata
from dstl import ChangelogConfig, ChangelogError, KeyGroupRange
from dstl.api import DfsFiles
from dstl.paths import local_path
from dstl.types import ChangelogHandle, SegmentRef

__all__ = [
    "APPLY_IN_PANDAS",
    "TRANSFORM_WITH_STATE",
    "BatchChanges",
    "ChangePart",
    "OperatorAt",
    "ScanPlan",
    "StatePart",
    "batch_segments",
    "completed_checkpoints",
    "drop_in_location",
    "grouping_key",
    "locate",
    "open_storage",
    "plan_read",
    "read_checkpoint",
    "states_of",
]

#: the names Spark gives a transformWithState operator's timers, read here as ``readRegisteredTimers``
SPARK_TIMER_STATES = ("$procTimers_keyToTimestamp", "$eventTimers_keyToTimestamp")
#: Spark's operator names (its ``state-metadata``); the drop-in does not record which TWS API ran
APPLY_IN_PANDAS, TRANSFORM_WITH_STATE = "applyInPandasWithState", "transformWithState"


@dataclass(frozen=True)
class OperatorAt:
    """An operator a path holds: its number (``operatorId``), uid and state (job) directory."""

    place: int
    uid: str
    job_dir: str


@dataclass(frozen=True)
class ScanPlan:
    """What every partition of one read shares (pickled to the executors with the reader)."""

    job_dir: str
    uid: str
    storage: ChangelogConfig  # base path: ``job_dir``
    max_parallelism: int
    state: str | None  # None: the timers
    meta: dict[str, Any] | None  # the state's metadata at the checkpoint read (merged over its subtasks)
    columns: StateColumns
    now_ms: int  # values whose TTL expiry is at or before it are left out


@dataclass(frozen=True)
class StatePart:
    """One Spark partition of a state read: key groups ``start..end`` and the handles holding them."""

    start: int
    end: int
    handles: tuple[str, ...]  # KeyedStateHandle JSON


@dataclass(frozen=True)
class BatchChanges:
    """The log of one batch in one partition's key groups: (log handle JSON with the batch's segments
    only, key group start, end), and the state's metadata in the checkpoint holding it."""

    batch: int
    meta: dict[str, Any] | None
    logs: tuple[tuple[str, int, int], ...]


@dataclass(frozen=True)
class ChangePart:
    start: int
    end: int
    batches: tuple[BatchChanges, ...]


def _normalize(path: str) -> str:
    local = local_path(path)
    if local is None:
        return path.rstrip("/")
    full = os.path.abspath(local)
    if not os.path.isdir(full):
        what = "is not a directory" if os.path.exists(full) else "does not exist"
        raise StateSourceError(f"the state data source's path {full} {what}: give a checkpoint location")
    return full


def _get(files: DfsFiles, path: str) -> bytes | None:
    try:
        return files.get(path)
    except (FileNotFoundError, IsADirectoryError):
        return None


def completed_checkpoints(files: DfsFiles) -> list[int]:
    """The retained completed checkpoints of a job directory, oldest first: every ``chk-<b>/_metadata``
    not fenced or voided (``backend.checkpointing.store``'s rules, read-only)."""
    found, fenced, voids = set(), set(), []
    for path in files.list(""):
        void = parse_void_range_path(path)
        if void is not None:
            voids.append(void)
            continue
        head, _, rest = path.partition("/")
        checkpoint = parse_checkpoint_dir(head)
        if checkpoint is not None and rest == METADATA_NAME:
            found.add(checkpoint)
        elif checkpoint is not None and rest == ABORTED_NAME:
            fenced.add(checkpoint)
    return sorted(c for c in found - fenced if not any(first <= c <= last for first, last in voids))


def _not_a_checkpoint(url: str) -> StateSourceError:
    parent, _, last = url.rpartition("/")
    hint = (
        f" (it is one checkpoint: give its directory, {parent}, and option batchId)"
        if parse_checkpoint_dir(last)
        else ""
    )
    return StateSourceError(
        f"{url} is not a checkpoint location of the drop-in{hint}: it has no completed checkpoint "
        f"(chk-<b>/{METADATA_NAME}) and no routed operators (dstl/{OPERATORS_FILE}); give the checkpoint_location "
        "an operator was given, or the checkpointLocation of a query run with use_for_session"
    )


def locate(options: SourceOptions) -> list[OperatorAt]:
    """The operators at the options' path, numbered (``operatorId``)."""
    url = _normalize(options.path)
    with open_storage(options.storage, url) as storage:
        for sub in ("dstl", ""):
            where = f"{sub}/{OPERATORS_FILE}" if sub else OPERATORS_FILE
            data = _get(storage.files, where)
            if data is not None:
                base = f"{url}/{sub}" if sub else url
                uids = parse_uids(data, f"{url}/{where}")
                return [OperatorAt(place, uid, f"{base}/{uid}") for place, uid in enumerate(uids)]
        retained = completed_checkpoints(storage.files)
        if not retained:
            raise _not_a_checkpoint(url)
        meta = read_checkpoint(storage.files, url, retained[-1])
        return [OperatorAt(place, uid, url) for place, uid in enumerate(sorted(meta.operators))]


def drop_in_location(candidates: Sequence[str], given: Mapping[str, Any]) -> str | None:
    """The first of ``candidates`` (the directories a read's path may mean) that holds the drop-in's
    checkpoints, as ``locate`` reads it: a routed query's operators (``dstl/operators.json`` under
    it: that ``dstl`` directory; ``operators.json`` in it: itself) or, on a local disk, an
    operator's own completed checkpoints (``chk-<b>/_metadata``); None when none does. It reads
    those few names only, never lists a remote directory (a Spark checkpoint on S3 may hold many
    files), and a path it cannot read (an object store it has no access to, bad storage options
    ``given``) is not the drop-in's: Spark's own source reads it and says what it finds."""
    for path in candidates:
        url = path.rstrip("/")
        local = local_path(url)
        if local is not None:
            full = os.path.abspath(local)
            for where in (os.path.join(full, "dstl"), full):
                if os.path.isfile(os.path.join(where, OPERATORS_FILE)):
                    return where
            if os.path.isdir(full) and any(
                parse_checkpoint_dir(name) is not None and os.path.isfile(os.path.join(full, name, METADATA_NAME))
                for name in os.listdir(full)
            ):
                return full
            continue
        try:
            with open_storage(storage_of(given, url), url) as storage:
                for sub in ("dstl", ""):
                    if _get(storage.files, f"{sub}/{OPERATORS_FILE}" if sub else OPERATORS_FILE) is not None:
                        return f"{url}/{sub}" if sub else url
        except (ChangelogError, OSError):  # not readable as the drop-in's: Spark's source reads it
            continue
    return None


def pick_operator(operators: Sequence[OperatorAt], wanted: str | None, path: str) -> OperatorAt:
    """The operator ``operatorId`` names: its uid, or its number (None: 0)."""
    listed = ", ".join(f"{op.place} ({op.uid})" for op in operators) or "none"
    for op in operators:
        if wanted is not None and op.uid == wanted:
            return op
    place = 0 if wanted is None else int(wanted) if wanted.isdigit() else None
    if place is None or place >= len(operators):
        raise invalid(OPERATOR_ID, f"{path} has no operator {wanted or 0!s}; it has operators {listed}")
    return operators[place]


def read_checkpoint(files: DfsFiles, url: str, batch: int) -> SnapshotMetadata:
    """``chk-<batch>/_metadata`` of the job directory ``url`` (``files``), checked (``SnapshotMetadata.loads``)."""
    where = metadata_path(batch)
    data = _get(files, where)
    if data is None:
        raise StateSourceError(f"{url}/{where} is gone: checkpoint {batch} was subsumed while it was read")
    return SnapshotMetadata.loads(data, f"{url}/{where}")


def _handles(meta: SnapshotMetadata, uid: str, url: str) -> list[KeyedStateHandle]:
    if uid not in meta.operators:
        raise StateSourceError(f"checkpoint {meta.checkpoint_id} in {url} holds no state of operator {uid!r}")
    return meta.handles(uid)


def states_of(handles: Sequence[KeyedStateHandle]) -> dict[str, dict[str, Any]]:
    """The states of an operator's handles (their metadata merged), dropped ones left out."""
    merged: dict[str, dict[str, Any]] = {}
    for handle in handles:
        merge_metadata(merged, handle.states)
    return {name: meta for name, meta in merged.items() if not meta.get("dropped")}


def grouping_key(files: DfsFiles, url: str, uid: str) -> GROUPING:
    """The grouping columns' names and Spark types the driver recorded for operator ``uid``."""
    where = f"{KEYS_DIR}/{uid}.json"
    data = _get(files, where)
    if data is None:
        raise StateSourceError(
            f"{url}/{where} is missing: the grouping key's schema of operator {uid!r} is not recorded (a checkpoint "
            "of an earlier release records it when its query restarts)"
        )
    try:
        return tuple((str(name), str(dtype)) for name, dtype in json.loads(data)["grouping_key"])
    except (ValueError, KeyError, TypeError) as exc:
        raise StateSourceError(f"{url}/{where} is corrupt: {exc!r}") from None


def columns_of(
    options: SourceOptions, uid: str, states: dict[str, dict[str, Any]], key: GROUPING
) -> tuple[str | None, StateColumns]:
    """The state a read names (None: the timers) and its columns, checked against the operator."""
    common = {"key": key, "flatten": options.flatten, "change_feed": options.change_feed}
    group_state = GROUP_STATE_NAME in states
    if group_state and (options.read_timers or options.state_var is not None):
        option = READ_REGISTERED_TIMERS if options.read_timers else STATE_VAR_NAME
        raise invalid(
            option, f"only supported with the transformWithState operator; operator {uid!r} runs {APPLY_IN_PANDAS}"
        )
    if options.read_timers or options.state_var in SPARK_TIMER_STATES:
        return None, StateColumns("timers", **common)  # type: ignore[arg-type]
    name = GROUP_STATE_NAME if group_state else options.state_var
    if name is None:
        raise required(STATE_VAR_NAME)
    meta = states.get(name)
    if meta is None:
        known = ", ".join(sorted(states)) or "none"
        raise invalid(
            STATE_VAR_NAME,
            f"State variable {name} is not defined for the transformWithState operator {uid!r} (it has: {known}).",
        )
    kind, declared = meta.get("kind"), meta.get("declared")
    if kind not in ("value", "list", "map"):
        raise StateSourceError(f"state {name!r} of operator {uid!r} is a {kind} state, which no Spark operator has")
    if not declared:
        raise StateSourceError(
            f"state {name!r} of operator {uid!r} was checkpointed by a release that did not record its Spark schema; "
            "read it with `dstl state read`, or run the query once more to record it"
        )
    columns = StateColumns(
        str(kind), value_schema=str(declared[0]), user_key_schema=str(declared[1]) if kind == "map" else None,
        ttl=bool(meta.get("ttl_ms")), group_state=group_state, **common,  # type: ignore[arg-type]
    )  # fmt: skip
    check_serializers(name, meta, columns)
    return name, columns


def check_serializers(name: str, meta: dict[str, Any], columns: StateColumns) -> None:
    """The declared schemas must be those the state is stored with (else its bytes read wrongly)."""
    codec = struct_codec(columns.value_schema, name)
    stored = codec.serializer
    if columns.group_state:
        stored = TupleSerializer([Int64Serializer(), OptionalSerializer(codec.serializer)])
    pairs = [(stored.id, meta.get("serializer"))]
    if columns.user_key_schema is not None:
        pairs.append((struct_codec(columns.user_key_schema, name).serializer.id, meta.get("user_key_serializer")))
    for expected, recorded in pairs:
        if expected != recorded:
            raise StateSourceError(
                f"state {name!r}: its declared schema {columns.value_schema!r} is stored as {expected}, but the "
                f"checkpoint recorded {recorded}: the checkpoint is damaged or of another build"
            )


def _ranges(options: SourceOptions, parallelism: int, max_parallelism: int) -> list[KeyGroupRange]:
    """The key groups of each Spark partition of a read: ``numPartitions`` ranges (default: the
    checkpoint's parallelism), or the one key group ``snapshotPartitionId`` names."""
    if options.snapshot_partition is not None:
        if options.snapshot_partition >= max_parallelism:
            raise invalid(
                SNAPSHOT_PARTITION_ID,
                f"a partition_id here is a key group, 0 to {max_parallelism - 1}; got {options.snapshot_partition}",
            )
        return [KeyGroupRange(options.snapshot_partition, options.snapshot_partition)]
    count = options.partitions or parallelism
    if count > max_parallelism:
        raise invalid(NUM_PARTITIONS, f"at most the state's max parallelism, {max_parallelism}; got {count}")
    return [key_group_range_for_subtask(max_parallelism, count, i) for i in range(count)]


def plan_read(options: SourceOptions) -> tuple[ScanPlan, list[StatePart] | list[ChangePart]]:
    """The plan of a read and its partitions: state parts, or change parts for the change feed."""
    op = pick_operator(locate(options), options.operator, options.path)
    with open_storage(options.storage, op.job_dir) as storage:
        files = storage.files
        retained = completed_checkpoints(files)
        if not retained:
            raise StateSourceError(  # Spark's error class for a query with no committed batch
                f"[STDS_COMMITTED_BATCH_UNAVAILABLE] operator {op.uid!r} ({op.job_dir}) has no completed checkpoint yet"
            )
        last = options.change_end if options.change_feed else options.batch_id
        batch = retained[-1] if last is None else last
        if batch not in retained:
            raise StateSourceError(_unavailable(batch, op, retained))
        meta = read_checkpoint(files, op.job_dir, batch)
        handles = _handles(meta, op.uid, op.job_dir)
        states = states_of(handles)
        if options.snapshot_start is not None and options.snapshot_start > batch:
            raise invalid(SNAPSHOT_START_BATCH_ID, f"value should be less than or equal to {batch}")
        recorded = meta.properties.get(SPARK_OPERATORS)
        time_mode = (recorded.get(op.uid) or {}).get("time_mode") if isinstance(recorded, dict) else None
        if options.read_timers and time_mode == "NoTime":
            raise invalid(READ_REGISTERED_TIMERS, "Registered timers are not available in TimeMode=None.")
        name, columns = columns_of(options, op.uid, states, grouping_key(files, op.job_dir, op.uid))
        now_ms = int(meta.properties.get("batch_timestamp_ms") or meta.timestamp_ms)
        plan = ScanPlan(
            op.job_dir, op.uid, replace(options.storage, base_path=op.job_dir), handles[0].max_parallelism, name,
            states.get(name) if name is not None else None, columns, now_ms,
        )  # fmt: skip
        ranges = _ranges(options, len(handles), plan.max_parallelism)
        if not options.change_feed:
            return plan, [_state_part(rng, handles) for rng in ranges]
        start = options.change_start or 0
        if start < retained[0]:
            raise StateSourceError(
                f"the change feed from batch {start} needs checkpoint {start} of operator {op.uid!r}, which is not "
                f"retained ({op.job_dir} retains {_listed(retained)}): a batch's changes are read from the log its "
                "checkpoint holds; retain more checkpoints (num_retained) or start the change feed later"
            )
        logs = _batch_logs(files, op, retained, start, batch, name, plan.meta)
        return plan, [_change_part(rng, logs) for rng in ranges]


def _unavailable(batch: int, op: OperatorAt, retained: list[int]) -> str:
    if batch > retained[-1]:
        why = f"the latest is {retained[-1]}"
    elif batch < retained[0]:
        why = "it is not retained any more (retain more checkpoints: num_retained)"
    else:
        why = "that batch left none (it ran no task, or its checkpoint failed)"
    return (
        f"[STDS_OFFSET_LOG_UNAVAILABLE] batch {batch} of operator {op.uid!r} has no completed checkpoint in "
        f"{op.job_dir}: {why}; retained batches: {_listed(retained)}"
    )


def _listed(retained: list[int]) -> str:
    return ", ".join(map(str, retained))


def _state_part(rng: KeyGroupRange, handles: Sequence[KeyedStateHandle]) -> StatePart:
    held = [h.dumps() for h in handles if len(intersect(h.key_group_range, rng))]
    return StatePart(rng.start, rng.end, tuple(held))


def batch_segments(log: ChangelogHandle, batch: int) -> tuple[SegmentRef, ...]:
    """The segments of ``log`` holding batch ``batch``'s changes: those in its files under
    ``pending/<batch>/`` and, before them, the ones the writer uploaded early (a preemptive
    persist, in a file of no batch) since its last segment of another batch."""
    found: list[SegmentRef] = []
    early: list[SegmentRef] = []
    for segment in sorted(log.segments, key=lambda s: s.sqn):
        pending = parse_pending_path(segment.path)
        if pending is None:
            early.append(segment)
            continue
        if pending[0] == batch:
            found += [*early, segment]
        early = []
    return tuple(found)


def _batch_logs(
    files: DfsFiles, op: OperatorAt, retained: list[int], start: int, end: int, name: str | None,
    meta: dict[str, Any] | None,
) -> list[tuple[int, dict[str, Any] | None, list[tuple[ChangelogHandle, KeyGroupRange]]]]:  # fmt: skip
    """(batch, the state's metadata, [(log of the batch's segments, key groups)]) per batch."""
    read: dict[int, SnapshotMetadata] = {}

    def checkpoint(batch: int) -> SnapshotMetadata:
        if batch not in read:
            read[batch] = read_checkpoint(files, op.job_dir, batch)
        return read[batch]

    out = []
    for batch in range(start, end + 1):
        holder = next(c for c in retained if c >= batch)
        if op.uid not in checkpoint(holder).operators:
            continue
        handles = checkpoint(holder).handles(op.uid)
        if holder != batch:
            before = max(c for c in retained if c < batch)  # start >= retained[0]: there is one
            earlier = checkpoint(before).handles(op.uid) if op.uid in checkpoint(before).operators else []
            _check_unfolded(batch, before, holder, earlier, handles, op)
        held = states_of(handles).get(name) if name is not None else None
        if name is not None and held is not None and meta is not None and _schema(held) != _schema(meta):
            raise StateSourceError(
                f"state {name!r} of operator {op.uid!r} changed its schema between batch {batch} and batch {end}: read "
                "the change feed before and after the change apart"
            )
        logs = []
        for handle in handles:
            for entry in handle.changelog:
                segments = batch_segments(entry.log, batch)
                rng = intersect(entry.key_groups, handle.key_group_range)
                if segments and len(rng):
                    logs.append((replace(entry.log, segments=segments), rng))
        out.append((batch, held, logs))
    return out


def _check_unfolded(
    batch: int, before: int, holder: int, earlier: Sequence[KeyedStateHandle], later: Sequence[KeyedStateHandle],
    op: OperatorAt,
) -> None:  # fmt: skip
    """Refuse batch ``batch``, which left no checkpoint, if a materialization between checkpoints
    ``before`` and ``holder`` may have folded its changes into a snapshot: its segments are then
    missing from ``holder``'s log, and the feed would silently lack them. A key group whose chunks
    are the same in both checkpoints was not materialized in between (an incremental
    materialization re-references an unchanged key group's chunk), so ``holder``'s log holds
    everything after ``before`` for it."""
    then, now = _chunks_by_group(earlier), _chunks_by_group(later)
    for group in sorted(g for g in now.keys() | then.keys() if now.get(g) != then.get(g)):
        raise StateSourceError(
            f"[STDS_OFFSET_LOG_UNAVAILABLE] the change feed cannot read batch {batch} of operator {op.uid!r}: "
            f"the batch left no checkpoint of its own, and a materialization between checkpoints {before} and "
            f"{holder} folded the log of key group {group} into a snapshot, so its changes may be in no log any "
            f"more; read the change feed up to batch {before}, or from batch {holder}"
        )


def _chunks_by_group(handles: Sequence[KeyedStateHandle]) -> dict[int, set[tuple[str, int]]]:
    """Per key group, the chunks (path, offset) a restore of it reads from ``handles``."""
    found: dict[int, set[tuple[str, int]]] = {}
    for handle in handles:
        for entry in handle.materialized:
            scope = KeyGroupRange.from_json(entry["scope"])
            chunk = (str(entry["path"]), int(entry.get("offset", -1)))
            for group in intersect(scope if len(scope) else KeyGroupRange.from_json(entry["key_groups"]),
                                   handle.key_group_range):  # fmt: skip
                found.setdefault(group, set()).add(chunk)
    return found


def _schema(meta: dict[str, Any]) -> tuple[Any, ...]:
    return versions.version_of(meta), json.dumps(versions.schema_of(meta), sort_keys=True)


def _change_part(
    rng: KeyGroupRange, logs: list[tuple[int, dict[str, Any] | None, list[tuple[ChangelogHandle, KeyGroupRange]]]]
) -> ChangePart:
    batches = []
    for batch, meta, held in logs:
        mine = []
        for log, groups in held:
            part = intersect(groups, rng)
            if len(part) and any(part.intersects(s.min_key_group, s.max_key_group) for s in log.segments):
                mine.append((log.dumps(), part.start, part.end))
        batches.append(BatchChanges(batch, meta, tuple(mine)))
    return ChangePart(rng.start, rng.end, tuple(batches))
