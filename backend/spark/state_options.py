"""The options of the state data source, read and checked as Spark's ``statestore`` source reads its own.

Spark's option names and rules (``StateSourceOptions``), so that a Spark user's habits carry over:
``path`` (``load(path)``), ``batchId`` (default: the latest retained checkpoint), ``operatorId``
(default 0), ``storeName`` ("default"), ``stateVarName``, ``readRegisteredTimers``,
``flattenCollectionTypes`` (default true), ``readChangeFeed`` with ``changeStartBatchId`` (required)
and ``changeEndBatchId`` (default: the latest); ``batchId`` conflicts with ``readChangeFeed``, the
change bounds need it, a negative id is refused; ``snapshotPartitionId`` and ``snapshotStartBatchId``
go together, not with ``readChangeFeed``, the start at most ``batchId``. A refusal names the option
and carries Spark's error class first (``STDS_...``), as Spark's message does. ``snapshotPartitionId``
reads one partition as ``partition_id`` names it (here: one key group); ``snapshotStartBatchId`` says
where Spark starts rebuilding that partition's state (its snapshot of that batch, then its changelog
up to ``batchId``): the drop-in reads the state of ``batchId`` from its checkpoint, the same state, so
the start is only checked. Spark's option for what the drop-in does not have (``joinSide``: no
stream-stream joins) is refused naming it; other options are ignored, as Spark ignores them.

Ours: ``numPartitions`` (Spark partitions of a read; default: the checkpoint's parallelism), and
where the files are: ``s3.<field>`` for each field of ``dstl.S3Options`` (``s3.endpoint_url``,
``s3.region``, ``s3.access_key_id``, ...) and the DFS call settings ``dfs_timeout_ms``,
``max_attempts``, ``retry_delay_ms`` of ``dstl.ChangelogConfig`` (the same names as there; without
them, ``AWS_*`` and botocore's chain, as for the drop-in). ``operatorId`` may also be an operator's
uid. Option names are case-insensitive (pyspark hands a data source its options lower-cased).

The writer of the same data source (bootstrap, ``backend.spark.state_writer``) reads ``path``,
``stateVarName``, ``operatorId`` (there: the operator's uid) and the storage options with
``Options`` and ``storage_config``, and options of its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from backend.spark.errors import StateSourceError
from dstl import ChangelogConfig, ConfigurationError
from dstl.config import S3Options

__all__ = [
    "Options",
    "SourceOptions",
    "conflict",
    "invalid",
    "parse_options",
    "required",
    "storage_config",
    "storage_of",
]

PATH = "path"
BATCH_ID = "batchId"
OPERATOR_ID = "operatorId"
STORE_NAME = "storeName"
STATE_VAR_NAME = "stateVarName"
READ_REGISTERED_TIMERS = "readRegisteredTimers"
FLATTEN_COLLECTION_TYPES = "flattenCollectionTypes"
READ_CHANGE_FEED = "readChangeFeed"
CHANGE_START_BATCH_ID = "changeStartBatchId"
CHANGE_END_BATCH_ID = "changeEndBatchId"
SNAPSHOT_START_BATCH_ID = "snapshotStartBatchId"
SNAPSHOT_PARTITION_ID = "snapshotPartitionId"
NUM_PARTITIONS = "numPartitions"
#: Spark's store name, the only store an operator has here
DEFAULT_STORE = "default"
#: Spark's options for what the drop-in has not, and why
_NOT_HERE = {
    "joinSide": "the drop-in runs no stream-stream joins",
}
#: the storage options: ``dstl.ChangelogConfig``'s DFS call settings and every ``S3Options`` field
_CONFIG_FIELDS = ("dfs_timeout_ms", "max_attempts", "retry_delay_ms")
_S3_FIELDS = {f.name: f.type for f in dataclasses.fields(S3Options)}


@dataclass(frozen=True)
class SourceOptions:
    """What a read asks for (``parse_options``). ``operator``: ``operatorId`` as given (a place or a
    uid; None: 0); ``storage``: the settings of the DFS the checkpoint is on, its ``base_path`` the
    path (each directory read gets its own base path)."""

    path: str
    storage: ChangelogConfig
    batch_id: int | None = None
    operator: str | None = None
    state_var: str | None = None
    read_timers: bool = False
    flatten: bool = True
    change_feed: bool = False
    change_start: int | None = None
    change_end: int | None = None
    partitions: int | None = None
    #: ``snapshotPartitionId`` (the one partition read) and ``snapshotStartBatchId`` (checked only)
    snapshot_partition: int | None = None
    snapshot_start: int | None = None


def required(option: str) -> StateSourceError:
    return StateSourceError(f"[STDS_REQUIRED_OPTION_UNSPECIFIED] '{option}' must be specified.")


def invalid(option: str, why: str) -> StateSourceError:
    return StateSourceError(
        f"[STDS_INVALID_OPTION_VALUE.WITH_MESSAGE] Invalid value for source option '{option}': {why}"
    )


def _negative(option: str) -> StateSourceError:
    return StateSourceError(
        f"[STDS_INVALID_OPTION_VALUE.IS_NEGATIVE] Invalid value for source option '{option}': cannot be negative."
    )


def conflict(*options: str) -> StateSourceError:
    listed = ", ".join(f"'{o}'" for o in options)
    return StateSourceError(f"[STDS_CONFLICT_OPTIONS] The options {listed} cannot be specified together: specify one.")


class Options:
    """Case-insensitive lookup of the given options, converting and naming the option on a bad value."""

    def __init__(self, given: Mapping[str, Any]) -> None:
        self.given = {str(k).lower(): v for k, v in given.items()}

    def text(self, name: str) -> str | None:
        value = self.given.get(name.lower())
        return None if value is None else str(value)

    def integer(self, name: str, low: int = 0) -> int | None:
        text = self.text(name)
        if text is None:
            return None
        try:
            value = int(text.strip())
        except ValueError:
            raise invalid(name, f"{text!r} is not an integer") from None
        if value < low:
            raise _negative(name) if low == 0 else invalid(name, f"must be at least {low}, got {value}")
        return value

    def boolean(self, name: str, default: bool) -> bool:
        text = self.text(name)
        if text is None:
            return default
        if text.strip().lower() not in ("true", "false"):
            raise invalid(name, f"{text!r} is not a boolean (true or false)")
        return text.strip().lower() == "true"


def parse_options(given: Mapping[str, Any]) -> SourceOptions:
    """The options of one read (a data source's options: case-insensitive, values as text), checked
    as Spark checks its own; a refusal is a ``StateSourceError`` naming the option."""
    options = Options(given)
    path = options.text(PATH)
    if not path or not path.strip():
        raise required(PATH)
    for name, why in _NOT_HERE.items():
        if options.text(name) is not None:
            raise invalid(name, f"not supported: {why}")
    store = options.text(STORE_NAME)
    if store is not None and not store.strip():
        raise StateSourceError(
            f"[STDS_INVALID_OPTION_VALUE.IS_EMPTY] Invalid value for source option '{STORE_NAME}': cannot be empty."
        )
    if store is not None and store.strip() != DEFAULT_STORE:
        raise invalid(STORE_NAME, f"an operator of the drop-in has one store, {DEFAULT_STORE!r}; got {store!r}")
    operator = options.text(OPERATOR_ID)
    if operator is not None and operator.strip().lstrip("-").isdigit() and int(operator) < 0:
        raise _negative(OPERATOR_ID)
    state_var = options.text(STATE_VAR_NAME)
    state_var = state_var.strip() if state_var is not None else None
    read_timers = options.boolean(READ_REGISTERED_TIMERS, False)
    if read_timers and state_var is not None:
        raise conflict(READ_REGISTERED_TIMERS, STATE_VAR_NAME)
    batch_id = options.integer(BATCH_ID)
    change_feed = options.boolean(READ_CHANGE_FEED, False)
    start, end = options.integer(CHANGE_START_BATCH_ID), options.integer(CHANGE_END_BATCH_ID)
    snapshot_start = options.integer(SNAPSHOT_START_BATCH_ID)
    snapshot_partition = options.integer(SNAPSHOT_PARTITION_ID)
    if change_feed:
        if batch_id is not None:
            raise conflict(BATCH_ID, READ_CHANGE_FEED)
        for name, value in ((SNAPSHOT_START_BATCH_ID, snapshot_start), (SNAPSHOT_PARTITION_ID, snapshot_partition)):
            if value is not None:
                raise conflict(name, READ_CHANGE_FEED)
        if start is None:
            raise required(CHANGE_START_BATCH_ID)
        if end is not None and end < start:
            raise invalid(
                CHANGE_END_BATCH_ID,
                f"{CHANGE_END_BATCH_ID} ({end}) cannot be smaller than {CHANGE_START_BATCH_ID} ({start}).",
            )
    else:
        for name, value in ((CHANGE_START_BATCH_ID, start), (CHANGE_END_BATCH_ID, end)):
            if value is not None:
                raise invalid(name, f"only specify this option when {READ_CHANGE_FEED} is set to true.")
        if snapshot_start is not None and batch_id is not None and snapshot_start > batch_id:
            raise invalid(SNAPSHOT_START_BATCH_ID, f"value should be less than or equal to {batch_id}")
        if (snapshot_start is None) != (snapshot_partition is None):  # each partition has its own snapshots
            raise required(SNAPSHOT_START_BATCH_ID if snapshot_start is None else SNAPSHOT_PARTITION_ID)
    return SourceOptions(
        path=path.strip(), storage=storage_config(options, path.strip()), batch_id=batch_id,
        operator=operator.strip() if operator is not None else None, state_var=state_var, read_timers=read_timers,
        flatten=options.boolean(FLATTEN_COLLECTION_TYPES, True), change_feed=change_feed, change_start=start,
        change_end=end, partitions=options.integer(NUM_PARTITIONS, low=1), snapshot_partition=snapshot_partition,
        snapshot_start=snapshot_start,
    )  # fmt: skip


def storage_of(given: Mapping[str, Any], path: str) -> ChangelogConfig:
    """The DFS settings a read's options (``given``) give for ``path``, the other options unchecked."""
    return storage_config(Options(given), path)


def storage_config(options: Options, path: str) -> ChangelogConfig:
    """The DFS settings the options give (``s3.<field>``, ``dfs_timeout_ms``, ...)."""
    s3: dict[str, Any] = {}
    config: dict[str, Any] = {}
    for key in options.given:
        if key.startswith("s3."):
            name = key[len("s3.") :]
            if name not in _S3_FIELDS:
                raise invalid(key, f"not an S3 option; they are s3.{', s3.'.join(sorted(_S3_FIELDS))}")
            s3[name] = _typed(options, key, str(_S3_FIELDS[name]))
    for name in _CONFIG_FIELDS:
        value = options.integer(name)
        if value is not None:
            config[name] = value
    try:
        return ChangelogConfig(base_path=path, s3=S3Options(**s3), **config)
    except ConfigurationError as exc:
        raise StateSourceError(f"{exc} (a storage option of the state data source)") from None


def _typed(options: Options, key: str, annotation: str) -> Any:
    """An S3 option's value as its field's type (``annotation``: the field's annotation text)."""
    if annotation.startswith("int"):
        return options.integer(key)
    if annotation.startswith("bool"):
        return options.boolean(key, False)
    return options.text(key)
