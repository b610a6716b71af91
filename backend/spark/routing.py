"""``use_for_session``: Spark's own ``GroupedData`` methods on this backend, each operator's state
bound to the query that runs it.

The routed methods take exactly Spark's parameters (names, defaults, order; positional or keyword)
plus our options, keyword-only, and call ``backend.spark.api``'s functions.

**Where a routed operator's state lives.** Spark keeps an operator's state under its query's
``checkpointLocation``: two queries of one program have their own, a query restarted under the same
checkpoint resumes it, one started under another checkpoint starts empty. A routed operator does the
same: its state directory is ``<checkpointLocation>/dstl/<uid>``, or, with a ``checkpoint_root``,
``<checkpoint_root>/<name of the checkpointLocation>/<uid>`` (the last path component of the
location and a digest of it). As in Spark, an operator is known by its place among the query's
routed operators (``backend.spark.operator_ids``): a restart with the processor class renamed
resumes its state. The uid naming a new place's directory is the processor's class or the function
(``routed_uid``), or ``operator`` for a lambda or a partial, with the place as a suffix where two
meet; an ``operator_uid`` the user gives names the operator wherever it is.

**When it is bound.** A routed method returns its DataFrame before anything says which query will
run it, so the operator is built unbound (``OperatorConfig.route``) and bound when its query
starts: ``use_for_session`` also wraps ``DataStreamWriter.start`` and ``toTable``. The wrapper
finds the routed operators in the plan of the DataFrame being started (their function's name in
the ``MapInPandas`` node, ``plan.routed_task_name``), works out the query's checkpoint location as
Spark does (the ``checkpointLocation`` option; else ``spark.sql.streaming.checkpointLocation``
joined with the query name, and without a name with a random one the wrapper chooses and sets as
the option, as Spark would have chosen one; else, as Spark, a temporary directory, kept after the
query stops), and binds each operator before the query's first batch can run: the driver's
coordinator (its recovery) and the initial state directly; the tasks through a local property set
on the starting thread while ``start`` runs (Spark's query thread copies the starting thread's
local properties, and each of its tasks sees them); the no-data batch source through a file on the
driver's host (``config.route_file``). pyspark keeps the writer's options in the JVM only, so the
wrapper also records them as they are set (``option``, ``options``, ``queryName``).

**Reading its state by Spark's names.** Spark's state sources, ``format("statestore")`` and
``format("state-metadata")``, read Spark's state store; a routed operator's state is in the drop-in's
layout, so while routing is on a read by either name whose path holds that layout
(``state_plan.drop_in_location``: the query's ``checkpointLocation`` with its ``dstl/``, or with a
``checkpoint_root`` the directory under it that location names, or an operator's own checkpoint
location) is served by this project's sources (``dstl-state``, ``dstl-state-metadata``) with the same
options; any other path goes to Spark's source unchanged. pyspark keeps a ``DataFrameReader``'s format
and options in the JVM only, so they are recorded as they are set (``format``, ``option``,
``options``), and ``load`` chooses. Spark's source reads, by default, the last batch in the query's
commit log; the driver completes a batch's checkpoint when the batch's progress event reaches its
listener, which may come later (also while the next batch runs, so inside a ``foreachBatch`` function).
Before such a read, the driver does at once what its listener will do for the batches the query has
reported (``StreamingQuery.recentProgress``) and are not yet checkpoints, so the read sees the state
of the last committed batch, as Spark's does.

A routed DataFrame runs in one query at a time: starting it under another checkpoint while its last
query is active is refused (its no-data batch source could not tell the two apart). Its operators
may feed a union as its first input only (a union renumbers the partitions of the others, and a
task knows its part of the state by its partition id): refused at start otherwise. The writer
hooks stay after ``restore()``: a DataFrame built while routing was on may be started later, and one
without routed operators starts as before.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import tempfile
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from backend.spark.config import ROUTE_PROPERTY, OperatorConfig, route_file
from backend.spark.operator_ids import resolve_uids
from backend.spark.plan import routed_task_name
from dstl import ConfigurationError
from dstl.atomic import write_atomically
from dstl.paths import as_name, local_path

__all__ = ["SessionRouting", "route_session", "routed_uid"]

_ROUTED = ("transformWithStateInPandas", "transformWithState", "applyInPandasWithState")
_TASK_PREFIX = routed_task_name("")
#: where a DataStreamWriter's options are recorded (lower-case keys, as Spark reads them)
_RECORDED = "_dstl_options"
#: where a DataFrameReader's format and options are recorded
_READ = "_dstl_read"
#: Spark's state sources' names (``_serve_state_read``: each is read by one of ours)
_SPARK_STATE_SOURCES = ("statestore", "state-metadata")


@dataclass
class _Routed:
    """A routed operator of this driver: its unbound config, how to bind it, where its query's
    state goes, and the query it last ran in."""

    cfg: OperatorConfig
    bind: Callable[[OperatorConfig], None]
    root: str | None
    #: the uid is ``routed_uid``'s (or the placeholder for a nameless function), not the user's
    derived: bool
    job_dir: str | None = None
    query: Any = None


#: the directory name of a routed lambda or partial's place
_NAMELESS = "operator"
_OPERATORS: dict[str, _Routed] = {}
_LOCK = threading.Lock()
_HOOKED: list[bool] = []


def routed_uid(target: Any) -> str:
    """The operator uid ``use_for_session`` derives for a processor (its class) or a function:
    the qualified name, which tells apart the functions and classes of one module. A lambda, a
    ``functools.partial`` or a callable object has no name of its own: ``ConfigurationError``
    (``SessionRouting`` names it ``operator``)."""
    from pyspark.sql.streaming.stateful_processor import StatefulProcessor

    named = type(target) if isinstance(target, StatefulProcessor) else target
    name = getattr(named, "__qualname__", None) if callable(named) else None
    plain = isinstance(named, type) or hasattr(named, "__code__")  # a class or a def, not a partial/object
    if not plain or not isinstance(name, str) or "<lambda>" in name:
        raise ConfigurationError(
            f"cannot derive an operator uid for {target!r}: pass operator_uid=... (a name unique among the "
            "stateful operators of its query)"
        )
    return as_name(name.replace(".<locals>.", "."))


@dataclass
class SessionRouting:
    """``backend.spark.plan.Routing`` for one routed call: the uid from the processor or function,
    the state directory from the query that starts it."""

    root: str | None
    target: Any
    derived: bool = False

    def uid(self) -> str:
        """The uid of an operator the user gave none (``operator_ids``: its place decides which
        state it resumes; this names a new place's directory)."""
        self.derived = True
        try:
            return routed_uid(self.target)
        except ConfigurationError:
            return _NAMELESS

    def defer(self, cfg: OperatorConfig, bind: Callable[[OperatorConfig], None]) -> None:
        if cfg.route is None:
            raise ConfigurationError(f"operator {cfg.uid!r} is bound already")
        with _LOCK:
            _OPERATORS[cfg.route] = _Routed(cfg, bind, self.root, self.derived)


def route_session(
    checkpoint_root: str | None, defaults: dict[str, Any], targets: dict[str, Callable[..., Any]]
) -> Callable[[], None]:
    """``backend.spark.api.use_for_session``: route ``GroupedData``'s methods to ``targets`` (the
    API's functions, by method name), hook the writer."""
    from pyspark.sql.group import GroupedData

    saved = {name: GroupedData.__dict__.get(name) for name in _ROUTED}
    for name, method in _methods(checkpoint_root, defaults, targets).items():
        method.__doc__ = getattr(GroupedData, name).__doc__
        setattr(GroupedData, name, method)
    _hook_writer()
    restore_reader = _route_reads(checkpoint_root)

    def restore() -> None:
        for name, method in saved.items():
            if method is None:
                delattr(GroupedData, name)  # pyspark's own, inherited from its mixin
            else:
                setattr(GroupedData, name, method)
        restore_reader()

    return restore


def _methods(
    root: str | None, defaults: dict[str, Any], targets: dict[str, Callable[..., Any]]
) -> dict[str, Callable[..., Any]]:
    return {name: _routed_method(name, function, root, defaults) for name, function in targets.items()}


def _routed_method(
    name: str, function: Callable[..., Any], root: str | None, defaults: dict[str, Any]
) -> Callable[..., Any]:
    """``GroupedData.<name>`` calling ``function``, the API's, which takes exactly Spark's
    parameters after the grouped data (so its signature is the method's, ``self`` for the grouped
    data, and Spark's signatures are spelled in one place, ``backend.spark.api``). A call's options
    are our defaults, then its own, then the routing: the uid from the processor or function (its
    first parameter after the grouped data) where none is given, the state directory where no
    checkpoint_location is."""
    signature = inspect.signature(function)
    grouped, target, *_ = signature.parameters.values()
    (options,) = [p.name for p in signature.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD]

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        call = signature.bind(self, *args, **kwargs)
        given = call.arguments.pop(options, {})
        routed = {**defaults, **given, "routing": SessionRouting(root, call.arguments[target.name])}
        return function(*call.args, **call.kwargs, **routed)

    parameters = [grouped.replace(name="self"), *list(signature.parameters.values())[1:]]
    method.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    method.__name__ = method.__qualname__ = name
    return method


# -- binding at start ----------------------------------------------------------------------------


def _hook_writer() -> None:
    """Wrap ``DataStreamWriter``'s option setters (to record them) and its two starts (to bind the
    routed operators of the DataFrame being started), once per process."""
    from pyspark.sql.streaming.readwriter import DataStreamWriter

    with _LOCK:
        if _HOOKED:
            return
        _HOOKED.append(True)
    option, options, query_name = DataStreamWriter.option, DataStreamWriter.options, DataStreamWriter.queryName
    start, to_table = DataStreamWriter.start, DataStreamWriter.toTable

    def hooked_option(self: Any, key: str, value: Any) -> Any:
        _record(self, {key: value})
        return option(self, key, value)

    def hooked_options(self: Any, **given: Any) -> Any:
        _record(self, given)
        return options(self, **given)

    def hooked_query_name(self: Any, queryName: str) -> Any:
        _record(self, {"queryName": queryName})
        return query_name(self, queryName)

    def hooked_start(
        self: Any, path: Any = None, format: Any = None, outputMode: Any = None, partitionBy: Any = None,
        queryName: Any = None, **given: Any,
    ) -> Any:  # fmt: skip
        return _start_bound(
            self, queryName, given, lambda: start(self, path, format, outputMode, partitionBy, queryName, **given)
        )

    def hooked_to_table(
        self: Any, tableName: str, format: Any = None, outputMode: Any = None, partitionBy: Any = None,
        queryName: Any = None, **given: Any,
    ) -> Any:  # fmt: skip
        return _start_bound(
            self, queryName, given,
            lambda: to_table(self, tableName, format, outputMode, partitionBy, queryName, **given),
        )  # fmt: skip

    for name, hooked, original in (
        ("option", hooked_option, option), ("options", hooked_options, options),
        ("queryName", hooked_query_name, query_name), ("start", hooked_start, start),
        ("toTable", hooked_to_table, to_table),
    ):  # fmt: skip
        hooked.__doc__, hooked.__name__ = original.__doc__, original.__name__
        setattr(DataStreamWriter, name, hooked)


def _record(writer: Any, given: dict[str, Any]) -> None:
    from pyspark.sql.utils import to_str

    recorded = writer.__dict__.setdefault(_RECORDED, {})
    for key, value in given.items():
        recorded[key.lower()] = to_str(value)


def _start_bound(writer: Any, query_name: str | None, given: dict[str, Any], start: Callable[[], Any]) -> Any:
    """Bind the routed operators of ``writer``'s DataFrame to its query, then ``start`` it."""
    routed = _routed_in(writer._df)
    if not routed:
        return start()
    _record(writer, given)
    recorded = writer.__dict__[_RECORDED]
    spark = writer._df.sparkSession
    location = _checkpoint_location(writer, spark, recorded, query_name or recorded.get("queryname"))
    properties: dict[str, str] = {}
    for op, job_dir in zip(routed, _state_dirs(routed, location), strict=True):
        if op.query is not None and op.job_dir != job_dir and bool(op.query.isActive):
            raise ConfigurationError(
                f"the routed operator {op.cfg.uid!r} runs in query {op.query.id} (state {op.job_dir}): a DataFrame "
                "with routed stateful operators runs in one query at a time; build it again for another query"
            )
        op.bind(op.cfg.bound(job_dir))
        _write_route_file(op.cfg, job_dir)
        op.job_dir = job_dir
        properties[ROUTE_PROPERTY + str(op.cfg.route)] = job_dir
    context = spark.sparkContext
    previous = {key: context.getLocalProperty(key) for key in properties}
    for key, value in properties.items():
        context.setLocalProperty(key, value)  # the query's thread, created by start, copies them
    try:
        query = start()
    finally:
        for key, value in previous.items():
            context.setLocalProperty(key, value)
    for op in routed:
        op.query = query
    return query


def _routed_in(df: Any) -> list[_Routed]:
    """The routed operators of this driver in ``df``'s plan. One that feeds a union other than as
    its first input is refused: its tasks know their partition by Spark's partition id, which a
    union renumbers for every input after the first."""
    found: dict[str, _Routed] = {}
    pending = [(df._jdf.queryExecution().analyzed(), False)]
    while pending:
        node, renumbered = pending.pop()
        kind = node.getClass().getSimpleName()
        if kind == "MapInPandas":
            name = str(node.functionExpr().name())
            if name.startswith(_TASK_PREFIX):
                key = name[len(_TASK_PREFIX) :]
                with _LOCK:
                    op = _OPERATORS.get(key)
                if op is None:
                    raise ConfigurationError(f"the routed operator {name} was not built in this driver")
                if renumbered:
                    raise ConfigurationError(
                        f"the routed stateful operator {op.cfg.uid!r} is an input of a union other than its first: "
                        "the drop-in's output can be the first input of a union only (write the others first)"
                    )
                found[key] = op
        children = node.children()
        pending.extend((children.apply(i), renumbered or (kind == "Union" and i > 0)) for i in range(children.size()))
    return list(found.values())


def _checkpoint_location(writer: Any, spark: Any, recorded: dict[str, Any], query_name: str | None) -> str:
    """The query's checkpoint location, as Spark's ``StreamingQueryManager`` will choose it."""
    location = recorded.get("checkpointlocation")
    if location:
        return str(location)
    default = spark.conf.get("spark.sql.streaming.checkpointLocation", None)
    if default:
        if query_name:
            return f"{default.rstrip('/')}/{query_name}"
        chosen = f"{default.rstrip('/')}/{uuid.uuid4()}"  # Spark would choose a random name: choose it for Spark
        writer.option("checkpointLocation", chosen)
        _record(writer, {"checkpointLocation": chosen})
        return chosen
    return tempfile.mkdtemp(prefix="dstl-temporary-")


def _state_dirs(routed: list[_Routed], location: str) -> list[str]:
    """The state directory of each of a query's routed operators (plan order), by their places
    (``operator_ids``). Operators of one query share a root: ``use_for_session`` is per driver."""
    by_directory: dict[str, list[int]] = {}
    for i, op in enumerate(routed):
        by_directory.setdefault(_operators_dir(op.root, location), []).append(i)
    dirs = [""] * len(routed)
    for directory, places in by_directory.items():
        ops = [routed[i] for i in places]
        uids = resolve_uids(ops[0].cfg.changelog, directory, [(op.cfg.uid, op.derived) for op in ops])
        for i, uid in zip(places, uids, strict=True):
            dirs[i] = f"{directory}/{uid}"
    return dirs


def _operators_dir(root: str | None, location: str) -> str:
    """The directory of a query's routed operators' state directories."""
    location = location.rstrip("/")
    if root is None:
        return f"{location}/dstl"
    tail = as_name(location.rsplit("/", 1)[-1]) or "query"
    digest = hashlib.sha256(location.encode()).hexdigest()[:12]
    return f"{root.rstrip('/')}/{tail}-{digest}"


def _write_route_file(cfg: OperatorConfig, job_dir: str) -> None:
    import json

    path = route_file(cfg.local_root, str(cfg.route))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps({"job_dir": job_dir}))


# -- Spark's state sources on a routed query's checkpoint ----------------------------------------


def _route_reads(root: str | None) -> Callable[[], None]:
    """Wrap ``DataFrameReader``'s ``format``, ``option`` and ``options`` (to record them) and its
    ``load`` (to serve Spark's state sources' names from our sources on the drop-in's layout);
    returns the function that puts pyspark's methods back."""
    from pyspark.sql.readwriter import DataFrameReader

    saved = {name: DataFrameReader.__dict__[name] for name in ("format", "option", "options", "load")}
    format_, option, options, load = saved["format"], saved["option"], saved["options"], saved["load"]

    def hooked_format(self: Any, source: str) -> Any:
        self.__dict__.setdefault(_READ, {})["format"] = source
        return format_(self, source)

    def hooked_option(self: Any, key: str, value: Any) -> Any:
        _record_read(self, {key: value})
        return option(self, key, value)

    def hooked_options(self: Any, **given: Any) -> Any:
        _record_read(self, given)
        return options(self, **given)

    def hooked_load(self: Any, path: Any = None, format: Any = None, schema: Any = None, **given: Any) -> Any:
        if format is not None:
            self.format(format)
        self.options(**given)
        served = _serve_state_read(self, path, schema, root)
        return served if served is not None else load(self, path, None, schema)

    for name, hooked in (
        ("format", hooked_format), ("option", hooked_option), ("options", hooked_options), ("load", hooked_load),
    ):  # fmt: skip
        hooked.__doc__, hooked.__name__ = saved[name].__doc__, saved[name].__name__
        setattr(DataFrameReader, name, hooked)

    def restore() -> None:
        for name, method in saved.items():
            setattr(DataFrameReader, name, method)

    return restore


def _record_read(reader: Any, given: dict[str, Any]) -> None:
    """Record options as pyspark sets them: text (``to_str``), a None value not set."""
    from pyspark.sql.utils import to_str

    recorded = reader.__dict__.setdefault(_READ, {}).setdefault("options", {})
    for key, value in given.items():
        if value is not None:
            recorded[key.lower()] = to_str(value)


def _serve_state_read(reader: Any, path: Any, schema: Any, root: str | None) -> Any:
    """The DataFrame our source reads when ``reader`` names one of Spark's state sources and its
    path holds the drop-in's checkpoints (module docstring); else None."""
    recorded = reader.__dict__.get(_READ, {})
    source = str(recorded.get("format", "")).lower()
    options = dict(recorded.get("options", {}))
    location = path if isinstance(path, str) else options.get("path") if path is None else None
    if source not in _SPARK_STATE_SOURCES or not location:
        return None
    from backend.spark.state_plan import drop_in_location
    from backend.spark.state_source import METADATA_FORMAT, STATE_FORMAT, register

    candidates = [location] if root is None else [_operators_dir(root, location), location]
    directory = drop_in_location(candidates, options)
    if directory is None:
        return None
    _catch_up(directory)
    spark = reader._spark
    register(spark)  # a foreachBatch function's session may not have it yet
    options.pop("path", None)
    served = spark.read.format(STATE_FORMAT if source == "statestore" else METADATA_FORMAT).options(**options)
    if schema is not None:
        served = served.schema(schema)
    return served.load(directory)


def _catch_up(directory: str) -> None:
    """Complete the checkpoints of the batches the routed queries with operators in ``directory``
    reported and the driver's listener has not completed yet (module docstring)."""
    from backend.spark.driver import complete_committed, coordinator_at

    with _LOCK:
        ops = [
            op for op in _OPERATORS.values()
            if op.query is not None and op.job_dir and _same_directory(op.job_dir.rsplit("/", 1)[0], directory)
        ]  # fmt: skip
    for op in ops:
        coordinator = coordinator_at(str(op.job_dir))
        if coordinator is None:
            continue
        latest = coordinator.latest()
        done = -1 if latest is None else latest.checkpoint_id
        query_id = str(op.query.id)
        for batch in sorted({int(p.batchId) for p in op.query.recentProgress}):
            if batch > done:
                complete_committed(batch, query_id)


def _same_directory(a: str, b: str) -> bool:
    """Whether two spellings name one directory (a local one: the same absolute path)."""
    local_a, local_b = local_path(a), local_path(b)
    if local_a is not None and local_b is not None:
        return os.path.abspath(local_a) == os.path.abspath(local_b)
    return a.rstrip("/") == b.rstrip("/")
