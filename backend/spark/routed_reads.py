"""``use_for_session``: Spark's own state sources' names reading a routed operator's state.

Spark's state sources, ``format("statestore")`` and
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

**On a Spark Connect session** the reader keeps its format and options in Python, and its ``load``
is wrapped alike (``route_connect_reads``), on the client while routing is on, and in the server's
process that runs a routed query's ``foreachBatch`` function while the function runs
(``connect_plan.ForeachBatch``: Spark's tests read a query's state from its ``foreachBatch``).
The server's listener, not the client, completes a batch's checkpoint there, so instead of
completing it the read waits (``WAIT_S`` at most) until the checkpoint of the batch Spark's source
would read is complete: the last batch a routed query of the client reported, or in a
``foreachBatch`` of batch ``n``, for a read of its own query's state, batch ``n - 1`` (its commit
log's last when the function runs).
A read that gives ``batchId`` waits for nothing.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from backend.spark.config import operators_dir
from dstl.paths import local_path

__all__ = ["WAIT_S", "route_connect_reads", "route_reads", "routing_in_foreach_batch"]

_log = logging.getLogger(__name__)

#: where a DataFrameReader's format and options are recorded
_READ = "_dstl_read"
#: Spark's state sources' names (``_serve_state_read``: each is read by one of ours)
_SPARK_STATE_SOURCES = ("statestore", "state-metadata")
#: the longest a Connect read waits for the server to complete the checkpoint it must read
WAIT_S = 60.0
_POLL_S = 0.05


class _ConnectRouting:
    """The routing of Connect reads in a process running a ``foreachBatch`` function: whether it is
    on (``active``), with which checkpoint root (None: none), the batch the function runs and its
    query's operators' directory. For the process, not a thread: the function may read from threads
    it starts, and Spark runs one query's function in a process of its own, one batch at a time."""

    active = False
    root: str | None = None
    batch: int | None = None
    #: the state directory of the query whose ``foreachBatch`` function runs here
    own: str | None = None


_CONNECT = _ConnectRouting()
#: the state directory and query of each routed operator of this driver that ran in a query
#: (``routing.routed_queries``, given by ``route_reads``)
_QUERIES: list[Callable[[], list[tuple[str, Any]]]] = []
#: the Connect client's routing, for the threads that set none of their own
_CLIENT: list[str | None] = []
_CONNECT_HOOK: list[Callable[..., Any]] = []
_CONNECT_LOCK = threading.Lock()


def route_reads(root: str | None, queries: Callable[[], list[tuple[str, Any]]]) -> Callable[[], None]:
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

    restore_connect = route_connect_reads(root)
    _QUERIES[:] = [queries]

    def restore() -> None:
        for name, method in saved.items():
            setattr(DataFrameReader, name, method)
        restore_connect()

    return restore


def _hook_connect_reader() -> bool:
    """Wrap the Connect ``DataFrameReader.load`` once per process; False without pyspark's Connect
    client. The wrapper routes a read only while this thread's or the client's routing is on."""
    try:
        from pyspark.sql.connect.readwriter import DataFrameReader
    except ImportError:  # pyspark without its connect extra: no Connect session can exist
        return False
    with _CONNECT_LOCK:
        if _CONNECT_HOOK:
            return True
        load = DataFrameReader.load
        _CONNECT_HOOK.append(load)

    def hooked_load(self: Any, path: Any = None, format: Any = None, schema: Any = None, **given: Any) -> Any:
        if _CONNECT.active:
            root, batch = _CONNECT.root, (_CONNECT.batch, _CONNECT.own)
        elif _CLIENT:
            root, batch = _CLIENT[-1], None
        else:
            return load(self, path, format, schema, **given)
        source = str(format if format is not None else self._format or "").lower()
        options = {str(k).lower(): v for k, v in self._options.items()}
        options.update({k.lower(): str(v) for k, v in given.items() if v is not None})
        served = _serve(self._client, source, options, path, schema, root, batch)
        return served if served is not None else load(self, path, format, schema, **given)

    hooked_load.__doc__, hooked_load.__name__ = load.__doc__, load.__name__
    setattr(DataFrameReader, "load", hooked_load)  # noqa: B010 (a method, replaced)
    return True


def route_connect_reads(root: str | None) -> Callable[[], None]:
    """Route the Connect client's reads of Spark's state sources (module docstring) until the
    returned function is called."""
    if not _hook_connect_reader():
        return lambda: None
    with _CONNECT_LOCK:
        _CLIENT.append(root)

    def restore() -> None:
        with _CONNECT_LOCK:
            if root in _CLIENT:
                _CLIENT.remove(root)

    return restore


@contextmanager
def routing_in_foreach_batch(root: str | None, batch: int, location: str) -> Iterator[None]:
    """While the ``foreachBatch`` function of a routed query (checkpoint ``location``) runs batch
    ``batch`` in a Connect server's process: its reads of Spark's state sources are routed, and a
    read of this query's state waits for batch ``batch - 1`` (module docstring)."""
    if not _hook_connect_reader():
        yield
        return
    saved = _CONNECT.active, _CONNECT.root, _CONNECT.batch, _CONNECT.own
    _CONNECT.active, _CONNECT.root, _CONNECT.batch = True, root, batch
    _CONNECT.own = operators_dir(root, location)
    try:
        yield
    finally:
        _CONNECT.active, _CONNECT.root, _CONNECT.batch, _CONNECT.own = saved


def _record_read(reader: Any, given: dict[str, Any]) -> None:
    """Record options as pyspark sets them: text (``to_str``), a None value not set."""
    from pyspark.sql.utils import to_str

    recorded = reader.__dict__.setdefault(_READ, {}).setdefault("options", {})
    for key, value in given.items():
        if value is not None:
            recorded[key.lower()] = to_str(value)


def _serve_state_read(reader: Any, path: Any, schema: Any, root: str | None) -> Any:
    """The DataFrame our source reads when ``reader`` (a classic one) names one of Spark's state
    sources and its path holds the drop-in's checkpoints (module docstring); else None."""
    recorded = reader.__dict__.get(_READ, {})
    source = str(recorded.get("format", "")).lower()
    return _serve(reader._spark, source, dict(recorded.get("options", {})), path, schema, root, None)


def _serve(
    spark: Any,
    source: str,
    options: dict[str, Any],
    path: Any,
    schema: Any,
    root: str | None,
    batch: tuple[int | None, str | None] | None,
) -> Any:
    """Our source's DataFrame for a read of Spark's ``source`` with these options, if its path holds
    the drop-in's checkpoints; else None. ``batch``: in a Connect ``foreachBatch``, its batch id
    and its query's operators' directory."""
    location = path if isinstance(path, str) else options.get("path") if path is None else None
    if source not in _SPARK_STATE_SOURCES or not location:
        return None
    from backend.spark.connect import is_connect
    from backend.spark.state_plan import drop_in_location
    from backend.spark.state_source import METADATA_FORMAT, STATE_FORMAT, register

    candidates = [location] if root is None else [operators_dir(root, location), location]
    directory = drop_in_location(candidates, options)
    if directory is None:
        return None
    if not is_connect(spark):
        _catch_up(directory)
    elif "batchid" not in options:
        if batch is None:  # the client: the last batch its queries reported
            wanted = _reported(directory)
        else:  # in a foreachBatch function: its own query's state as of the batch before
            running, own = batch
            wanted = running - 1 if running is not None and own and _same_directory(own, directory) else None
        if wanted is not None and wanted >= 0:
            _wait_for_checkpoint(directory, options, wanted)
    register(spark)  # a foreachBatch function's session may not have it yet
    options.pop("path", None)
    served = spark.read.format(STATE_FORMAT if source == "statestore" else METADATA_FORMAT).options(**options)
    if schema is not None:
        served = served.schema(schema)
    return served.load(directory)


def _queries_in(directory: str) -> list[tuple[str, Any]]:
    """The routed operators' (state directory, query) with their state in ``directory``."""
    listed = _QUERIES[0]() if _QUERIES else []
    return [(job_dir, query) for job_dir, query in listed if _same_directory(job_dir.rsplit("/", 1)[0], directory)]


def _reported(directory: str) -> int | None:
    """The last batch the routed queries of this client with operators in ``directory`` reported."""
    batches = [int(p.batchId) for _, query in _queries_in(directory) for p in query.recentProgress]
    return max(batches) if batches else None


def _wait_for_checkpoint(directory: str, options: Mapping[str, Any], batch: int) -> None:
    """Wait (``WAIT_S`` at most) until every operator in ``directory`` has a completed checkpoint of
    ``batch`` or a later one; past the deadline the read goes on with what is complete."""
    from backend.spark.state_options import parse_options, storage_of
    from backend.spark.state_plan import completed_checkpoints, locate, open_storage

    given = {**options, "path": directory}
    operators = locate(parse_options(given))
    deadline = time.monotonic() + WAIT_S
    for op in operators:
        with open_storage(storage_of(given, op.job_dir), op.job_dir) as storage:
            while True:
                retained = completed_checkpoints(storage.files)
                if retained and retained[-1] >= batch:
                    break
                if time.monotonic() >= deadline:
                    _log.warning(
                        "%s has no completed checkpoint of batch %s after %.0f s (the latest is %s): read as it is",
                        op.job_dir, batch, WAIT_S, retained[-1] if retained else None,
                    )  # fmt: skip
                    break
                time.sleep(_POLL_S)


def _catch_up(directory: str) -> None:
    """Complete the checkpoints of the batches the routed queries with operators in ``directory``
    reported and the driver's listener has not completed yet (module docstring)."""
    from backend.spark.driver import complete_committed, coordinator_at

    for job_dir, query in _queries_in(directory):
        coordinator = coordinator_at(str(job_dir))
        if coordinator is None:
            continue
        latest = coordinator.latest()
        done = -1 if latest is None else latest.checkpoint_id
        query_id = str(query.id)
        for batch in sorted({int(p.batchId) for p in query.recentProgress}):
            if batch > done:
                complete_committed(batch, query_id)


def _same_directory(a: str, b: str) -> bool:
    """Whether two spellings name one directory (a local one: the same absolute path)."""
    local_a, local_b = local_path(a), local_path(b)
    if local_a is not None and local_b is not None:
        return os.path.abspath(local_a) == os.path.abspath(local_b)
    return a.rstrip("/") == b.rstrip("/")
