"""The write side of the state data source: a DataFrame of one state into a savepoint (bootstrap).

``df.write.format("dstl-state").option("operatorId", uid).option("stateVarName", name)
.mode("append").save(savepoint)`` takes the columns the read gives (``state_columns``), so that a
state read, transformed as a DataFrame and written back round-trips:

=======================================================  ============================
columns (``partition_id`` may be there: it is ignored)   state
=======================================================  ============================
``key, value``                                           value
``key, list_element`` (a row per element)                list (elements in row order)
``key, list_value`` (an array per key)                   list
``key, user_map_key, user_map_value`` (a row per entry)  map
``key, map_value`` (a map per key)                       map
=======================================================  ============================

``key`` is a struct of the grouping columns (their names and Spark types are the operator's: a
query whose grouping columns have other types is refused when it starts from the savepoint). The
value's struct is the state's schema; with ``ttlDurationMs`` (the processor's TTL) each value is
``struct<value: <schema>, ttlExpirationMs: bigint>``, as the read gives it, and keeps that expiry.

Options: ``operatorId`` (required: the uid of the operator the query will run, its
``operator_uid``, or a routed operator's uid as ``format("dstl-state-metadata")`` lists it),
``stateVarName`` (required), ``valueSchema`` and, for a map, ``userKeySchema`` (the schemas the
processor declares, DDL: given, the columns must be those, field by field; else the columns' types
are recorded as declared), ``ttlDurationMs``, ``maxParallelism`` (128: the query's
``max_parallelism``), ``processorApi`` (``transformWithStateInPandas`` or ``transformWithState``:
needed when a grouping column is a ``timestamp``, which the two APIs hand over, and so store,
differently), and the storage options of the read (``s3.*``, ``dfs_timeout_ms``, ...). The mode is
Spark's: ``append`` adds the state to the savepoint (refused if it holds that state already),
``overwrite`` replaces that state; other states there stay (``backend.spark.bootstrap``).

Where each part runs: ``plan_write`` in the Python process Spark starts on the driver's side when
the write is planned (options, columns, the savepoint directory: every refusal before a task
runs); ``StateWriter.write`` in each task (``bootstrap_chunks``); ``commit`` and ``abort`` on
the driver's side once every task succeeded, or one failed. Refusals are ``StateSourceError``
naming the option, the column, the state and the field.
"""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pyspark.sql.datasource import DataSourceArrowWriter, WriterCommitMessage

from backend.core.errors import ChangelogError
from backend.core.keygroups import DEFAULT_MAX_PARALLELISM, check_max_parallelism
from backend.spark.apply_in_pandas import GROUP_STATE_NAME
from backend.spark.bootstrap import (
    check_operator,
    check_savepoint_directory,
    commit_state,
    delete_write,
    directory_url,
    discard_write,
    open_storage,
    write_dir,
)
from backend.spark.bootstrap_chunks import PANDAS_API, ROW_API, StateRows, WritePlan, plan_state_meta
from backend.spark.errors import StateSourceError
from backend.spark.schema import SparkType, input_type, parse_schema, simple_string
from backend.spark.spark_hash import HASHED_TYPES
from backend.spark.state_options import (
    OPERATOR_ID,
    PATH,
    READ_CHANGE_FEED,
    READ_REGISTERED_TIMERS,
    STATE_VAR_NAME,
    Options,
    invalid,
    required,
    storage_config,
)
from backend.spark.state_schemas import ddl
from dstl import ConfigurationError
from dstl.paths import check_name

__all__ = ["StateWriter", "WrittenPart", "plan_write"]

VALUE_SCHEMA = "valueSchema"
USER_KEY_SCHEMA = "userKeySchema"
TTL_DURATION_MS = "ttlDurationMs"
MAX_PARALLELISM = "maxParallelism"
PROCESSOR_API = "processorApi"
_APIS = {api.lower(): api for api in (PANDAS_API, ROW_API)}
#: the columns a state is written from (module docstring), by layout
_LAYOUTS = {
    ("value",): "value", ("list_element",): "list_element", ("list_value",): "list_value",
    ("user_map_key", "user_map_value"): "user_map", ("map_value",): "map_value",
}  # fmt: skip
_TTL_FIELD = "ttlExpirationMs"


@dataclass
class WrittenPart(WriterCommitMessage):
    """A task's commit message: the file entries of its chunks, its key groups, its rows."""

    partition: int
    files: list[dict[str, Any]]
    key_groups: list[int]
    rows: int


class StateWriter(DataSourceArrowWriter):
    """The writer of one bootstrap write (module docstring); pickled to every task with its plan."""

    def __init__(self, plan: WritePlan) -> None:
        self.plan = plan

    def write(self, iterator: Iterator[Any]) -> WrittenPart:
        from pyspark import TaskContext

        context = TaskContext.get()
        partition = context.partitionId() if context is not None else 0
        plan = self.plan
        with (
            tempfile.TemporaryDirectory(prefix="dstl-bootstrap-") as scratch,
            open_storage(plan.storage, plan.savepoint) as storage,
        ):
            rows = StateRows(plan, scratch)
            try:
                for batch in iterator:
                    rows.add(batch)
                out = rows.write(storage.files.put, write_dir(plan.write_id), partition)
            finally:
                rows.close()
        return WrittenPart(partition, out.files, out.key_groups, out.rows)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        plan = self.plan
        parts = [m for m in messages if isinstance(m, WrittenPart)]
        with open_storage(plan.storage, plan.savepoint) as storage:
            try:
                _check_disjoint(plan, parts)
                commit_state(
                    storage.files, write_id=plan.write_id, uid=plan.uid, max_parallelism=plan.max_parallelism,
                    key=plan.key, state=plan.state, state_meta=plan.state_meta,
                    written=[f for m in parts for f in m.files], overwrite=plan.overwrite,
                )  # fmt: skip
            except BaseException:
                discard_write(storage.files, plan.write_id)
                raise
            delete_write(storage.files, plan.write_id, keep=[str(f["path"]) for m in parts for f in m.files])

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        with open_storage(self.plan.storage, self.plan.savepoint) as storage:
            discard_write(storage.files, self.plan.write_id)


def _check_disjoint(plan: WritePlan, parts: Sequence[WrittenPart]) -> None:
    """Every key group comes from one task (``backend.spark.bootstrap``)."""
    owner: dict[int, int] = {}
    shared: dict[int, set[int]] = {}
    for part in parts:
        for kg in part.key_groups:
            first = owner.setdefault(kg, part.partition)
            if first != part.partition:
                shared.setdefault(kg, {first}).add(part.partition)
    if shared:
        groups = sorted(shared)
        shown = ", ".join(f"{kg} (partitions {sorted(shared[kg])})" for kg in groups[:5])
        more = f" and {len(groups) - 5} more" if len(groups) > 5 else ""
        raise StateSourceError(
            f"state {plan.state!r} of operator {plan.uid!r}: key groups {shown}{more} were written by more than one "
            "task, and a key's rows must meet in one: repartition the DataFrame by its key first, "
            f"df.repartition(n, 'key') with n dividing maxParallelism ({plan.max_parallelism}), e.g. "
            f"n = {plan.max_parallelism}"
        )


# -- planning ----------------------------------------------------------------------------------------


def plan_write(given: Mapping[str, Any], schema: Any, overwrite: bool) -> WritePlan:
    """Check a write's options and columns (``schema``: the DataFrame's pyspark ``StructType``) and
    the savepoint directory; the plan its tasks and commit follow."""
    options = Options(given)
    path = options.text(PATH)
    if not path or not path.strip():
        raise required(PATH)
    for name, what in ((READ_CHANGE_FEED, "a change feed"), (READ_REGISTERED_TIMERS, "timers")):
        if options.boolean(name, False):
            raise invalid(name, f"{what} cannot be written: the state data source writes a state variable")
    state = (options.text(STATE_VAR_NAME) or "").strip()
    if not state:
        raise required(STATE_VAR_NAME)
    if state == GROUP_STATE_NAME:
        raise invalid(STATE_VAR_NAME, "applyInPandasWithState's GroupState is not written, transformWithState's are")
    uid = (options.text(OPERATOR_ID) or "").strip()
    if not uid:
        raise required(OPERATOR_ID)
    max_parallelism = options.integer(MAX_PARALLELISM, low=1) or DEFAULT_MAX_PARALLELISM
    try:
        check_name(uid, "operator uid")
        check_max_parallelism(max_parallelism)
    except ConfigurationError as exc:
        raise invalid(OPERATOR_ID if "uid" in str(exc) else MAX_PARALLELISM, str(exc)) from None
    ttl_ms = options.integer(TTL_DURATION_MS, low=1)
    api_text = options.text(PROCESSOR_API)
    api = None if api_text is None else _APIS.get(api_text.strip().lower())
    if api_text is not None and api is None:
        raise invalid(PROCESSOR_API, f"{api_text!r} is not {PANDAS_API} or {ROW_API}")
    savepoint = directory_url(path)
    layout, key, value_schema, user_key_schema = _columns(
        state, schema, ttl_ms, options.text(VALUE_SCHEMA), options.text(USER_KEY_SCHEMA)
    )
    if api is None and any(dtype == "timestamp" for _, dtype in key):
        raise invalid(
            PROCESSOR_API,
            f"the grouping column {next(n for n, t in key if t == 'timestamp')!r} is a timestamp, which "
            f"{PANDAS_API} keeps as a wall time and {ROW_API} as an instant: say which API the query runs",
        )
    plan = WritePlan(
        savepoint=savepoint, storage=storage_config(options, savepoint), write_id=uuid.uuid4().hex, uid=uid,
        state=state, layout=layout, max_parallelism=max_parallelism, key=key, value_schema=value_schema,
        user_key_schema=user_key_schema, ttl_ms=ttl_ms, api=api, overwrite=overwrite,
    )  # fmt: skip
    try:
        plan = replace(plan, state_meta=plan_state_meta(plan))
    except (ChangelogError, ValueError) as exc:
        raise StateSourceError(f"state {state!r}: {exc}") from None
    with open_storage(plan.storage, savepoint) as storage:
        meta = check_savepoint_directory(storage.files)
        check_operator(meta, savepoint, uid, max_parallelism, key, state, overwrite)
    return plan


def _columns(
    state: str, schema: Any, ttl_ms: int | None, value_schema: str | None, user_key_schema: str | None
) -> tuple[str, tuple[tuple[str, str], ...], str, str | None]:
    """(layout, grouping key, the declared value schema, a map's user key schema) of the columns."""
    types = {f.name: input_type(f.dataType) for f in schema.fields}
    listed = ", ".join(types) or "none"
    if "batch_id" in types or "change_type" in types:
        raise StateSourceError(f"state {state!r}: a change feed (batch_id, change_type) cannot be written")
    key = types.get("key")
    if key is None or key.name != "struct":
        raise StateSourceError(
            f"state {state!r}: the DataFrame needs a column key, a struct of the grouping columns (its columns: "
            f"{listed})"
        )
    for f in key.fields:
        if f.type.name not in HASHED_TYPES:
            raise StateSourceError(
                f"state {state!r}: grouping column key.{f.name} is {simple_string(f.type)}, which the drop-in does not "
                "group by"
            )
    body = tuple(sorted(n for n in types if n not in ("key", "partition_id")))
    layout = _LAYOUTS.get(body)
    if layout is None:
        raise StateSourceError(
            f"state {state!r}: the columns {listed} are not those of a state: key and value (a value state), "
            "list_element or list_value (a list state), user_map_key and user_map_value or map_value (a map state), "
            "and optionally partition_id"
        )
    user_key = None
    if layout == "value" or layout == "list_element":
        value = types[layout]
    elif layout == "list_value":
        value = _inner(state, "list_value", types["list_value"], "array")
    elif layout == "user_map":
        user_key, value = types["user_map_key"], types["user_map_value"]
    else:
        column = types["map_value"]
        if column.name != "map" or column.element is None or column.value is None:
            raise StateSourceError(f"state {state!r}: column map_value is {simple_string(column)}, not a map")
        user_key, value = column.element, column.value
    column_name = {"user_map": "user_map_value", "map_value": "map_value"}.get(layout, layout)
    value = _unwrapped(state, column_name, value, ttl_ms, value_schema)
    declared = _declared(state, column_name, value, value_schema, VALUE_SCHEMA)
    declared_key = None
    if user_key is not None:
        declared_key = _declared(state, "user_map_key", user_key, user_key_schema, USER_KEY_SCHEMA)
    grouping = tuple((f.name, simple_string(f.type)) for f in key.fields)
    return layout, grouping, declared, declared_key


def _inner(state: str, column: str, dtype: SparkType, kind: str) -> SparkType:
    if dtype.name != kind or dtype.element is None:
        raise StateSourceError(f"state {state!r}: column {column} is {simple_string(dtype)}, not an {kind}")
    return dtype.element


def _unwrapped(state: str, column: str, dtype: SparkType, ttl_ms: int | None, value_schema: str | None) -> SparkType:
    """The value's type inside Spark's TTL wrapper (``ttl_ms`` given), or the type itself."""
    names = [f.name for f in dtype.fields] if dtype.name == "struct" else []
    wrapped = names == ["value", _TTL_FIELD] and dtype.fields[0].type.name == "struct"
    if ttl_ms:
        if not wrapped or dtype.fields[1].type.name != "long":
            raise StateSourceError(
                f"state {state!r}: with {TTL_DURATION_MS} each value of column {column} is "
                f"struct<value: struct<...>, {_TTL_FIELD}: bigint>, as the state source reads a state with a TTL; "
                f"got {simple_string(dtype)}"
            )
        return dtype.fields[0].type
    if wrapped and value_schema is None:
        raise StateSourceError(
            f"state {state!r}: column {column} holds values with a TTL expiry ({_TTL_FIELD}): give the processor's "
            f"{TTL_DURATION_MS}, or {VALUE_SCHEMA} to write the struct as the value itself"
        )
    return dtype


def _declared(state: str, column: str, dtype: SparkType, given: str | None, option: str) -> str:
    """The declared schema (DDL) of a column's values: ``given`` (the processor's), which the
    column's type must match field by field, or the column's own struct type."""
    if dtype.name != "struct":
        raise StateSourceError(f"state {state!r}: column {column} is {simple_string(dtype)}, not a struct")
    if given is None:
        return ddl(dtype)
    try:
        declared = parse_schema(given)
    except ConfigurationError as exc:
        raise invalid(option, str(exc)) from None
    _match(state, column, option, "", declared, dtype)
    return ddl(declared)


def _match(state: str, column: str, option: str, path: str, declared: SparkType, written: SparkType) -> None:
    """Refuse a written type other than the declared one (nullability aside: a NOT NULL field is
    checked value by value), naming the state and the field."""

    def refuse(why: str) -> StateSourceError:
        where = f"field {path!r}" if path else "the value"
        return StateSourceError(f"state {state!r} {where}: {why} (column {column}, option {option})")

    if declared.name != written.name or (declared.precision, declared.scale) != (written.precision, written.scale):
        raise refuse(f"the declared schema says {simple_string(declared)}, the column holds {simple_string(written)}")
    if declared.name == "struct":
        names = [f.name for f in declared.fields]
        have = [f.name for f in written.fields]
        missing = [n for n in names if n not in have]
        extra = [n for n in have if n not in names]
        if missing or extra:
            what = f"declared field {_join(path, missing[0])!r} is missing" if missing else ""
            what = what or f"field {_join(path, extra[0])!r} is not declared"
            listed = f"the column's fields ({', '.join(have)}) are not the declared ones ({', '.join(names)})"
            raise refuse(f"{listed}: {what}")
        if names != have:
            order = f"({', '.join(have)}) than declared ({', '.join(names)})"
            raise refuse(f"the column's fields are in another order {order}")
        for d, w in zip(declared.fields, written.fields, strict=True):
            _match(state, column, option, _join(path, d.name), d.type, w.type)
    element = "[]" if declared.name == "array" else " key"
    parts = ((declared.element, written.element, element), (declared.value, written.value, " value"))
    for d_part, w_part, suffix in parts:
        if d_part is not None and w_part is not None:
            _match(state, column, option, f"{path}{suffix}", d_part, w_part)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name
