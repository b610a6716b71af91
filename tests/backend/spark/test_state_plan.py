"""The state data source's planning without Spark: its options as Spark's ``statestore`` reads
them, its columns as Spark's, which checkpoints count as retained, and which log segments hold a
batch's changes (``backend.spark.state_options``, ``state_columns``, ``state_plan``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from backend.spark.errors import StateSourceError
from backend.spark.state_columns import StateColumns
from backend.spark.state_options import parse_options
from backend.spark.state_plan import batch_segments, completed_checkpoints, open_storage
from dstl import ChangelogConfig, KeyGroupRange
from dstl.types import ChangelogHandle, SegmentRef

KEY = (("id", "string"), ("n", "int"))


def test_the_options_default_as_sparks() -> None:
    options = parse_options({"path": "/x", "stateVarName": " total "})
    assert (options.state_var, options.batch_id, options.operator, options.flatten, options.change_feed) == (
        "total", None, None, True, False,
    )  # fmt: skip
    given = {"PATH": "/x", "readchangefeed": "TRUE", "ChangeStartBatchId": "2", "flattenCollectionTypes": "false"}
    options = parse_options(given)  # names are case-insensitive, as pyspark hands them over
    assert (options.change_feed, options.change_start, options.change_end, options.flatten) == (True, 2, None, False)


@pytest.mark.parametrize(
    ("given", "error"),
    [
        ({}, r"\[STDS_REQUIRED_OPTION_UNSPECIFIED\] 'path' must be specified"),
        ({"batchId": "x"}, r"'batchId': 'x' is not an integer"),
        ({"batchId": "-2"}, r"IS_NEGATIVE.*'batchId': cannot be negative"),
        ({"operatorId": "-1"}, r"IS_NEGATIVE.*'operatorId'"),
        ({"readChangeFeed": "true", "changeStartBatchId": "3", "changeEndBatchId": "2"}, r"cannot be smaller"),
        ({"changeStartBatchId": "1"}, r"'changeStartBatchId': only specify this option when readChangeFeed"),
        ({"readRegisteredTimers": "true", "stateVarName": "a"}, r"CONFLICT_OPTIONS.*'readRegisteredTimers'"),
        ({"flattenCollectionTypes": "yes"}, r"'flattenCollectionTypes': 'yes' is not a boolean"),
        ({"storeName": " "}, r"IS_EMPTY.*'storeName'"),
        ({"snapshotPartitionId": "0"}, r"REQUIRED_OPTION_UNSPECIFIED\] 'snapshotStartBatchId' must be specified"),
        ({"snapshotStartBatchId": "0"}, r"REQUIRED_OPTION_UNSPECIFIED\] 'snapshotPartitionId' must be specified"),
        ({"snapshotStartBatchId": "3", "snapshotPartitionId": "0", "batchId": "2"}, r"less than or equal to 2"),
        ({"snapshotStartBatchId": "-1", "snapshotPartitionId": "0"}, r"IS_NEGATIVE.*'snapshotStartBatchId'"),
        ({"readChangeFeed": "true", "changeStartBatchId": "0", "snapshotPartitionId": "0"}, r"CONFLICT.*'snapshotPar"),
        ({"joinSide": "left"}, r"'joinSide': not supported"),
        ({"numPartitions": "0"}, r"'numPartitions': must be at least 1"),
        ({"s3.endpoint": "http://x"}, r"'s3.endpoint': not an S3 option; they are s3.access_key_id"),
        ({"max_attempts": "0"}, r"max_attempts must be positive"),
    ],
)
def test_bad_options_are_refused_naming_the_option(given: dict[str, str], error: str) -> None:
    with pytest.raises(StateSourceError, match=error):
        parse_options({"path": "/x", **given} if given else {})


def test_a_snapshot_partition_is_read_with_its_start_batch() -> None:
    options = parse_options({"path": "/x", "snapshotPartitionId": "7", "snapshotStartBatchId": "0", "batchId": "1"})
    assert (options.snapshot_partition, options.snapshot_start, options.batch_id) == (7, 0, 1)


def test_storage_options_reach_the_changelog_config() -> None:
    given = {"path": "s3://b/p", "s3.endpoint_url": "http://h:1", "s3.read_timeout_ms": "7", "s3.force_close": "true",
             "dfs_timeout_ms": "9"}  # fmt: skip
    storage = parse_options(given).storage
    assert (storage.base_path, storage.dfs_timeout_ms) == ("s3://b/p", 9)
    assert (storage.s3.endpoint_url, storage.s3.read_timeout_ms, storage.s3.force_close) == ("http://h:1", 7, True)


V = "a bigint"
NESTED = "struct<`a`: bigint>"
KEY_TYPE = "struct<`id`: string, `n`: int>"
COLUMNS = {
    "value": (StateColumns("value", KEY, V), f"`key` {KEY_TYPE}, `value` {NESTED}"),
    "value-ttl": (StateColumns("value", KEY, V, ttl=True), f"`value` struct<value: {NESTED}, ttlExpirationMs: bigint>"),
    "group-state": (
        StateColumns("value", KEY, V, group_state=True),
        f"`value` struct<groupState: {NESTED}, timeoutTimestamp: bigint>",
    ),
    "list": (StateColumns("list", KEY, V), f"`list_element` {NESTED}"),
    "list-nested": (StateColumns("list", KEY, V, flatten=False), f"`list_value` array<{NESTED}>"),
    "map": (StateColumns("map", KEY, V, "k string"), f"`user_map_key` struct<`k`: string>, `user_map_value` {NESTED}"),
    "map-nested": (
        StateColumns("map", KEY, V, "k string", flatten=False),
        f"`map_value` map<struct<`k`: string>, {NESTED}>",
    ),
    "timers": (StateColumns("timers", KEY), "`expiration_timestamp_ms` bigint"),
    "change-feed": (
        StateColumns("list", KEY, V, flatten=False, change_feed=True),
        f"`batch_id` bigint, `change_type` string, `key` {KEY_TYPE}, `list_element`",
    ),
}


@pytest.mark.parametrize(("columns", "ddl"), COLUMNS.values(), ids=COLUMNS.keys())
def test_the_columns_are_sparks(columns: StateColumns, ddl: str) -> None:
    assert ddl in columns.ddl()
    assert columns.ddl().endswith("`partition_id` int")


def test_retained_checkpoints_leave_out_fenced_and_voided_ones(tmp_path: Path) -> None:
    with open_storage(ChangelogConfig(base_path=str(tmp_path)), str(tmp_path)) as storage:
        for checkpoint in (1, 2, 3, 5, 6):
            storage.files.put(f"chk-{checkpoint}/_metadata", b"{}")
        storage.files.put("chk-4/_aborted", b"")  # a fence without its _metadata
        storage.files.put("chk-3/_aborted", b"")
        storage.files.put("_void/5-5", b"{}")
        storage.files.put("chk-9/other", b"")
        assert completed_checkpoints(storage.files) == [1, 2, 6]


def _segment(path: str, sqn: int) -> SegmentRef:
    return SegmentRef(path=path, offset=0, length=1, sqn=sqn, records=1, min_key_group=0, max_key_group=3)


def _pending(batch: int, n: int) -> str:
    return f"pending/{batch}/op/{n:032x}.dstl"


def test_a_batchs_segments_are_its_files_and_the_early_uploads_before_them() -> None:
    """A batch's final persist lands in its pending directory; a preemptive persist of the same
    batch, before it, in a file of no batch."""
    segments = (
        _segment(_pending(1, 1), 1), _segment("dstl/0a/early", 2), _segment("dstl/0b/early", 3),
        _segment(_pending(2, 2), 4), _segment(_pending(3, 3), 5), _segment("dstl/0c/early", 6),
    )  # fmt: skip
    log = ChangelogHandle("op.log", KeyGroupRange(0, 3), 0, 7, segments)

    def sqns(batch: int) -> list[Any]:
        return [s.sqn for s in batch_segments(log, batch)]

    assert (sqns(1), sqns(2), sqns(3), sqns(4)) == ([1], [2, 3, 4], [5], [])
