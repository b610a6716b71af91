"""What differs on a Spark Connect session, in one place: telling the kinds of session apart, the
session's default parallelism without a ``SparkContext``, and whether the server's Python workers
can run the drop-in at all.

Why: on a Connect session (``SparkSession.builder.remote(...)``, pyspark's ``connect`` extra) the
client is not the Spark driver. It has no JVM, no ``SparkContext`` and no local properties; a
DataFrame is a tree of Python plan objects (``pyspark.sql.connect.plan``) that the server analyzes
on demand. Everything else the drop-in needs of the session is public API both kinds share
(``df.schema``, ``spark.conf``, ``spark.dataSource``, ``spark.streams``), so ``backend.spark.plan``
builds one DataFrame for both, and asks here only what has no common API:

- **the default parallelism** (the number of Spark tasks per batch when the user gives none): on
  a classic session ``SparkContext.defaultParallelism``; on Connect, the number of partitions of
  ``spark.range`` without a partition count, which Spark sizes by the same value
  (``spark.sql.leafNodeDefaultParallelism`` when set, as for every leaf node): one small job, once
  per session;
- **the server's Python workers**: the tasks, the tick source and the state sources import this
  package in the server's Python workers; a Connect server without it would fail the query's first
  batch with an import error from inside the worker. A one-task probe (a function pickled by value,
  so that it unpickles without the package) imports it there once per session and refuses with
  ``ConfigurationError`` naming what is missing (``check_server``).
"""

from __future__ import annotations

import threading
from typing import Any

from dstl import ConfigurationError

__all__ = ["check_server", "default_parallelism", "is_connect", "server_sees"]

#: Connect sessions (by ``session_id``) whose server's workers were checked, and their parallelism
_CHECKED: set[str] = set()
_PARALLELISM: dict[str, int] = {}
_LOCK = threading.Lock()
#: rows of the parallelism probe: at least one per partition for any realistic parallelism
_PROBE_ROWS = 1 << 16


def is_connect(spark: Any) -> bool:
    """Whether ``spark`` is a Spark Connect session (pyspark's ``pyspark.sql.connect`` client)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def default_parallelism(spark: Any) -> int:
    """The session's default parallelism: ``SparkContext.defaultParallelism`` on a classic session;
    on Connect the partitions Spark gives a leaf node without a partition count (module docstring)."""
    if not is_connect(spark):
        return int(spark.sparkContext.defaultParallelism)
    key = str(spark.session_id)
    with _LOCK:
        known = _PARALLELISM.get(key)
    if known is None:
        from pyspark.sql import functions as F

        probe = spark.range(0, _PROBE_ROWS).select(F.spark_partition_id().alias("p")).agg(F.max("p").alias("m"))
        known = int(probe.first()["m"]) + 1
        with _LOCK:
            _PARALLELISM[key] = known
    return known


_PROBE_SOURCE = """
def probe(frames):
    import pandas as pd

    for _ in frames:
        pass
    try:
        import backend.spark.tasks  # noqa: F401
        error = ""
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    yield pd.DataFrame({"error": [error]})
"""


_SEES_SOURCE = """
def sees(frames):
    import os

    import pandas as pd

    for _ in frames:
        pass
    yield pd.DataFrame({"seen": [os.path.exists(PATH)]})
"""


def server_sees(spark: Any, path: str) -> bool:
    """Whether the Connect server's Python workers see ``path`` (a file of this host's): one
    one-task job, for a client that cannot tell the server's host from a forwarded port."""
    namespace: dict[str, Any] = {"__name__": "__main__", "PATH": path}
    exec(compile(_SEES_SOURCE, "<dstl server probe>", "exec"), namespace)  # pickled by value
    return all(r["seen"] for r in spark.range(1).mapInPandas(namespace["sees"], "seen boolean").collect())


def check_server(spark: Any) -> None:
    """On a Connect session, refuse (``ConfigurationError``) a server whose Python workers cannot
    import this package; once per session. Nothing to check on a classic session: its workers run
    with the driver's environment."""
    if not is_connect(spark):
        return
    key = str(spark.session_id)
    with _LOCK:
        if key in _CHECKED:
            return
    namespace: dict[str, Any] = {"__name__": "__main__"}  # pickled by value: it needs nothing of ours
    exec(compile(_PROBE_SOURCE, "<dstl server probe>", "exec"), namespace)
    try:
        errors = [r["error"] for r in spark.range(1).mapInPandas(namespace["probe"], "error string").collect()]
    except Exception as exc:
        raise ConfigurationError(
            f"the Spark Connect server could not run a Python task for the drop-in ({type(exc).__name__}: {exc}); "
            "its Python workers need pyspark's pandas dependencies (pandas, pyarrow) and this package"
        ) from exc
    failed = [e for e in errors if e]
    if failed:
        raise ConfigurationError(
            f"the Spark Connect server's Python workers cannot import this package ({failed[0]}): install it "
            "where the server runs its Python workers (the same version as this client); the stateful operator "
            "was not started, neither on this backend nor on Spark's own"
        )
    with _LOCK:
        _CHECKED.add(key)
