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

**On a Spark Connect session** the ``GroupedData`` of pyspark's Connect client is routed the same
way and its writer's starts are wrapped too; the client is not the driver, so the tasks and the
tick source learn the directory from the plan the start sends (``backend.spark.connect_plan``),
the writer's options are read from its request, and a query without a checkpoint location gets a
temporary one the client chooses and sets as the option (the server's own is unknown here: a new
directory of the client's host when the server runs there, else one under ``checkpoint_root``;
without either, refused). Spark's own operator is never left to run a
routed call: what the drop-in cannot serve is refused with an error naming it.

Reading its state by Spark's names (``statestore``, ``state-metadata``) is routed by
``backend.spark.routed_reads``.

A routed DataFrame runs in one query at a time: starting it under another checkpoint while its last
query is active is refused (its no-data batch source could not tell the two apart). Its operators
may feed a union as its first input only (a union renumbers the partitions of the others, and a
task knows its part of the state by its partition id): refused at start otherwise. The writer
hooks stay after ``restore()``: a DataFrame built while routing was on may be started later, and one
without routed operators starts as before.
"""

from __future__ import annotations

import inspect
import os
import shutil
import socket
import tempfile
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from backend.spark.config import ROUTE_PROPERTY, OperatorConfig, operators_dir, route_file
from backend.spark.operator_ids import resolve_uids
from backend.spark.plan import routed_task_name
from dstl import ConfigurationError
from dstl.atomic import write_atomically
from dstl.paths import as_name

__all__ = ["SessionRouting", "route_session", "routed_queries", "routed_uid"]

_ROUTED = ("transformWithStateInPandas", "transformWithState", "applyInPandasWithState")
_TASK_PREFIX = routed_task_name("")
#: where a DataStreamWriter's options are recorded (lower-case keys, as Spark reads them)
_RECORDED = "_dstl_options"


@dataclass
class _Routed:
    """A routed operator of this driver: its unbound config, how to bind it, where its query's
    state goes, and the query it last ran in."""

    cfg: OperatorConfig
    bind: Callable[[OperatorConfig], None]
    root: str | None
    #: the uid is ``routed_uid``'s (or the placeholder for a nameless function), not the user's
    derived: bool
    #: the task function of the bound config (a Connect start puts it into the plan)
    task_for: Callable[[OperatorConfig], Callable[..., Any]]
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

    def defer(
        self,
        cfg: OperatorConfig,
        bind: Callable[[OperatorConfig], None],
        task_for: Callable[[OperatorConfig], Callable[..., Any]],
    ) -> None:
        if cfg.route is None:
            raise ConfigurationError(f"operator {cfg.uid!r} is bound already")
        with _LOCK:
            _OPERATORS[cfg.route] = _Routed(cfg, bind, self.root, self.derived, task_for)


#: marks a routed method (so that routing twice never saves one as pyspark's own)
_ROUTED_MARK = "_dstl_routed"
#: pyspark's own methods of the Connect ``GroupedData`` (saved before routing replaces them; the
#: classic class inherits its own from ``PandasGroupedOpsMixin``, which routing leaves alone)
_CONNECT_OWN: dict[str, Callable[..., Any]] = {}


def connect_grouped_data() -> type | None:
    """pyspark's Connect ``GroupedData`` class, or None where the Connect client is not installed
    (no Connect session can exist then)."""
    try:
        from pyspark.sql.connect.group import GroupedData
    except ImportError:  # pyspark without its connect extra (grpcio, ...)
        return None
    return GroupedData


def sparks_method(grouped: Any, name: str) -> Callable[..., Any]:
    """pyspark's own ``GroupedData.<name>`` for ``grouped`` (classic or Connect), also while
    ``use_for_session`` routes the method."""
    if type(grouped).__module__.startswith("pyspark.sql.connect"):
        own = _CONNECT_OWN.get(name)
        return own if own is not None else getattr(type(grouped), name)
    from pyspark.sql.pandas.group_ops import PandasGroupedOpsMixin

    return getattr(PandasGroupedOpsMixin, name)  # type: ignore[no-any-return]


def route_session(
    checkpoint_root: str | None, defaults: dict[str, Any], targets: dict[str, Callable[..., Any]]
) -> Callable[[], None]:
    """``backend.spark.api.use_for_session``: route ``GroupedData``'s methods to ``targets`` (the
    API's functions, by method name), hook the writer."""
    from pyspark.sql.group import GroupedData

    classes: list[type] = [GroupedData]
    connect = connect_grouped_data()
    if connect is not None:  # a Connect session's GroupedData: routed alike, never left to Spark's operator
        classes.append(connect)
        for name in _ROUTED:
            own = connect.__dict__.get(name)
            if own is not None and not getattr(own, _ROUTED_MARK, False):
                _CONNECT_OWN.setdefault(name, own)
    saved = {(cls, name): cls.__dict__.get(name) for cls in classes for name in _ROUTED}
    for cls in classes:
        for name, method in _methods(checkpoint_root, defaults, targets).items():
            method.__doc__ = getattr(cls, name).__doc__
            setattr(method, _ROUTED_MARK, True)
            setattr(cls, name, method)
    _hook_writer()

    def restore() -> None:
        for (cls, name), method in saved.items():
            if method is None:
                delattr(cls, name)  # pyspark's own, inherited from its mixin
            else:
                setattr(cls, name, method)

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
    hook_connect_writer()


#: where a Connect writer keeps the user's foreachBatch function (``_start_bound_connect`` wraps it)
_FOREACH = "_dstl_foreach_batch"
_CONNECT_HOOKED: list[bool] = []


def hook_connect_writer() -> None:
    """Wrap the Connect ``DataStreamWriter``'s two starts (its options are in its request already)
    and record its ``foreachBatch`` function, once per process: ``use_for_session``, and the API's
    functions on a Connect session (a ``foreachBatch`` query of theirs needs it too)."""
    try:
        from pyspark.sql.connect.streaming.readwriter import DataStreamWriter
    except ImportError:  # pyspark without its connect extra: no Connect session can exist
        return
    with _LOCK:
        if _CONNECT_HOOKED:
            return
        _CONNECT_HOOKED.append(True)
    start, to_table, foreach_batch = DataStreamWriter.start, DataStreamWriter.toTable, DataStreamWriter.foreachBatch

    def hooked_foreach_batch(self: Any, func: Callable[[Any, int], None]) -> Any:
        self.__dict__[_FOREACH] = (func, foreach_batch)
        return foreach_batch(self, func)

    def hooked_start(
        self: Any, path: Any = None, format: Any = None, outputMode: Any = None, partitionBy: Any = None,
        queryName: Any = None, **given: Any,
    ) -> Any:  # fmt: skip
        return _start_bound_connect(
            self, queryName, given, lambda: start(self, path, format, outputMode, partitionBy, queryName, **given)
        )

    def hooked_to_table(
        self: Any, tableName: str, format: Any = None, outputMode: Any = None, partitionBy: Any = None,
        queryName: Any = None, **given: Any,
    ) -> Any:  # fmt: skip
        return _start_bound_connect(
            self, queryName, given,
            lambda: to_table(self, tableName, format, outputMode, partitionBy, queryName, **given),
        )  # fmt: skip

    for name, hooked, original in (
        ("start", hooked_start, start), ("toTable", hooked_to_table, to_table),
        ("foreachBatch", hooked_foreach_batch, foreach_batch),
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
    routed = _routed_of(_routes_in_analyzed(writer._df))
    if not routed:
        return start()
    _record(writer, given)
    recorded = writer.__dict__[_RECORDED]
    spark = writer._df.sparkSession
    location = _checkpoint_location(writer, spark, recorded, query_name or recorded.get("queryname"))
    properties = {ROUTE_PROPERTY + route: job_dir for route, job_dir in _bind(routed, location, True).items()}
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


def _start_bound_connect(writer: Any, query_name: str | None, given: dict[str, Any], start: Callable[[], Any]) -> Any:
    """``_start_bound`` for a Connect client's writer: the operators are bound in the plan the
    start sends (``backend.spark.connect_plan``), the options are read from the writer's request;
    a ``foreachBatch`` function of a query running the drop-in is wrapped so that its batches
    carry their identity (``connect_plan.ForeachBatch``)."""
    from pyspark.sql.utils import to_str

    from backend.spark.connect_plan import ForeachBatch, bind_in_plan, holds_drop_in, routed_routes
    from dstl import ChangelogConfig

    plan = writer._write_stream._child
    routed = _routed_of(routed_routes(plan))
    foreach = writer.__dict__.get(_FOREACH)
    wrap = foreach is not None and writer._write_proto.HasField("foreach_batch") and holds_drop_in(plan)
    if not routed and not wrap:
        return start()
    recorded = {str(k).lower(): str(v) for k, v in writer._write_proto.options.items()}
    recorded.update({k.lower(): str(to_str(v)) for k, v in given.items() if v is not None})
    name = query_name or writer._write_proto.query_name or None
    root = routed[0].root if routed else None
    location = _checkpoint_location(writer, writer._session, recorded, name, connect=True, root=root)
    if routed:
        job_dirs = _bind(routed, location, False)
        tasks = {str(op.cfg.route): op.task_for(op.cfg.bound(job_dirs[str(op.cfg.route)])) for op in routed}
        bind_in_plan(plan, tasks, job_dirs)
    if wrap:
        func, set_function = foreach
        changelog = routed[0].cfg.changelog if routed else ChangelogConfig(base_path=location)
        reads = (root,) if routed else None  # use_for_session routes the function's reads too
        set_function(writer, ForeachBatch(func, location, changelog, reads))
    query = start()
    for op in routed:
        op.query = query
    return query


def _bind(routed: list[_Routed], location: str, route_files: bool) -> dict[str, str]:
    """Bind each routed operator to its state directory under ``location`` (the driver's part:
    its coordinator, its initial state; on a classic driver also the route file its tick source
    reads); returns the directory of each route."""
    job_dirs: dict[str, str] = {}
    for op, job_dir in zip(routed, _state_dirs(routed, location), strict=True):
        if op.query is not None and op.job_dir != job_dir and bool(op.query.isActive):
            raise ConfigurationError(
                f"the routed operator {op.cfg.uid!r} runs in query {op.query.id} (state {op.job_dir}): a DataFrame "
                "with routed stateful operators runs in one query at a time; build it again for another query"
            )
        op.bind(op.cfg.bound(job_dir))
        if route_files:
            _write_route_file(op.cfg, job_dir)
        op.job_dir = job_dir
        job_dirs[str(op.cfg.route)] = job_dir
    return job_dirs


def _routes_in_analyzed(df: Any) -> list[tuple[str, bool]]:
    """(route, renumbered by a union) of each routed operator in a classic DataFrame's analyzed plan."""
    found: dict[str, bool] = {}
    pending = [(df._jdf.queryExecution().analyzed(), False)]
    while pending:
        node, renumbered = pending.pop()
        kind = node.getClass().getSimpleName()
        if kind == "MapInPandas":
            name = str(node.functionExpr().name())
            if name.startswith(_TASK_PREFIX):
                key = name[len(_TASK_PREFIX) :]
                found[key] = found.get(key, False) or renumbered
        children = node.children()
        pending.extend((children.apply(i), renumbered or (kind == "Union" and i > 0)) for i in range(children.size()))
    return list(found.items())


def _routed_of(routes: list[tuple[str, bool]]) -> list[_Routed]:
    """The routed operators of this driver a plan holds (``routes``: route, renumbered). One that
    feeds a union other than as its first input is refused: its tasks know their partition by
    Spark's partition id, which a union renumbers for every input after the first."""
    found: list[_Routed] = []
    for key, renumbered in routes:
        with _LOCK:
            op = _OPERATORS.get(key)
        if op is None:
            raise ConfigurationError(f"the routed operator {_TASK_PREFIX}{key} was not built in this driver")
        if renumbered:
            raise ConfigurationError(
                f"the routed stateful operator {op.cfg.uid!r} is an input of a union other than its first: "
                "the drop-in's output can be the first input of a union only (write the others first)"
            )
        found.append(op)
    return found


def _checkpoint_location(
    writer: Any,
    spark: Any,
    recorded: dict[str, Any],
    query_name: str | None,
    connect: bool = False,
    root: str | None = None,
) -> str:
    """The query's checkpoint location, as Spark's ``StreamingQueryManager`` will choose it. Where
    Spark would choose a temporary directory: on a classic driver one of its own for the state;
    from a Connect client one it sets as the option (``_connect_temporary``)."""
    location = recorded.get("checkpointlocation")
    if location:
        return str(location)
    default = spark.conf.get("spark.sql.streaming.checkpointLocation", None)
    if default:
        if query_name:
            return f"{default.rstrip('/')}/{query_name}"
        chosen = f"{default.rstrip('/')}/{uuid.uuid4()}"  # Spark would choose a random name: choose it for Spark
        writer.option("checkpointLocation", chosen)
        if not connect:
            _record(writer, {"checkpointLocation": chosen})
        return chosen
    if connect:
        chosen = _connect_temporary(spark, root)
        writer.option("checkpointLocation", chosen)
        return chosen
    return tempfile.mkdtemp(prefix="dstl-temporary-")


def _connect_temporary(spark: Any, root: str | None) -> str:
    """A temporary checkpoint location for a Connect query started without one, where the client
    and the server both reach it: a new directory of this host's when the server runs here (it
    is at a local address and its workers see the directory: a port forwarded to another host's
    server is local too), else one under the routing's ``checkpoint_root`` (the state's storage,
    which both reach); refused otherwise (the server's own temporary directory is unknown here)."""
    host = str(getattr(spark.client, "host", "") or "")
    if host in ("localhost", "127.0.0.1", "::1") or host in (socket.gethostname(), socket.getfqdn()):
        from backend.spark.connect import server_sees

        chosen = tempfile.mkdtemp(prefix="dstl-temporary-")
        marker = os.path.join(chosen, ".dstl-client")
        open(marker, "w").close()
        if server_sees(spark, marker):  # not a port forwarded to a server of another host
            return chosen
        shutil.rmtree(chosen, ignore_errors=True)
    if root is not None:
        return f"{root.rstrip('/')}/temporary-{uuid.uuid4()}"
    raise ConfigurationError(
        "a query with the drop-in's stateful operators started from a Spark Connect client (routed, or with a "
        f"foreachBatch sink) on a server that does not see this host's directories ({host}: another host, or a port "
        "forwarded to one) needs a checkpoint location (the writer's "
        "checkpointLocation option or spark.sql.streaming.checkpointLocation) or a checkpoint_root: the server would "
        "choose a temporary one this client cannot reach, and the state would not follow the query"
    )


def _state_dirs(routed: list[_Routed], location: str) -> list[str]:
    """The state directory of each of a query's routed operators (plan order), by their places
    (``operator_ids``). Operators of one query share a root: ``use_for_session`` is per driver."""
    by_directory: dict[str, list[int]] = {}
    for i, op in enumerate(routed):
        by_directory.setdefault(operators_dir(op.root, location), []).append(i)
    dirs = [""] * len(routed)
    for directory, places in by_directory.items():
        ops = [routed[i] for i in places]
        uids = resolve_uids(ops[0].cfg.changelog, directory, [(op.cfg.uid, op.derived) for op in ops])
        for i, uid in zip(places, uids, strict=True):
            dirs[i] = f"{directory}/{uid}"
    return dirs


def routed_queries() -> list[tuple[str, Any]]:
    """The state directory and query of each routed operator of this driver that ran in a query."""
    with _LOCK:
        return [(op.job_dir, op.query) for op in _OPERATORS.values() if op.query is not None and op.job_dir]


def _write_route_file(cfg: OperatorConfig, job_dir: str) -> None:
    import json

    path = route_file(cfg.local_root, str(cfg.route))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps({"job_dir": job_dir}))
