"""A Spark Connect server for the tests, in a process of its own: ``python -m
tests.backend.spark.connect_server [--workers-python PYTHON]`` prints its port once it serves and
runs until its standard input closes.

Why a process of its own: pyspark's ``SparkSession.builder.remote("local[...]")`` starts the server
in the client's own process (a classic SparkContext with the Connect plugin), which a test session
that already holds the classic ``spark`` fixture cannot do, and which would let the client share
the driver's variables; a Connect user's client is not the driver. The server gets the classic
fixture's settings (``local[2,4]``, four shuffle partitions, RocksDB for Spark's own operators)
and binds to 127.0.0.1 on a free port.

``--workers-python PYTHON``: the server's Python workers run ``PYTHON`` without this process's
``PYTHONPATH`` and in a directory of their own, as on a server where this package is not
installed (with a ``PYTHON`` whose environment lacks it).
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile

from backend.spark.session import ROCKSDB_PROVIDER

CONF = {
    "spark.plugins": "org.apache.spark.sql.connect.SparkConnectPlugin",
    "spark.connect.grpc.binding.address": "127.0.0.1",
    "spark.sql.shuffle.partitions": "4",
    "spark.default.parallelism": "4",
    "spark.sql.streaming.stateStore.providerClass": ROCKSDB_PROVIDER,
}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def main(argv: list[str]) -> None:
    from backend.spark.session import local_session

    conf = dict(CONF)
    if "--workers-python" in argv:
        python = argv[argv.index("--workers-python") + 1]
        conf["spark.pyspark.python"] = python
        os.environ["PYSPARK_PYTHON"] = python
        # the JVM and its workers inherit neither the path to this checkout nor its directory
        os.environ.pop("PYTHONPATH", None)
        os.chdir(tempfile.mkdtemp(prefix="connect-server-"))
    port = _free_port()
    spark = local_session("dstl-connect-tests", "local[2,4]", **conf, **{"spark.connect.grpc.binding.port": str(port)})
    print(port, flush=True)
    sys.stdin.read()  # until the test session closes it
    spark.stop()


if __name__ == "__main__":
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    main(sys.argv[1:])
