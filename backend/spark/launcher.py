"""The Python executable of the tick source's workers: connect back to Spark first, import pyspark after.

Why: Spark starts the worker of a Python streaming source (``<python> -m
pyspark.sql.streaming.python_streaming_source_runner``, in the driver, when a query starts) as a
process of its own and waits a fixed 10 s for it to connect back
(``PythonWorkerFactory.createSimpleWorker``; no setting changes it, unlike the workers forked by
Spark's Python daemon, which get 60 s). That module imports pyspark, pyarrow and pandas before it
connects, from the ``pyspark.zip`` Spark puts first on a worker's path (compiled at every start):
most of a second of CPU, more than 10 s of wall time on a loaded machine (a load of 10 and more on
two cores), and the query dies at its start with "Python worker failed to connect back" while
Spark's own operators, which start no such worker, run.

So the tick source (``backend.spark.ticks``) is registered with this launcher as its Python
executable. Spark runs it as ``<launcher> -m <module>``:

- for the streaming source runner, the launcher does what the runner's ``__main__`` (pyspark 4.3)
  does with ``get_sock_file_to_executor(timeout=None)``, with the standard library only: connect
  (TCP to the loopback port with the secret, or the unix domain socket without one), authenticate,
  clear the timeout, write its pid; and only then imports the runner and runs its ``main`` on that
  socket. Before connecting it costs an interpreter start (a twentieth of the runner's CPU before
  connecting); what follows has no fixed deadline on Spark's side. Spark's side of
  the connection is pyspark's own protocol, as ``pyspark.util.local_connect_and_auth`` speaks it;
- every other command (the daemons that run the data source's planning and its reads) and any
  environment the launcher does not recognise are handed unchanged to the interpreter by
  ``os.execv``: the same process as without the launcher, started one exec later.

The launcher is a file, written once per driver process into a private temporary directory:
``#!<interpreter>`` and this module's source, which imports the standard library only (so it runs
without importing the ``backend`` package). It is used only where it can stand in for the
interpreter exactly (``launcher_for``): a classic session (a Spark Connect client is not the driver
and cannot set the executable), Spark's executable for Python (``sc.pythonExec``) is the
driver's own interpreter, at a path a ``#!`` line can hold, on a POSIX system, and the master is
``local`` or ``local-cluster`` (Spark runs the data source's executable on the executors too, for
its reads: elsewhere they are other hosts, without this file). Otherwise the tick source runs with
Spark's executable, as any Python data source does.
"""

from __future__ import annotations

import os
import socket
import struct
import sys

TYPE_CHECKING = False  # not typing's: a worker's start does not pay for importing typing
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any, BinaryIO

__all__ = ["RUNNER_MODULE", "connect_back", "launcher_for", "main", "register_data_source"]

#: the module Spark runs for a Python streaming source, with a fixed wait for it to connect back
RUNNER_MODULE = "pyspark.sql.streaming.python_streaming_source_runner"
#: a ``#!`` line longer than this is cut by some kernels (128 bytes with the ``#!`` and newline)
_MAX_SHEBANG_PATH = 120
_launchers: dict[str, str] = {}


def _write_int(value: int, stream: BinaryIO) -> None:
    stream.write(struct.pack("!i", value))


def _read_exactly(stream: BinaryIO, length: int) -> bytes:
    data = stream.read(length)
    if data is None or len(data) != length:
        raise EOFError(f"the JVM closed the connection after {0 if data is None else len(data)} of {length} bytes")
    return data


def _authenticate(sock_file: BinaryIO, secret: str) -> None:
    """pyspark's ``_do_server_auth``: the secret with its length, then the JVM answers "ok"."""
    encoded = secret.encode("utf-8")
    _write_int(len(encoded), sock_file)
    sock_file.write(encoded)
    sock_file.flush()
    (length,) = struct.unpack("!i", _read_exactly(sock_file, 4))
    reply = _read_exactly(sock_file, length).decode("utf-8")
    if reply != "ok":
        raise RuntimeError(f"the JVM refused this worker's authentication (it answered {reply!r})")


def connect_back(environ: Mapping[str, str] = os.environ) -> BinaryIO | None:
    """The socket file to the JVM that started this worker, connected, authenticated, without a
    timeout and with this process's pid written, as pyspark's ``get_sock_file_to_executor(None)``
    returns it; None if ``environ`` is not one the JVM gives a worker it waits for."""
    sock_path = environ.get("PYTHON_WORKER_FACTORY_SOCK_PATH")
    port = environ.get("PYTHON_WORKER_FACTORY_PORT")
    secret = environ.get("PYTHON_WORKER_FACTORY_SECRET")
    timeout = int(environ.get("SPARK_AUTH_SOCKET_TIMEOUT", 15))
    buffering = int(environ.get("SPARK_BUFFER_SIZE", 65536))
    if sock_path is not None and secret is None:  # a unix domain socket: no secret
        targets: list[tuple[int, int, int, Any]] = [(socket.AF_UNIX, socket.SOCK_STREAM, 0, sock_path)]
    elif sock_path is None and port is not None and secret is not None:
        host = "::1" if environ.get("SPARK_PREFER_IPV6", "false").lower() == "true" else "127.0.0.1"
        targets = [(af, kind, proto, sa) for af, kind, proto, _, sa in
                   socket.getaddrinfo(host, int(port), socket.AF_UNSPEC, socket.SOCK_STREAM)]  # fmt: skip
    else:
        return None
    errors = []
    for family, kind, proto, address in targets:
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(timeout)
            sock.connect(address)
            made: Any = sock.makefile("rwb", buffering)  # typeshed: an IOBase for a buffer size not literal
            sock_file: BinaryIO = made
            if secret is not None:
                _authenticate(sock_file, secret)
        except OSError as error:
            sock.close()
            errors.append(f"tried to connect to {address}, but an error occurred: {error}")
            continue
        sock.settimeout(None)
        _write_int(os.getpid(), sock_file)
        sock_file.flush()
        return sock_file
    raise ConnectionError(f"this Python worker could not connect back to the JVM: {errors}")


def main(argv: list[str]) -> None:
    """Run ``<interpreter> <argv[1:]>``: the streaming source runner connected first, anything else
    by ``os.execv``."""
    sock_file = connect_back() if argv[1:] == ["-m", RUNNER_MODULE] else None
    if sock_file is None:
        os.execv(sys.executable, [sys.executable, *argv[1:]])
    # what ``python -m`` puts first on the path: the working directory, not this file's directory
    if sys.path and sys.path[0] == os.path.dirname(os.path.abspath(argv[0])):
        sys.path[0] = os.getcwd()
    from pyspark.sql.streaming import python_streaming_source_runner

    try:
        python_streaming_source_runner.main(sock_file, sock_file)
    finally:
        sock_file.close()


def launcher_for(spark: Any) -> str | None:
    """The launcher to register ``spark``'s tick source with, written on first use; None where the
    tick source must run with Spark's own executable (see the module docstring)."""
    import shutil

    if type(spark).__module__.startswith("pyspark.sql.connect"):
        return None  # a Connect client is not the driver: Spark's executable, as for any data source
    sc = spark.sparkContext
    if os.name != "posix" or not str(sc.master).startswith("local"):
        return None
    found = shutil.which(sc.pythonExec)
    interpreter = os.path.abspath(found) if found else None
    if (
        interpreter is None
        or len(interpreter) > _MAX_SHEBANG_PATH
        or any(c.isspace() for c in interpreter)
        or not os.path.samefile(interpreter, sys.executable)
    ):
        return None
    path = _launchers.get(interpreter)
    if path is None or not os.access(path, os.X_OK):  # first use, or a cleaner emptied the temporary directory
        path = _launchers[interpreter] = _write_launcher(interpreter)
    return path


def register_data_source(spark: Any, source: Any, python_exec: str | None) -> None:
    """``spark.dataSource.register(source)``, the source's workers run by ``python_exec`` (None:
    Spark's own executable).

    pyspark takes a data source's executable from ``sc.pythonExec`` when it registers the source,
    so that attribute is ``python_exec`` for the call and restored after. A function another
    thread of the driver wraps meanwhile gets it too; with the launcher that function runs as it
    would have, since the launcher hands every command but the streaming source runner to the
    interpreter unchanged."""
    if python_exec is None:
        spark.dataSource.register(source)
        return
    sc = spark.sparkContext
    own = sc.pythonExec
    sc.pythonExec = python_exec
    try:
        spark.dataSource.register(source)
    finally:
        sc.pythonExec = own


def _write_launcher(interpreter: str) -> str:
    """``#!<interpreter>`` and this module's source, executable by its owner only, in a directory
    of this process's that is removed when the process exits (not when a forked child does)."""
    import atexit
    import tempfile

    directory = tempfile.mkdtemp(prefix="dstl-launcher-")
    atexit.register(_remove, directory, os.getpid())
    path = os.path.join(directory, "python")
    with open(__file__, encoding="utf-8") as source, open(path, "w", encoding="utf-8") as out:
        out.write(f"#!{interpreter}\n{source.read()}")
    os.chmod(path, 0o700)
    return path


def _remove(directory: str, owner: int) -> None:
    import shutil

    if os.getpid() == owner:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv)
