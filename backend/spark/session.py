"""A local SparkSession set up the way this machine needs it (demo, benchmark, tests).

Spark's Python workers must run this environment's interpreter and the JVM must bind to the
loopback address here; the UI and the console progress bar only cost time and clutter output. A
Python worker Spark starts on its own gives up on its handshake with the JVM after
``spark.python.authenticate.socketTimeout`` (15 s by default): 120 s here, so on a loaded machine
the worker does not give up first (Spark's own wait for it to connect is fixed:
``backend.spark.launcher``).
"""

from __future__ import annotations

import os
import sys
from typing import Any

ROCKSDB_PROVIDER = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
#: how long a Python worker waits for the JVM during its handshake (connect, the secret's answer)
WORKER_SOCKET_TIMEOUT = "120s"


def local_session(app: str, master: str = "local[2]", **conf: str) -> Any:
    """``SparkSession.builder.master(master)...getOrCreate()`` with ``conf`` on top; log level ERROR."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    builder = (
        SparkSession.builder.master(master)
        .appName(app)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.python.authenticate.socketTimeout", WORKER_SOCKET_TIMEOUT)
    )
    for key, value in conf.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark
