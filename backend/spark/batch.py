"""What both runners share about one partition of one micro-batch: its rows by key, its clock, its outputs.

``Partition`` groups a partition's rows (pandas frames, pyarrow batches or Rows) by grouping key
and orders the keys as Spark does; ``BatchClock`` makes the backend's clock read the batch's
processing timestamp; ``outputs`` checks what the user's functions yield.

Why the rows are converted again: they arrive as ``mapInPandas`` frames, and each of Spark's
operators hands its rows to user code in its own way (checked against pyspark 4.3, see
tests/backend/spark/test_types_parity.py). ``transformWithStateInPandas`` rebuilds each key's
frame from ``itertuples`` (ints widened to int64, floats to float64, a null int a float NaN,
column names a namedtuple accepts); ``applyInPandasWithState`` keeps Arrow's dtypes (a null int a
float NaN); ``transformWithState`` builds Rows from Arrow scalars (timestamps aware in the
session time zone, timestamp_ntz naive, maps lists of (key, value) pairs, structs dicts), which
needs the input's Spark schema (``RowTypes``): a pandas frame cannot tell a timestamp from a
timestamp_ntz, nor a map from a struct.

Why a partition measures its rows' Arrow size: with ``spark.sql.execution.arrow.maxBytesPerBatch``
set, Spark's JVM ends an Arrow batch of ``transformWithStateInPandas``'s input once its buffers
reach that size (or ``maxRecordsPerBatch`` rows), keys packed one after the other, and the Python
worker ends a key's DataFrame at the row that makes ``rows * average row size >= maxBytesPerBatch``,
the average over the buffers of the batches it has read so far. ``byte_chunks`` replays both on
the partition's rows in Spark's order, each row's size estimated as Spark's Arrow buffers hold it
(``Partition.row_bytes``: fixed-width values, strings and binary with their 32-bit offset; per
batch a validity bitmap per column and one more offset per variable-length column), and gives each
key its chunk sizes. The partitions are the drop-in's (see docs/spark-parity.md), so a batch
boundary, and with it the average, can fall elsewhere than in Spark's partition.

Why the runner owns the clock during the run: Spark's TTL and timeouts count from the batch's
processing timestamp, not the wall clock, so a re-run batch (a retried task, a restarted query)
expires exactly the same state. The backend's ``now_ms`` returns the batch timestamp while the
run's generator runs and is restored when it finishes.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import keyword
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from backend.spark.keys import backend_key
from backend.spark.rows import make_row
from backend.spark.schema import SparkType, input_type

if TYPE_CHECKING:
    from backend.state.keyed_backend import ChangelogKeyedStateBackend

__all__ = [
    "SPARK_MAX_BYTES_PER_BATCH",
    "SPARK_MAX_RECORDS_PER_BATCH",
    "BatchClock",
    "Group",
    "Partition",
    "RowTypes",
    "byte_chunks",
    "key_order",
    "outputs",
    "read_ahead",
]

SPARK_MAX_RECORDS_PER_BATCH = 10_000  # spark.sql.execution.arrow.maxRecordsPerBatch
SPARK_MAX_BYTES_PER_BATCH = 2**31 - 1  # spark.sql.execution.arrow.maxBytesPerBatch: no limit


@dataclass
class Group:
    """One grouping key's rows in a partition."""

    key: tuple[Any, ...]  # as Spark hands it to the user (the first row's values)
    key_group: int | None = None  # from the key group column, if the plumbing computed key groups
    ranges: list[tuple[int, int]] = field(default_factory=list)  # pandas: row ranges of the sorted frame
    chunks: list[int] | None = None  # pandas: the sizes of its DataFrames, if set by ``byte_chunks
    rows: list[Any] = field(default_factory=list)  # Row API: the Rows

    def __len__(self) -> int:
        return sum(end - start for start, end in self.ranges) + len(self.rows)


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
        row_types: RowTypes | None = None,
        input_schema: Any = None,
        measure_arrow: bool = False,
    ) -> None:
        """``numpy_keys``: applyInPandasWithState's conventions (keys of numpy scalars, Arrow's
        dtypes per key), else transformWithStateInPandas's. ``row_types``: how the Row API converts
        the input's columns (None: as pyarrow infers them from the frame). ``input_schema``
        (pyspark ``StructType``): tells applyInPandasWithState's int columns from float ones.
        ``measure_arrow``: estimate each row's Arrow size (``row_bytes``, pandas only)."""
        self.key_columns = tuple(key_columns)
        self.kg_column = key_group_column
        self.groups: dict[tuple[Any, ...], Group] = {}
        self.frame: Any = None
        self.columns: list[str] | None = None
        #: per-key dtypes of columns whose dtype depends on nulls: (position, dtype when the key's
        #: rows hold no null, conversion when they do or None); Spark converts each key's rows apart
        self.chunk_dtypes: list[tuple[int, Any, Callable[[Any], Any] | None]] = []
        #: each row's estimated bytes in Spark's Arrow batches (aligned with ``frame``), and per
        #: batch the number of bitmaps and of variable-length columns
        self.row_bytes: Any = None
        self.bitmaps, self.variable = 0, 0
        self.measure_arrow = measure_arrow
        if use_pandas:
            self._group_frames(data, numpy_keys, input_schema)
        else:
            self._group_rows(data, row_types)

    def _add(self, key: tuple[Any, ...], key_group: Any) -> Group:
        bkey = backend_key(key, self.key_columns)
        group = self.groups.get(bkey)
        if group is None:
            group = self.groups[bkey] = Group(key, None if key_group is None else int(key_group))
        return group

    def _group_frames(self, data: Iterable[Any], numpy_keys: bool, input_schema: Any) -> None:
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
        if self.measure_arrow:  # before the dtypes are widened: Spark sends the input's types
            self.row_bytes, self.bitmaps, self.variable = _row_sizes(frame, self.kg_column)
        key_groups: list[Any] = [None] * len(frame)
        if self.kg_column is not None and self.kg_column in frame.columns:
            key_groups = frame[self.kg_column].tolist()
            frame = frame.drop(columns=[self.kg_column])
        grouped = frame.groupby(list(self.key_columns), sort=False, dropna=False, observed=True)
        try:
            codes = grouped.ngroup().to_numpy()
        except TypeError:  # unhashable keys (a struct's dicts, an array's lists): say which column
            for values in zip(*(frame[c].tolist() for c in self.key_columns), strict=True):
                backend_key(values, self.key_columns)
            raise
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
        if self.row_bytes is not None:
            self.row_bytes = self.row_bytes[order]
        if numpy_keys:  # applyInPandasWithState: Arrow's dtypes, converted per key
            self.frame = frame.take(order)
            self.chunk_dtypes = _per_key_dtypes(self.frame, _int_columns(input_schema))
        else:  # transformWithStateInPandas: per Arrow batch, then pandas infers a key's frame again
            self.frame = _widened(frame.take(order))
            self.frame.columns = _namedtuple_fields(list(self.frame.columns))  # itertuples' field names
            self.chunk_dtypes = [(i, bool, None) for i in _nullable_bools(self.frame)]

    def _group_rows(self, data: Iterable[Any], row_types: RowTypes | None) -> None:
        for item in data:
            for row in _to_rows(item, row_types):
                key_group = None
                if self.kg_column is not None and self.kg_column in getattr(row, "__fields__", ()):
                    names = [n for n in row.__fields__ if n != self.kg_column]
                    key_group = row[self.kg_column]
                    row = make_row(names, [row[n] for n in names])
                self._add(tuple(row[c] for c in self.key_columns), key_group).rows.append(row)

    def frames(self, group: Group, max_records: int, first: int | None = None) -> Iterator[Any]:
        """The group's rows as DataFrames of at most ``max_records`` rows (the first of at most
        ``first``), or of the sizes ``group.chunks``, index 0..n-1 (as Spark)."""
        if len(group.ranges) == 1:
            rows, (offset, end) = self.frame, group.ranges[0]
            if group.chunks is not None:
                yield from self._chunks(rows, offset, group.chunks)
                return
        else:  # keys Python calls equal but pandas grouped apart (rare): one frame of all their rows
            import pandas as pd  # type: ignore[import-untyped, unused-ignore]

            rows = pd.concat([self.frame.iloc[s:e] for s, e in group.ranges])
            offset, end = 0, len(rows)
        if group.chunks is not None:
            yield from self._chunks(rows, offset, group.chunks)
            return
        bounds = [offset, *range(offset + (max_records if first is None else first), end, max_records), end]
        for start, stop in itertools.pairwise(bounds):
            if start < stop:
                yield self._chunk(rows, start, stop)

    def _chunks(self, rows: Any, offset: int, sizes: list[int]) -> Iterator[Any]:
        for size in sizes:
            yield self._chunk(rows, offset, offset + size)
            offset += size

    def _chunk(self, rows: Any, start: int, stop: int) -> Any:
        chunk = rows.iloc[start:stop].reset_index(drop=True)
        for i, complete, with_nulls in self.chunk_dtypes:
            column = chunk.iloc[:, i]
            if column.notna().all():
                chunk.isetitem(i, column.astype(complete))
            elif with_nulls is not None:
                chunk.isetitem(i, with_nulls(column))
        return chunk


def _row_sizes(frame: Any, exclude: str | None) -> tuple[Any, int, int]:
    """Each row's bytes in Spark's Arrow buffers (float: a nested column counts its average), and
    the bitmaps (validity per column, boolean values) and variable-length columns of a batch. A
    column pyarrow cannot convert counts nothing."""
    import numpy as np
    import pyarrow as pa  # type: ignore[import-untyped, unused-ignore]
    import pyarrow.compute as pc  # type: ignore[import-untyped, unused-ignore]

    rows = len(frame)
    sizes = np.zeros(rows, dtype=np.float64)
    bitmaps = variable = 0
    for i, name in enumerate(frame.columns):
        if name == exclude:
            continue
        try:
            array = pa.Array.from_pandas(frame.iloc[:, i])
        except (pa.ArrowException, TypeError, ValueError):
            continue
        bitmaps += 1
        kind = array.type
        if pa.types.is_boolean(kind):
            bitmaps += 1
        elif pa.types.is_string(kind) or pa.types.is_binary(kind):
            variable += 1
            sizes += pc.binary_length(array).fill_null(0).to_numpy(zero_copy_only=False) + 4
        elif pa.types.is_null(kind):
            pass
        elif not pa.types.is_nested(kind) and kind.bit_width % 8 == 0:
            sizes += kind.bit_width // 8
        elif rows:
            sizes += sum(0 if b is None else b.size for b in array.buffers()) / rows
    return sizes, bitmaps, variable


def byte_chunks(max_records: int, max_bytes: int, *partitions: Partition | None) -> None:
    """Set each group's DataFrame sizes (``Group.chunks``) as Spark cuts them under both limits.

    The rows go in Spark's order: each partition's keys in ``key_order``, the partitions in the
    order given (initial state first). The JVM ends an Arrow batch at ``max_records`` rows or
    once its bytes reach ``max_bytes``; the worker's average row size is over the batches read up
    to the current row's; a key's rows (one run across the partitions if consecutive) end a
    DataFrame at the row where ``rows >= max_records`` or ``rows * average >= max_bytes``."""
    import numpy as np

    runs: list[tuple[Partition, Group, tuple[Any, ...]]] = []
    for part in partitions:
        if part is not None and part.row_bytes is not None:
            runs += [(part, part.groups[bkey], bkey) for bkey in key_order(part)]
    if not runs:
        return
    sizes = np.concatenate([p.row_bytes[s:e] for p, g, _ in runs for s, e in g.ranges]).tolist()
    per_batch: list[tuple[int, int]] = []  # each row's partition layout (bitmaps, variable columns)
    for part, group, _ in runs:
        per_batch += [(part.bitmaps, part.variable)] * len(group)
    average = [0.0] * len(sizes)  # the worker's average when it handles each row
    total_bytes, total_rows, start = 0.0, 0, 0
    while start < len(sizes):
        bitmaps, variable = per_batch[start]
        stop, body = start, 0.0
        while stop < len(sizes) and stop - start < max_records:
            body += sizes[stop]
            stop += 1
            if body + bitmaps * ((stop - start + 7) // 8) + 4 * variable >= max_bytes:
                break
        total_bytes += body + bitmaps * ((stop - start + 7) // 8) + 4 * variable
        total_rows += stop - start
        average[start:stop] = [total_bytes / total_rows] * (stop - start)
        start = stop
    position, count, previous = 0, 0, None
    for _, group, bkey in runs:
        if bkey != previous:
            count, previous = 0, bkey
        chunks: list[int] = []
        open_rows = 0
        for _ in range(len(group)):
            count += 1
            open_rows += 1
            if count >= max_records or count * average[position] >= max_bytes:
                chunks.append(open_rows)
                open_rows, count = 0, 0
            position += 1
        if open_rows:
            chunks.append(open_rows)
        group.chunks = chunks


def _to_pandas(item: Any) -> Any:
    if hasattr(item, "to_pandas") and not hasattr(item, "iloc"):  # a pyarrow RecordBatch or Table
        return item.to_pandas()
    return item


def _to_rows(item: Any, row_types: RowTypes | None) -> Iterator[Any]:
    """Rows as Spark's Row worker builds them: ``Row(*column names)(*values of Arrow scalars)``."""
    if hasattr(item, "iloc"):  # pandas: through Arrow, so that NaN becomes None as in Spark
        names = [str(c) for c in item.columns]
        columns = [_column_values(item.iloc[:, i], row_types, name) for i, name in enumerate(names)]
    elif hasattr(item, "column_names") and hasattr(item, "to_pydict"):  # pyarrow RecordBatch or Table
        names = list(item.column_names)
        columns = [item.column(i).to_pylist() for i in range(len(names))]
    else:
        yield item
        return
    for values in zip(*columns, strict=True):
        yield make_row(names, values)


def _column_values(series: Any, row_types: RowTypes | None, name: str) -> list[Any]:
    """One frame column as the Row API's Python values: through the Arrow type Spark sends (typed
    by the input's schema when known), then timestamps made aware in the session time zone."""
    import pyarrow as pa  # type: ignore[import-untyped, unused-ignore]

    arrow_type = row_types.arrow.get(name) if row_types is not None else None
    values: list[Any] | None = None
    if arrow_type is not None:
        try:
            values = pa.array(series, type=arrow_type, from_pandas=True).to_pylist()
        except (pa.ArrowException, TypeError, ValueError):
            values = None  # a column the schema does not describe after all: as pyarrow infers it
    if values is None:
        return pa.array(series, from_pandas=True).to_pylist()  # type: ignore[no-any-return]
    localize = row_types.localize.get(name) if row_types is not None else None
    return values if localize is None else [localize(v) for v in values]


@dataclass(frozen=True)
class RowTypes:
    """How the Row API converts input columns: the Arrow type of each column Spark sends (with
    naive timestamps: a frame holds session wall-clock times) and, for columns holding
    timestamps, a function making them aware in the session time zone, as Arrow's ``as_py`` does
    for Spark's session-zoned timestamps. A wall-clock time the zone passes twice (the hour
    repeated when daylight saving time ends) is taken as its first occurrence: the frame no
    longer tells which one it was."""

    arrow: dict[str, Any]
    localize: dict[str, Callable[[Any], Any]]

    @classmethod
    def of(cls, schema: Any, timezone: str | None) -> RowTypes:
        """From the input's pyspark ``StructType`` and the session time zone (None: the local one)."""
        import pyarrow as pa  # type: ignore[import-untyped, unused-ignore]

        if timezone is None:
            tzinfo: Any = datetime.datetime.now().astimezone().tzinfo
        else:  # the tzinfo Arrow's as_py attaches (a ZoneInfo, or a fixed offset)
            tzinfo = pa.scalar(0, type=pa.timestamp("us", tz=timezone)).as_py().tzinfo
        arrow: dict[str, Any] = {}
        localize: dict[str, Callable[[Any], Any]] = {}
        for column in schema.fields:
            dtype = input_type(column.dataType)
            arrow_type = _arrow_type(dtype)
            if arrow_type is not None:
                arrow[column.name] = arrow_type
                converter = _localizer(dtype, tzinfo)
                if converter is not None:
                    localize[column.name] = converter
        return cls(arrow, localize)


def _arrow_type(dtype: SparkType) -> Any:
    """The Arrow type of a Spark type, timestamps naive; None for a type left to inference."""
    import pyarrow as pa  # type: ignore[import-untyped, unused-ignore]

    simple = {
        "long": pa.int64(), "int": pa.int32(), "short": pa.int16(), "byte": pa.int8(), "double": pa.float64(),
        "float": pa.float32(), "string": pa.string(), "boolean": pa.bool_(), "binary": pa.binary(),
        "timestamp": pa.timestamp("us"), "timestamp_ntz": pa.timestamp("us"), "date": pa.date32(),
    }  # fmt: skip
    if dtype.name in simple:
        return simple[dtype.name]
    if dtype.name == "decimal":
        return pa.decimal128(dtype.precision, dtype.scale)
    if dtype.name == "struct":
        fields = [(f.name, _arrow_type(f.type)) for f in dtype.fields]
        return None if any(t is None for _, t in fields) else pa.struct(fields)
    if dtype.name in ("array", "map") and dtype.element is not None:
        element = _arrow_type(dtype.element)
        if dtype.value is None:
            return None if element is None else pa.list_(element)
        value = _arrow_type(dtype.value)
        return None if element is None or value is None else pa.map_(element, value)
    return None


def _localizer(dtype: SparkType, tzinfo: Any) -> Callable[[Any], Any] | None:
    """Wall-clock datetimes -> aware ones in ``tzinfo``, wherever ``dtype`` holds a timestamp
    (arrays are lists, maps lists of pairs, structs dicts); None where it holds none."""
    if dtype.name == "timestamp":
        return lambda v: None if v is None else v.replace(tzinfo=tzinfo)
    if dtype.name == "struct":
        fields = [(f.name, _localizer(f.type, tzinfo)) for f in dtype.fields]
        if all(c is None for _, c in fields):
            return None
        return lambda v: None if v is None else {n: v.get(n) if c is None else c(v.get(n)) for n, c in fields}
    if dtype.name in ("array", "map") and dtype.element is not None:
        element = _localizer(dtype.element, tzinfo)
        if dtype.value is None:
            return None if element is None else (lambda v: None if v is None else [element(x) for x in v])
        value = _localizer(dtype.value, tzinfo)
        if element is None and value is None:
            return None
        key_of = element or (lambda k: k)
        value_of = value or (lambda x: x)
        return lambda v: None if v is None else [(key_of(k), value_of(x)) for k, x in v]
    return None


def _widened(frame: Any) -> Any:
    """transformWithStateInPandas's dtypes: ints int64 (a pandas nullable int holding a null
    float64, NaN), floats float64, a nullable boolean holding a null an object column."""
    import numpy as np
    import pandas as pd

    changed: dict[int, Any] = {}
    for i, dtype in enumerate(frame.dtypes):
        column = frame.iloc[:, i]
        if isinstance(dtype, pd.api.extensions.ExtensionDtype):
            if dtype.kind in "iu":
                changed[i] = column.astype(np.float64 if column.isna().any() else np.int64)
            elif dtype.kind == "b":
                changed[i] = _object_bools(column) if column.isna().any() else column.astype(bool)
            elif dtype.kind == "f":
                changed[i] = column.astype(np.float64)
        elif dtype.kind in "iu" and dtype != np.int64:
            changed[i] = column.astype(np.int64)
        elif dtype.kind == "f" and dtype != np.float64:
            changed[i] = column.astype(np.float64)
    if not changed:
        return frame
    frame = frame.copy(deep=False)
    for i, converted in changed.items():
        frame.isetitem(i, converted)
    return frame


def _object_bools(column: Any) -> Any:
    return column.astype(object).where(column.notna(), None)


def _as_float(column: Any) -> Any:
    return column.astype("float64")


def _int_columns(input_schema: Any) -> dict[str, str]:
    """The numpy dtype of each integral column of the input (by its Spark type)."""
    if input_schema is None:
        return {}
    numpy = {"long": "int64", "int": "int32", "short": "int16", "byte": "int8"}
    types = {f.name: input_type(f.dataType).name for f in input_schema.fields}
    return {name: numpy[t] for name, t in types.items() if t in numpy}


def _per_key_dtypes(frame: Any, int_columns: dict[str, str]) -> list[tuple[int, Any, Callable[[Any], Any] | None]]:
    """applyInPandasWithState's per-key dtypes: an int column is its numpy int for a key without
    nulls and float64 (NaN) for one with; a boolean column bool, or object (None)."""
    import pandas as pd

    fixes: list[tuple[int, Any, Callable[[Any], Any] | None]] = []
    for i, dtype in enumerate(frame.dtypes):
        name = str(frame.columns[i])
        if isinstance(dtype, pd.api.extensions.ExtensionDtype) and dtype.kind in "iu":
            fixes.append((i, dtype.numpy_dtype, _as_float))
        elif isinstance(dtype, pd.api.extensions.ExtensionDtype) and dtype.kind == "b":
            fixes.append((i, bool, _object_bools))
        elif dtype.kind == "f" and name in int_columns:  # an int column with a null, as Arrow gives it
            fixes.append((i, int_columns[name], None))
    fixes += [(i, bool, None) for i in _nullable_bools(frame)]
    return fixes


def _nullable_bools(frame: Any) -> list[int]:
    """Positions of the object columns holding only booleans and nulls (some)."""
    from pandas.api.types import infer_dtype  # type: ignore[import-untyped, unused-ignore]

    columns = [(i, frame.iloc[:, i]) for i, dtype in enumerate(frame.dtypes) if dtype.kind == "O"]
    return [i for i, c in columns if infer_dtype(c, skipna=True) == "boolean" and c.isna().any()]


def _namedtuple_fields(columns: list[Any]) -> list[Any]:
    """The column names of a frame rebuilt from ``itertuples``: what a namedtuple makes of them
    (an invalid identifier, a keyword, a leading underscore or a duplicate becomes ``_<position>``)."""
    import collections

    fields = [str(c) for c in columns]
    if all(f.isidentifier() and not f.startswith("_") and not keyword.iskeyword(f) for f in fields) and len(
        set(fields)
    ) == len(fields):
        return columns
    return list(collections.namedtuple("Pandas", fields, rename=True)._fields)  # type: ignore[attr-defined]


def _sort_key(key: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple((0,) if v is None or v != v else (1, v) for v in key)


def key_order(*partitions: Partition) -> list[tuple[Any, ...]]:
    keys = list(dict.fromkeys(k for p in partitions for k in p.groups))
    with contextlib.suppress(TypeError):  # keys of mixed types: keep the order of first appearance
        keys.sort(key=_sort_key)
    return keys


def read_ahead(backend: ChangelogKeyedStateBackend, *partitions: Partition | None) -> Any:
    """``backend.batch`` over the keys of ``partitions`` (a context manager): their state is read
    ahead, in key order, before the user's code runs; each key in the key group the plumbing
    computed, if it did."""
    groups = [(bkey, g.key_group) for p in partitions if p is not None for bkey, g in p.groups.items()]
    keys = [bkey for bkey, _ in groups]
    key_groups = [key_group for _, key_group in groups if key_group is not None]
    return backend.batch(keys, key_groups if groups and len(key_groups) == len(groups) else None)


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
