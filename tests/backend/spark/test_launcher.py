"""The tick source's launcher (``backend.spark.launcher``): it speaks pyspark's connect-back
protocol before importing pyspark, hands every other command to the interpreter, is used where it
can stand in for Spark's executable, and the drop-in's queries run their tick source through it.

The JVM's side of the protocol (``PythonWorkerFactory``: listen, start the worker with the port
and secret or the socket path in its environment, accept, check the secret, read the pid) is
played by the test: it is Spark's protocol, not ours.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from backend.spark import launcher
from backend.spark.launcher import RUNNER_MODULE, launcher_for

#: a bound on a hung child, never reached when the launcher works
HANG_S = 120


@pytest.fixture(scope="module")
def launcher_file() -> str:
    return launcher._write_launcher(sys.executable)


def _read_int(stream: Any) -> int:
    value: int = struct.unpack("!i", stream.read(4))[0]
    return value


def _start_worker(launcher_file: str, env: dict[str, str], cwd: Path) -> subprocess.Popen[str]:
    """The launcher as Spark starts the streaming source runner, in an interpreter that cannot import
    pyspark (nor the backend): ``-S`` leaves the environment's site-packages off the path."""
    environ = {"PATH": os.environ.get("PATH", ""), **env}
    return subprocess.Popen([sys.executable, "-S", launcher_file, "-m", RUNNER_MODULE], env=environ, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def _accept(server: socket.socket) -> tuple[socket.socket, Any]:
    server.settimeout(HANG_S)
    conn, _ = server.accept()
    return conn, conn.makefile("rwb")


def test_the_worker_connects_back_and_authenticates_before_it_imports_pyspark(
    launcher_file: str, tmp_path: Path
) -> None:
    with socket.create_server(("127.0.0.1", 0), backlog=1) as server:
        port = server.getsockname()[1]
        worker = _start_worker(launcher_file, {"PYTHON_WORKER_FACTORY_PORT": str(port),
                                               "PYTHON_WORKER_FACTORY_SECRET": "the-secret"}, tmp_path)  # fmt: skip
        conn, stream = _accept(server)
        with conn, stream:
            secret = stream.read(_read_int(stream)).decode("utf-8")
            stream.write(struct.pack("!i", 2) + b"ok")
            stream.flush()
            pid = _read_int(stream)
    _, stderr = worker.communicate(timeout=HANG_S)
    assert (secret, pid) == ("the-secret", worker.pid)
    # connected, authenticated and said who it is without pyspark; only then did it need pyspark
    assert worker.returncode != 0 and "No module named 'pyspark'" in stderr


def test_over_a_unix_domain_socket_the_worker_connects_without_a_secret(launcher_file: str, tmp_path: Path) -> None:
    path = str(tmp_path / "worker.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(path)
        server.listen(1)
        worker = _start_worker(launcher_file, {"PYTHON_WORKER_FACTORY_SOCK_PATH": path}, tmp_path)
        conn, stream = _accept(server)
        with conn, stream:
            pid = _read_int(stream)
    _, stderr = worker.communicate(timeout=HANG_S)
    assert pid == worker.pid
    assert "No module named 'pyspark'" in stderr


def test_a_refused_secret_fails_the_worker_naming_the_authentication(launcher_file: str, tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0), backlog=1) as server:
        port = server.getsockname()[1]
        worker = _start_worker(launcher_file, {"PYTHON_WORKER_FACTORY_PORT": str(port),
                                               "PYTHON_WORKER_FACTORY_SECRET": "wrong"}, tmp_path)  # fmt: skip
        conn, stream = _accept(server)
        with conn, stream:
            stream.read(_read_int(stream))
            stream.write(struct.pack("!i", 3) + b"err")
            stream.flush()
            _, stderr = worker.communicate(timeout=HANG_S)
    assert worker.returncode != 0
    assert "refused this worker's authentication" in stderr and "No module named" not in stderr


def test_every_other_command_runs_as_the_interpreter_would_run_it(launcher_file: str, tmp_path: Path) -> None:
    code = "import sys; print(sys.executable, sys.argv, sys.path[0] == '')"
    direct = subprocess.run([sys.executable, "-c", code, "x"], capture_output=True, text=True, cwd=tmp_path)
    launched = subprocess.run([launcher_file, "-c", code, "x"], capture_output=True, text=True, cwd=tmp_path)
    assert launched.returncode == direct.returncode == 0
    assert launched.stdout == direct.stdout


def _session(master: str, python_exec: str) -> Any:
    """What ``launcher_for`` reads of a session: its context's master and Python executable."""
    return SimpleNamespace(sparkContext=SimpleNamespace(master=master, pythonExec=python_exec))


def test_the_launcher_stands_in_only_for_this_interpreter_on_this_host() -> None:
    ours = launcher_for(_session("local[2]", sys.executable))
    assert ours is not None and os.access(ours, os.X_OK)
    assert launcher_for(_session("local-cluster[2,1,1024]", sys.executable)) == ours
    # executors on other hosts run the data source's executable too: they have no such file
    assert launcher_for(_session("spark://host:7077", sys.executable)) is None
    assert launcher_for(_session("yarn", sys.executable)) is None
    # an executable that is not this interpreter (a wrapper, another Python): Spark's own is used
    assert launcher_for(_session("local[2]", "/bin/sh")) is None
    assert launcher_for(_session("local[2]", "no-such-python-here")) is None


def _processor() -> Any:
    import pandas as pd
    from pyspark.sql.streaming.stateful_processor import StatefulProcessor

    class Count(StatefulProcessor):  # type: ignore[misc]
        def init(self, handle: Any) -> None:
            self.handle = handle
            self.count = handle.getValueState("n", "n long")

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:
            n = (self.count.get()[0] if self.count.exists() else 0) + sum(len(frame) for frame in rows)
            self.count.update((n,))
            self.handle.registerTimer(timerValues.getCurrentProcessingTimeInMs() + 1)
            yield pd.DataFrame({"k": [key[0]], "n": [n]})

        def handleExpiredTimer(self, key: Any, timerValues: Any, expiredTimerInfo: Any) -> Any:
            yield pd.DataFrame({"k": [key[0]], "n": [-1]})

    return Count()


def _launched_runners() -> Iterator[list[str]]:
    """The command lines of this host's processes that run the streaming source runner."""
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:  # not a process, or gone
            continue
        if RUNNER_MODULE in argv:
            yield argv


@pytest.mark.spark
@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads command lines from /proc")
def test_a_drop_in_query_runs_its_tick_source_through_the_launcher(spark: Any, tmp_path: Path) -> None:
    from backend.spark.api import transform_with_state_in_pandas

    source = tmp_path / "in"
    source.mkdir()
    (source / "0.json").write_text("\n".join(json.dumps({"k": f"k{i % 3}"}) for i in range(9)))
    df = spark.readStream.schema("k string").json(str(source))
    out = transform_with_state_in_pandas(df.groupBy("k"), _processor(), "k string, n long", "Update",
                                         "ProcessingTime", checkpoint_location=str(tmp_path / "state"),
                                         operator_uid="count", local_dir=str(tmp_path / "local"))  # fmt: skip
    rows: list[tuple[str, int]] = []
    query = (
        out.writeStream.foreachBatch(lambda batch, _: rows.extend(tuple(r) for r in batch.collect()))
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .start()
    )
    try:
        query.processAllAvailable()
        runners = list(_launched_runners())
    finally:
        query.stop()
    ours = launcher_for(spark)
    assert ours is not None
    assert any(ours in argv for argv in runners), runners
    # the input's counts, then the timers' batch without input: the source works through the launcher
    assert sorted(rows) == [("k0", -1), ("k0", 3), ("k1", -1), ("k1", 3), ("k2", -1), ("k2", 3)]
