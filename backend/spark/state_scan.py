"""Reading one partition of the state data source, on an executor: rows in Spark's columns.

A state partition restores the handles of its key groups (``state_plan.StatePart``) into a scratch
backend (LMDB in a temporary directory, no log) as a rescaled restore does: the owned parts of
the chunks (byte ranges of their packs) and the log records of those key groups only. Its rows
are then read table by table, as ``dstl state read`` reads them: a state's older schema versions
are read through and converted to the current schema (``versions.newest_entries``), keys are
decoded with the canonical key encoding, values with the state's recorded serializer and turned
into the declared Spark types' Python values (``codecs``: what ``ValueState.get`` hands a
processor). Values whose TTL expired at the checkpoint's batch timestamp are left out, as the
processor no longer saw them. Nothing read is unpickled (``serializer_for_id`` refuses pickle).

A change partition reads each batch's log segments of its key groups (``state_plan.ChangePart``)
and turns every change record of the state into Spark's change rows: ``update`` (a value set, a
list set, a map entry put: the new value; a list set gives a row per element), ``append`` (list
elements added, a row each, as Spark's change feed shows a list's merge), ``delete`` (a value or a
key's list or map cleared: a null value, or a map entry removed: its user key). A state's older
schema versions log CLEARs when a key moves to the current one: a key also changed in the current
version in that batch was moved, not deleted, and gets no delete row. Timers: ``update`` when
registered, ``delete`` when deleted or fired.

How the rows reach Spark (``arrow_batches``): pyspark's data source worker turns the tuples a
reader yields into Arrow one value at a time in Python (a dict per struct, a check per field),
which costs about as much as restoring and decoding them. A reader may instead yield pyarrow
record batches in the Arrow schema the worker derives from the read's schema (``to_arrow_schema``);
pyarrow builds those from the same tuples, lists and dicts column by column in C. This is done
where pyarrow's conversion of our values is the one pyspark's would give: columns of numbers,
booleans, strings and dates, in nullable structs, arrays and maps. A read of any other type
(timestamps, decimals, binary, a NOT NULL field) yields its rows as tuples, converted by pyspark.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any

from backend.core import records as rec
from backend.core.errors import SerializationError, StateRestoreError
from backend.core.handles import KeyedStateHandle
from backend.core.records import Op
from backend.core.serializers import deserialize_key, serializer_for_id
from backend.core.tablekeys import key_group_of, key_of, parse_timer_user_key, split_table_key
from backend.spark.codecs import struct_codec
from backend.spark.state_columns import APPEND, DELETE, UPDATE
from backend.spark.state_plan import BatchChanges, ChangePart, ScanPlan, StatePart, open_storage
from backend.state import versions
from backend.state.keyed_backend import ChangelogKeyedStateBackend
from backend.state.timers import TIMERS_DB, TIMERS_SID
from dstl import ChangelogStorage, KeyGroupRange
from dstl.types import ChangelogHandle
from materializer.periodic import restore

__all__ = ["arrow_batches", "scan_changes", "scan_state"]

Row = tuple[Any, ...]
Decode = Callable[[bytes], Any]
#: a value left out: its TTL expired
_EXPIRED = object()
#: rows per Arrow batch: Spark's default ``spark.sql.execution.arrow.maxRecordsPerBatch``
ARROW_BATCH_ROWS = 10_000
#: rows turned into Arrow at once (``arrow_batches``)
CONVERT_ROWS = 500


class _Keys:
    """Table keys to (grouping key struct, key group), the last one remembered (a key's entries are
    adjacent)."""

    def __init__(self) -> None:
        self.last: bytes | None = None
        self.decoded: tuple[tuple[Any, ...], int] = ((), 0)

    def __call__(self, ck: bytes) -> tuple[tuple[Any, ...], int]:
        if ck != self.last:
            key = deserialize_key(bytes(key_of(ck)))
            self.decoded = (key if isinstance(key, tuple) else (key,), key_group_of(ck))
            self.last = ck
        return self.decoded


class _Values:
    """How one state's stored bytes become its column values: the value struct (wrapped with its
    TTL expiry, or as applyInPandasWithState's groupState and timeout), and a map's user key."""

    def __init__(self, plan: ScanPlan, meta: dict[str, Any]) -> None:
        name, columns = str(plan.state), plan.columns
        assert columns.value_schema is not None
        self.name, self.ttl, self.group_state, self.now = name, columns.ttl, columns.group_state, plan.now_ms
        self.codec = struct_codec(columns.value_schema, name)
        serializer = serializer_for_id(str(meta["serializer"]))
        current = versions.table_name(name, versions.version_of(meta))
        #: (table, decode) of the state's schema versions, newest first
        self.tables: list[tuple[str, Decode]] = [(current, serializer.deserialize)]
        self.tables += versions.decoders(name, versions.older_of(meta), serializer)
        self.user_key = None
        if columns.user_key_schema is not None:
            self.user_key = struct_codec(columns.user_key_schema, name, prefix="key")

    def value(self, data: bytes, decode: Decode) -> Any:
        """The value column of the bytes a value was stored as (without a TTL prefix)."""
        stored = decode(data)
        if self.group_state:
            timeout, row = stored
            return (None if row is None else self.codec.values(row), timeout)
        return self.codec.values(stored)

    def entry(self, stored: bytes, decode: Decode, live_only: bool = True) -> Any:
        """The value column of a stored value; ``_EXPIRED`` for one whose TTL expired (``live_only``)."""
        if not self.ttl:
            return self.value(stored, decode)
        expiry, data = rec.split_expiry(stored)
        if live_only and expiry <= self.now:
            return _EXPIRED
        return (self.value(data, decode), expiry)

    def key_of_map(self, data: bytes) -> Any:
        assert self.user_key is not None
        return self.user_key.values(self.user_key.serializer.deserialize(bytes(data)))


def scan_state(plan: ScanPlan, part: StatePart) -> Iterator[Row]:
    """The rows of one state partition (``plan.columns``' layout)."""
    handles = [KeyedStateHandle.from_json(json.loads(h)) for h in part.handles]
    rng = KeyGroupRange(part.start, part.end)
    with (
        tempfile.TemporaryDirectory(prefix="dstl-state-source-") as scratch,
        open_storage(plan.storage, plan.job_dir) as storage,
    ):
        backend = ChangelogKeyedStateBackend(
            plan.uid, rng, scratch, storage=None, max_parallelism=plan.max_parallelism, log_enabled=False
        )
        try:
            restore(backend, handles, source=storage)
            txn, databases = backend.consistent_view()
            try:
                yield from _rows(plan, txn, databases, rng)
            finally:
                txn.abort()
        finally:
            backend.close()


def _rows(plan: ScanPlan, txn: Any, databases: dict[str, Any], rng: KeyGroupRange) -> Iterator[Row]:
    keys = _Keys()
    if plan.state is None:
        db = databases.get(TIMERS_DB)
        for table_key, _ in txn.cursor(db=db) if db is not None else ():
            ck, user_key = split_table_key(bytes(table_key))
            key, kg = keys(ck)
            yield key, parse_timer_user_key(user_key)[1], kg
        return
    assert plan.meta is not None
    values = _Values(plan, plan.meta)
    tables = [(databases[t], decode) for t, decode in values.tables if t in databases]
    entries = versions.newest_entries(txn, [db for db, _ in tables])
    try:
        kind, flatten = plan.columns.kind, plan.columns.flatten
        if kind == "value":
            for table_key, stored, rank in entries:
                value = values.entry(stored, tables[rank][1])
                if value is not _EXPIRED:
                    key, kg = keys(table_key)
                    yield key, value, kg
        elif kind == "list":
            for table_key, stored, rank in entries:
                live = [
                    e for e in (values.entry(x, tables[rank][1]) for x in rec.decode_list(stored)) if e is not _EXPIRED
                ]
                key, kg = keys(table_key)
                if flatten:
                    yield from ((key, element, kg) for element in live)
                elif live:
                    yield key, live, kg
        else:
            yield from _map_rows(values, entries, tables, keys, flatten)
    except SerializationError as exc:
        raise StateRestoreError(
            f"state {plan.state!r} of operator {plan.uid!r} in {plan.job_dir} (key groups {rng.start}-{rng.end}) holds "
            f"a value that does not decode: {exc}"
        ) from None


def _map_rows(
    values: _Values, entries: Iterator[tuple[bytes, bytes, int]], tables: list[tuple[Any, Decode]], keys: _Keys,
    flatten: bool,
) -> Iterator[Row]:  # fmt: skip
    """A map state's rows: one per live entry, or (``flatten`` false) one per key with its entries."""
    held: dict[Any, Any] = {}
    current: tuple[tuple[Any, ...], int] | None = None
    current_ck = b""
    for table_key, stored, rank in entries:
        ck, user_key = split_table_key(table_key)
        value = values.entry(stored, tables[rank][1])
        if value is _EXPIRED:
            continue
        key, kg = keys(ck)
        if flatten:
            yield key, values.key_of_map(user_key), value, kg
            continue
        if current is not None and ck != current_ck:
            yield current[0], held, current[1]
            held = {}
        current, current_ck = (key, kg), ck
        held[values.key_of_map(user_key)] = value
    if current is not None:
        yield current[0], held, current[1]


def scan_changes(plan: ScanPlan, part: ChangePart) -> Iterator[Row]:
    """The change rows of one change partition, batch by batch."""
    with open_storage(plan.storage, plan.job_dir) as storage:
        for batch in part.batches:
            try:
                yield from _batch_changes(plan, storage, batch)
            except SerializationError as exc:
                raise StateRestoreError(
                    f"the log of batch {batch.batch} of operator {plan.uid!r} in {plan.job_dir} holds a change of "
                    f"state {plan.state or 'timers'!r} that does not decode: {exc}"
                ) from None


def _batch_changes(plan: ScanPlan, storage: ChangelogStorage, batch: BatchChanges) -> Iterator[Row]:
    keys = _Keys()
    b = batch.batch
    if plan.state is None:
        for _, ck, op, rest in _records(storage, batch, {TIMERS_SID: 0}):
            if op in (Op.TIMER_ADD, Op.TIMER_DELETE):
                key, kg = keys(ck)
                yield b, UPDATE if op is Op.TIMER_ADD else DELETE, key, parse_timer_user_key(rest)[1], kg
        return
    if batch.meta is None:
        return  # the state was not registered yet in that batch's checkpoint
    values = _Values(plan, batch.meta)
    ranks = {rec.state_id(table): rank for rank, (table, _) in enumerate(values.tables)}
    change = _Changes(b, plan.columns.kind, values, keys)
    changed: set[bytes] = set()
    moved: list[bytes] = []  # keys an older schema version cleared: moved to the current one, or deleted
    for rank, ck, op, rest in _records(storage, batch, ranks):
        if rank:
            moved.append(ck)
        elif op in rec.BATCH_OPS:
            for each, stored in rec.split_batch(op, rest):
                changed.add(each)
                yield from change(each, Op.SET, stored)
        else:
            changed.add(ck)
            yield from change(ck, op, rest)
    for ck in dict.fromkeys(moved):
        if ck not in changed:
            yield from change(ck, Op.CLEAR, b"")


class _Changes:
    """The change rows of one change record of a state (its current schema version)."""

    def __init__(self, batch: int, kind: str, values: _Values, keys: _Keys) -> None:
        self.batch, self.kind, self.values, self.keys = batch, kind, values, keys
        self.decode = values.tables[0][1]

    def __call__(self, ck: bytes, op: Op, rest: bytes) -> Iterator[Row]:
        key, kg = self.keys(ck)
        head, values = (self.batch,), self.values
        if op in (Op.CLEAR, Op.REMOVE) and (self.kind != "map" or not rest):
            yield (*head, DELETE, key, None, None, kg) if self.kind == "map" else (*head, DELETE, key, None, kg)
        elif self.kind == "value" and op is Op.SET:
            yield *head, UPDATE, key, values.entry(rest, self.decode, live_only=False), kg
        elif self.kind == "list" and op in (Op.SET, Op.ADD):
            kind = UPDATE if op is Op.SET else APPEND
            for element in rec.decode_list(rest):
                yield *head, kind, key, values.entry(element, self.decode, live_only=False), kg
        elif self.kind == "map" and op is Op.PUT:
            user_key, stored = rec.split_put(rest)
            yield *head, UPDATE, key, values.key_of_map(user_key), values.entry(stored, self.decode, False), kg
        elif self.kind == "map" and op is Op.REMOVE:
            yield *head, DELETE, key, values.key_of_map(rest), None, kg
        else:
            raise SerializationError("change-record", f"a {op.name} record in a {self.kind} state")


def _records(
    storage: ChangelogStorage, batch: BatchChanges, ranks: dict[int, int]
) -> Iterator[tuple[int, bytes, Op, bytes]]:
    """(rank of its table, ckey, op, rest) of the batch's change records of the tables ``ranks``
    (state id -> rank: 0 the current schema version, older ones after), in log order."""
    for text, start, end in batch.logs:
        log = ChangelogHandle.from_json(json.loads(text))
        for _, data in storage.read(log, KeyGroupRange(start, end)):
            op, sid, ck, rest = rec.parse_record(data)
            rank = ranks.get(sid)
            if rank is not None:
                yield rank, ck, op, rest


def arrow_batches(rows: Iterator[Row], schema: Any, size: int = ARROW_BATCH_ROWS) -> Iterator[Any]:
    """``rows`` as pyarrow record batches of up to ``size`` rows in the Arrow schema pyspark's data
    source worker expects for ``schema`` (the read's pyspark ``StructType``), when pyarrow converts
    every column as pyspark would (module docstring, ``_plain``); else ``rows`` as they are.

    Rows are converted ``CONVERT_ROWS`` at a time and the pieces joined into one batch (a copy of
    Arrow buffers): few tuples are alive at once, so they are freed young instead of filling the
    garbage collector's oldest generation, whose full collections cost more than the conversion."""
    if not all(_plain(f.dataType, f.nullable) for f in schema.fields):
        yield from rows
        return
    import pyarrow as pa  # type: ignore[import-untyped, unused-ignore]
    from pyspark.sql.pandas.types import to_arrow_schema

    arrow_schema = to_arrow_schema(schema)  # no timestamp in a plain schema: no time zone needed
    types = [field.type for field in arrow_schema]
    held: list[Any] = []
    count = 0
    while chunk := list(islice(rows, CONVERT_ROWS)):
        columns = zip(*chunk, strict=True)
        arrays = [pa.array(column, type=dtype) for column, dtype in zip(columns, types, strict=True)]
        held.append(pa.RecordBatch.from_arrays(arrays, schema=arrow_schema))
        count += len(chunk)
        if count >= size:
            yield from pa.Table.from_batches(held).combine_chunks().to_batches()
            held, count = [], 0
    if held:
        yield from pa.Table.from_batches(held).combine_chunks().to_batches()


def _plain(dtype: Any, nullable: bool) -> bool:
    """Whether pyarrow builds values of ``dtype`` as pyspark's ``LocalDataToArrowConversion`` does:
    a type pyspark passes through as it is (numbers, booleans, dates; strings, which it only
    coerces from other types), or a struct (a tuple it makes a dict), array or map (a dict it makes
    pairs) of them; nullable, as pyspark checks a NOT NULL value in Python."""
    from pyspark.sql import types as t

    if not nullable:
        return False
    if isinstance(dtype, t.StructType):
        return all(_plain(f.dataType, f.nullable) for f in dtype.fields)
    if isinstance(dtype, t.ArrayType):
        return _plain(dtype.elementType, dtype.containsNull)
    if isinstance(dtype, t.MapType):
        return _plain(dtype.keyType, True) and _plain(dtype.valueType, dtype.valueContainsNull)
    plain = (t.ByteType, t.ShortType, t.IntegerType, t.LongType, t.FloatType, t.DoubleType, t.BooleanType, t.DateType)
    return type(dtype) in plain or type(dtype) is t.StringType
