"""What both runners share about one partition of one micro-batch: its rows by key, its clock, its outputs.

``Partition`` groups a partition's rows (pandas frames, pyarrow batches or Rows) by grouping key
and orders the keys as Spark does; ``BatchClock`` makes the backend's clock read the batch's
processing timestamp; ``outputs`` checks what the user's functions yield.

Why the runner owns the clock during the run: Spark's TTL and timeouts count from the batch's
processing timestamp, not the wall clock, so a re-run batch (a retried task, a restarted query)
expires exactly the same state. The backend's ``now_ms`` returns the batch timestamp while the
run's generator runs and is restored when it finishes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from backend.spark.codecs import make_row
from backend.spark.keys import backend_key

if TYPE_CHECKING:
    from backend.state.keyed_backend import ChangelogKeyedStateBackend

__all__ = ["SPARK_MAX_RECORDS_PER_BATCH", "BatchClock", "Group", "Partition", "key_order", "outputs"]

SPARK_MAX_RECORDS_PER_BATCH = 10_000  # spark.sql.execution.arrow.maxRecordsPerBatch


@dataclass
class Group:
    """One grouping key's rows in a partition."""

    key: tuple[Any, ...]  # as Spark hands it to the user (the first row's values)
    key_group: int | None = None  # from the key group column, if the plumbing computed key groups
    ranges: list[tuple[int, int]] = field(default_factory=list)  # pandas: row ranges of the sorted frame
    rows: list[Any] = field(default_factory=list)  # Row API: the Rows


class Partition:
    """The rows of one input (data or initial state) grouped by key; key order is Spark's sort
    order (ascending, nulls first) where the keys compare, else the order of first appearance.
    The key group column, if any, is taken out of the rows the user sees."""

    def __init__(
        self,
        data: Iterable[Any],
        key_columns: Sequence[str],
        use_pandas: bool,
        key_group_column: str | None,
        numpy_keys: bool = False,
    ) -> None:
        self.key_columns = tuple(key_columns)
        self.kg_column = key_group_column
        self.groups: dict[tuple[Any, ...], Group] = {}
        self.frame: Any = None
        self.columns: list[str] | None = None
        if use_pandas:
            self._group_frames(data, numpy_keys)
        else:
            self._group_rows(data)

    def _add(self, key: tuple[Any, ...], key_group: Any) -> Group:
        bkey = backend_key(key)
        group = self.groups.get(bkey)
        if group is None:
            group = self.groups[bkey] = Group(key, None if key_group is None else int(key_group))
        return group

    def _group_frames(self, data: Iterable[Any], numpy_keys: bool) -> None:
        """Group with pandas (hashing in C), then sort the rows by group once (stable: a key's rows
        keep their order), so that each key's rows are one slice of ``self.frame``."""
        import numpy as np
        import pandas as pd  # type: ignore[import-untyped, unused-ignore]

        frames = [_to_pandas(f) for f in data]
        if frames:
            self.columns = [str(c) for c in frames[0].columns if c != self.kg_column]
        frames = [f for f in frames if len(f)]
        if not frames:
            return
        frame = frames[0] if len(frames) == 1 else pd.concat(frames, ignore_index=True)
        key_groups: list[Any] = [None] * len(frame)
        if self.kg_column is not None and self.kg_column in frame.columns:
            key_groups = frame[self.kg_column].tolist()
            frame = frame.drop(columns=[self.kg_column])
        grouped = frame.groupby(list(self.key_columns), sort=False, dropna=False, observed=True)
        codes = grouped.ngroup().to_numpy()
        order = np.argsort(codes, kind="stable")
        ends = np.cumsum(np.bincount(codes)).tolist()
        firsts = order[[0, *ends[:-1]]].tolist()  # each group's first row in the input
        columns = [frame[c] for c in self.key_columns]
        key_lists = [c.tolist() for c in columns]
        start = 0
        for first, end in zip(firsts, ends, strict=True):
            group = self._add(tuple(values[first] for values in key_lists), key_groups[first])
            if numpy_keys and not group.ranges:  # applyInPandasWithState passes numpy scalars
                group.key = tuple(c.iat[first] for c in columns)
            group.ranges.append((start, end))
            start = end
        self.frame = frame.take(order)

    def _group_rows(self, data: Iterable[Any]) -> None:
        for item in data:
            for row in _to_rows(item):
                key_group = None
                if self.kg_column is not None and self.kg_column in getattr(row, "__fields__", ()):
                    names = [n for n in row.__fields__ if n != self.kg_column]
                    key_group = row[self.kg_column]
                    row = make_row(names, [row[n] for n in names])
                self._add(tuple(row[c] for c in self.key_columns), key_group).rows.append(row)

    def frames(self, group: Group, max_records: int) -> Iterator[Any]:
        """The group's rows as DataFrames of at most ``max_records`` rows, index 0..n-1 (as Spark)."""
        if len(group.ranges) == 1:
            rows, (offset, end) = self.frame, group.ranges[0]
        else:  # keys Python calls equal but pandas grouped apart (rare): one frame of all their rows
            import pandas as pd  # type: ignore[import-untyped, unused-ignore]

            rows = pd.concat([self.frame.iloc[s:e] for s, e in group.ranges])
            offset, end = 0, len(rows)
        for start in range(offset, end, max_records):
            yield rows.iloc[start : min(start + max_records, end)].reset_index(drop=True)


def _to_pandas(item: Any) -> Any:
    if hasattr(item, "to_pandas") and not hasattr(item, "iloc"):  # a pyarrow RecordBatch or Table
        return item.to_pandas()
    return item


def _to_rows(item: Any) -> Iterator[Any]:
    """Rows as Spark's Row worker builds them: ``Row(*column names)(*values)``."""
    if hasattr(item, "iloc"):  # pandas: through Arrow, so that NaN becomes None as in Spark
        import pyarrow as pa  # type: ignore[import-untyped, unused-ignore]

        item = pa.Table.from_pandas(item, preserve_index=False)
    if hasattr(item, "column_names") and hasattr(item, "to_pydict"):  # pyarrow RecordBatch or Table
        names = list(item.column_names)
        columns = [item.column(i).to_pylist() for i in range(len(names))]
        for values in zip(*columns, strict=True):
            yield make_row(names, values)
    else:
        yield item


def _sort_key(key: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple((0,) if v is None or v != v else (1, v) for v in key)


def key_order(*partitions: Partition) -> list[tuple[Any, ...]]:
    keys = list(dict.fromkeys(k for p in partitions for k in p.groups))
    with contextlib.suppress(TypeError):  # keys of mixed types: keep the order of first appearance
        keys.sort(key=_sort_key)
    return keys


class BatchClock:
    """Swap the backend's clock for the batch timestamp while a run is active."""

    def __init__(self, backend: ChangelogKeyedStateBackend, now_ms: int) -> None:
        self.backend, self.now_ms = backend, now_ms
        self.saved: Callable[[], int] | None = None

    def __enter__(self) -> None:
        self.saved = self.backend.now_ms
        now = self.now_ms
        self.backend.now_ms = lambda: now

    def __exit__(self, *exc: object) -> None:
        assert self.saved is not None
        self.backend.now_ms = self.saved


def outputs(result: Any, use_pandas: bool, what: str) -> Iterator[Any]:
    if result is None:
        return
    if use_pandas and hasattr(result, "iloc"):
        raise TypeError(f"{what} must return an iterator of pandas.DataFrame, not a DataFrame (use yield)")
    for item in result:
        if use_pandas and not hasattr(item, "iloc"):
            raise TypeError(f"{what} must yield pandas.DataFrame, got {type(item).__name__}")
        yield item
