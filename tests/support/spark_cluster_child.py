"""Child process of the cluster tests: one streaming query through the drop-in on a
``local-cluster[2,1,1024]`` master (a driver and two executor JVMs of one core each), with faults
injected at deterministic points.

    python -m tests.support.spark_cluster_child DIR [--connect]      (cwd: the project root)

The query is ``transform_with_state_in_pandas`` over a JSON file source with one input file per
micro-batch (``maxFilesPerTrigger=1``); the processor keeps a running count and total per key in
value state and outputs them for every key of the batch. A ``foreachBatch`` sink writes each
batch's rows to ``DIR/output/<batch>.json``; the parent computes the expected rows from the input
files (``DIR/input``) and compares. The phases, in order, each a few batches:

- ``warm-up``: two plain batches at parallelism 4;
- ``executor-kill``: a task of the batch blocks in the processor right after it changed a key's
  state (it claims ``DIR/control/block-<b>``, a marker file only one attempt can rename, and
  writes its pid to ``blocked-<b>.json``); the driver walks up from that pid to the executor JVM
  running it (``CoarseGrainedExecutorBackend`` of this application) and SIGKILLs it, and Spark
  retries the task on the other executor or the one the cluster starts in its place; then one
  more batch;
- ``local-dir-wipe``: ``local_dir`` (the drop-in's LMDB directories; on this one-host cluster both
  executors share it) is deleted between two batches;
- ``service-kill``: a task blocks as above and the driver SIGKILLs every changelog service process
  of this run (command line with ``dstl.service``; this run's ``RUN_ENV`` token in its
  environment, or one of this run's executor JVMs among its ancestors), then lets the task go on;
  with none found it records so (the parent skips); services of other runs are left alone;
- ``restart``: the query is stopped and started again in the same session, on the same checkpoint
  locations, at parallelism 2. If the drop-in refuses that, the refusal is recorded and the
  restart is done again as a new driver would (``driver.forget_all()`` first);
- ``state-read``: the latest checkpoint's state read as a DataFrame (``format("dstl-state")``) in
  three partitions, which run on the executors (the driver runs no task on this master).

The phases run in one child so that the cluster starts once. A phase that fails records its error
and ends the run. ``DIR/result.json`` says what happened (the parent's only other inputs are the
input and output files); the executors' logs are moved to ``DIR/executor-logs``.

With ``--connect`` the query is started from a Spark Connect client: the child's SparkContext on
the cluster runs Spark's bundled Connect server (its plugin, on 127.0.0.1), and the query is built
and started through a Connect session on it, as a remote user's program does; the phases are
``warm-up``, ``executor-kill``, ``restart`` and ``state-read`` (through the client; the number of
partitions is not recorded: Connect has no ``DataFrame.rdd``). The client is not the driver: the
server completes the checkpoints (``backend.spark.server_listener``), so a batch is finished once
its ``chk-<b>/_metadata`` is on disk. Both sessions share this process only because the cluster
is started once here; the client uses nothing of the server's Python objects.

Everything the processor uses is defined in this module, which runs as ``__main__``: cloudpickle
ships it to the executors by value (they cannot import ``tests``).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

MASTER = "local-cluster[2,1,1024]"
UID = "totals"
OUTPUT = "k string, count long, total long"
KEYS = 24
ROWS_PER_BATCH = 40
SEED = 18
#: an environment variable the child sets: its executors, their Python workers and any changelog
#: service those start inherit it, which tells this run's processes from anyone else's
RUN_ENV = "DSTL_CLUSTER_TEST_RUN"
#: how long a blocked task waits to be killed or released before it fails its batch, seconds
BLOCK_TIMEOUT_S = 300.0
#: how long the driver waits for a condition (a task to block, a process to die, a checkpoint)
WAIT_S = 240.0
POLL_S = 0.05

PHASES = ["warm-up", "executor-kill", "local-dir-wipe", "service-kill", "restart", "state-read"]
CONNECT_PHASES = ["warm-up", "executor-kill", "restart", "state-read"]


# -- in the executors ----------------------------------------------------------------------------


def fault_point(control: str) -> None:
    """Block here if the driver asked for it in this batch (``control/block-<batch>``), once: the
    first task attempt to rename the marker blocks until it is killed or ``release-<batch>``
    appears."""
    from pyspark import TaskContext

    from backend.spark.config import FOREACH_BATCH_ID

    context = TaskContext.get()
    # a Connect query's foreachBatch function evaluates the batch in jobs of its own, which the
    # drop-in tells the batch id by a property of its own
    batch = context.getLocalProperty("streaming.sql.batchId") or context.getLocalProperty(FOREACH_BATCH_ID)
    directory = Path(control)
    try:
        os.rename(directory / f"block-{batch}", directory / f"claimed-{batch}")
    except FileNotFoundError:
        return
    info = {"pid": os.getpid(), "partition": context.partitionId(), "attempt": context.attemptNumber()}
    _write_json(directory / f"blocked-{batch}.json", info)
    deadline = time.monotonic() + BLOCK_TIMEOUT_S
    while not (directory / f"release-{batch}").exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"batch {batch}: blocked for {BLOCK_TIMEOUT_S:g} s, neither killed nor released")
        time.sleep(POLL_S)


def make_processor(control: str) -> Any:
    import pandas as pd
    from pyspark.sql.streaming.stateful_processor import StatefulProcessor

    class RunningTotals(StatefulProcessor):
        def init(self, handle: Any) -> None:
            self.acc = handle.getValueState("acc", "count long, total long")

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:
            count, total = self.acc.get() or (0, 0)
            for frame in rows:
                count += len(frame)
                total += int(frame["v"].sum())
            self.acc.update((count, total))
            fault_point(control)  # after the state changed: a retry must not see this attempt's change
            yield pd.DataFrame({"k": [key[0]], "count": [count], "total": [total]})

    return RunningTotals()


# -- processes -------------------------------------------------------------------------------------


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _environ(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _parent(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def _alive(pid: int) -> bool:
    """Running: not gone and not a zombie waiting to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _pids() -> Iterator[int]:
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            yield int(entry.name)


def executors(app_id: str) -> dict[int, str]:
    """This application's executor JVMs: pid -> executor id."""
    found = {}
    for pid in _pids():
        args = _cmdline(pid).split()
        if "CoarseGrainedExecutorBackend" in " ".join(args) and app_id in args and "--executor-id" in args:
            found[pid] = args[args.index("--executor-id") + 1]
    return found


def executor_running(pid: int, app_id: str) -> int:
    """The executor JVM of this application that ``pid`` (a Python worker) descends from."""
    ours = executors(app_id)
    while pid > 1:
        pid = _parent(pid)
        if pid in ours:
            return pid
    raise RuntimeError(f"no executor JVM of {app_id} is an ancestor of the blocked Python worker")


def _descends_from(pid: int, ancestors: set[int]) -> bool:
    try:
        while pid > 1:
            pid = _parent(pid)
            if pid in ancestors:
                return True
    except OSError:
        pass
    return False


def services(token: str, app_id: str) -> tuple[list[int], list[int]]:
    """The changelog service processes (``python -m dstl.service ...``): this run's (this run's
    ``RUN_ENV`` token in their environment, or started under one of its executor JVMs) and the
    others on this machine."""
    ours, others = [], []
    jvms = set(executors(app_id))
    for pid in _pids():
        if "dstl.service" in _cmdline(pid).split():
            mine = f"{RUN_ENV}={token}" in _environ(pid) or _descends_from(pid, jvms)
            (ours if mine else others).append(pid)
    return ours, others


def wait_for(what: str, condition: Callable[[], Any], query: Any = None, timeout_s: float = WAIT_S) -> Any:
    """Poll ``condition`` until it returns something true; fail after ``timeout_s`` or as soon as
    ``query`` has stopped."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if query is not None and not query.isActive:
            raise RuntimeError(f"the query stopped while waiting for {what}: {query.exception()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout_s:g} s")
        time.sleep(POLL_S)


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    wait_for(f"process {pid} to die", lambda: not _alive(pid))


# -- the run -------------------------------------------------------------------------------------------


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def batch_rows(batch: int) -> list[tuple[str, int]]:
    rng = random.Random(SEED * 1000 + batch)
    return [(f"k{rng.randrange(KEYS)}", rng.randrange(1, 100)) for _ in range(ROWS_PER_BATCH)]


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _checkpoint_properties(state: str, batch: int) -> dict[str, Any] | None:
    """The properties of checkpoint ``batch`` once its ``_metadata`` is on disk (the Connect
    server completes it), else None."""
    from backend.checkpointing.metadata import SnapshotMetadata, metadata_path

    path = Path(state) / metadata_path(batch)
    try:
        return dict(SnapshotMetadata.loads(path.read_bytes(), str(path)).properties)
    except FileNotFoundError:
        return None


class Run:
    def __init__(self, root: Path, connect: bool = False) -> None:
        self.root = root
        self.control = root / "control"
        self.local = root / "local"
        self.state = str(root / "state")
        for sub in ("input", "output", "control"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        self.token = uuid.uuid4().hex
        os.environ[RUN_ENV] = self.token
        self.batches = 0
        self.query: Any = None
        self.result: dict[str, Any] = {"master": MASTER, "connect": connect, "phases": {}, "restored_from": {}}
        self.connect = connect

        from backend.spark.session import local_session

        began = time.monotonic()
        conf: dict[str, str] = {}
        if connect:
            port = _free_port()
            conf = {
                "spark.plugins": "org.apache.spark.sql.connect.SparkConnectPlugin",
                "spark.connect.grpc.binding.address": "127.0.0.1",
                "spark.connect.grpc.binding.port": str(port),
            }
        self.server = local_session("dstl-cluster-tests", MASTER, **conf)
        self.app_id = self.server.sparkContext.applicationId
        self.spark = self.server
        if connect:
            from pyspark.sql.connect.session import SparkSession

            os.environ["SPARK_CONNECT_MODE_ENABLED"] = "1"  # pyspark's functions build Connect columns
            self.spark = SparkSession.builder.remote(f"sc://127.0.0.1:{port}").create()
        self.result.update(app_id=self.app_id, start_s=round(time.monotonic() - began, 1))

    def start(self, parallelism: int) -> None:
        from backend.spark.api import transform_with_state_in_pandas

        df = (
            self.spark.readStream.schema("k string, v long")
            .option("maxFilesPerTrigger", 1)
            .json(str(self.root / "input"))
        )
        out = transform_with_state_in_pandas(
            df.groupBy("k"), make_processor(str(self.control)), OUTPUT, "Update", "None",
            checkpoint_location=self.state, operator_uid=UID, parallelism=parallelism, local_dir=str(self.local),
        )  # fmt: skip
        output = self.root / "output"

        def sink(batch_df: Any, batch_id: int) -> None:
            rows = sorted([r["k"], r["count"], r["total"]] for r in batch_df.collect())
            _write_json(output / f"{batch_id}.json", rows)

        writer = out.writeStream.foreachBatch(sink).option("checkpointLocation", str(self.root / "spark"))
        self.query = writer.start()

    def stop(self) -> None:
        if self.query is not None:
            self.query.stop()
            self.query = None

    def write_input(self) -> int:
        batch = self.batches
        text = "".join(json.dumps({"k": k, "v": v}) + "\n" for k, v in batch_rows(batch))
        tmp = self.root / "input" / f".{batch:04d}.tmp"  # the file source skips names starting with "."
        tmp.write_text(text)
        os.replace(tmp, self.root / "input" / f"{batch:04d}.json")
        self.batches += 1
        return batch

    def finish(self, batch: int) -> None:
        """Wait for ``batch`` to be committed and its checkpoint completed; note where its
        subtasks' state came from."""
        from backend.spark.driver import coordinator_at

        self.query.processAllAvailable()

        def completed() -> dict[str, Any] | None:
            if self.connect:
                return _checkpoint_properties(self.state, batch)
            coordinator = coordinator_at(self.state)
            latest = coordinator.latest() if coordinator is not None else None
            return dict(latest.properties) if latest is not None and latest.checkpoint_id >= batch else None

        properties = wait_for(f"checkpoint {batch}", completed, self.query)
        self.result["restored_from"][str(batch)] = properties.get("restored_from")

    def plain_batch(self) -> int:
        batch = self.write_input()
        self.finish(batch)
        return batch

    def blocked_batch(self, act: Callable[[dict[str, Any]], dict[str, Any]]) -> tuple[int, dict[str, Any]]:
        """A batch in which one task blocks mid-batch; ``act(blocked task's info)`` runs then,
        and the task is released after it (if it is still alive)."""
        batch = self.batches
        (self.control / f"block-{batch}").touch()
        self.write_input()
        try:
            path = self.control / f"blocked-{batch}.json"
            wait_for(f"a task of batch {batch} to block", path.exists, self.query)
            info = json.loads(path.read_text())
            details = act(info)
        finally:
            (self.control / f"release-{batch}").touch()
        self.finish(batch)
        return batch, {"blocked": info, **details}

    # -- the phases

    def phase_warm_up(self) -> dict[str, Any]:
        self.start(4)
        batches = [self.plain_batch(), self.plain_batch()]
        return {"batches": batches, "executors": sorted(executors(self.app_id).values())}

    def phase_executor_kill(self) -> dict[str, Any]:
        def kill_executor(info: dict[str, Any]) -> dict[str, Any]:
            pid = executor_running(int(info["pid"]), self.app_id)
            killed = {"pid": pid, "executor_id": executors(self.app_id)[pid], "cmdline": _cmdline(pid)}
            kill(pid)
            wait_for("the blocked Python worker to die with its executor", lambda: not _alive(int(info["pid"])))
            return {"killed": killed}

        batch, details = self.blocked_batch(kill_executor)
        return {"batches": [batch, self.plain_batch()], **details, "killed_batch": batch}

    def phase_local_dir_wipe(self) -> dict[str, Any]:
        first = self.plain_batch()
        existed = self.local.is_dir()
        shutil.rmtree(self.local)
        return {"batches": [first, self.plain_batch()], "wiped_existing": existed, "after_wipe": first + 1}

    def phase_service_kill(self) -> dict[str, Any]:
        def kill_services(info: dict[str, Any]) -> dict[str, Any]:
            pids, others = services(self.token, self.app_id)
            for pid in pids:
                kill(pid)
            return {"service_pids": pids, "other_service_pids": others}

        batch, details = self.blocked_batch(kill_services)
        return {"batches": [batch, self.plain_batch()], **details}

    def phase_restart(self) -> dict[str, Any]:
        from backend.spark import driver

        self.stop()
        refused = None
        try:
            self.start(2)
        except Exception as exc:  # recorded for the parent's test; then restart as a new driver would
            refused = f"{type(exc).__name__}: {exc}"
            driver.forget_all()
            self.start(2)
        batches = [self.plain_batch(), self.plain_batch()]
        return {"batches": batches, "refused": refused, "parallelism": 2}

    def phase_state_read(self) -> dict[str, Any]:
        from backend.spark.api import register_state_source

        register_state_source(self.spark)
        df = self.spark.read.format("dstl-state").option("stateVarName", "acc").option("numPartitions", 3)
        state = df.load(self.state)
        rows = sorted([r["key"]["k"], r["value"]["count"], r["value"]["total"]] for r in state.collect())
        partitions = None if self.connect else state.rdd.getNumPartitions()
        return {"rows": rows, "partitions": partitions, "batch": self.batches - 1}

    def run(self) -> None:
        phases = self.result["phases"]
        for name in CONNECT_PHASES if self.connect else PHASES:
            began = time.monotonic()
            try:
                phase = getattr(self, f"phase_{name.replace('-', '_')}")()
                phase["error"] = None
            except Exception as exc:
                phase = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            phase["seconds"] = round(time.monotonic() - began, 1)
            phases[name] = phase
            _write_json(self.root / "result.json", self.result)
            if phase["error"] is not None:
                break

    def close(self) -> None:
        from backend.spark import driver

        try:
            self.stop()
        finally:
            driver.detach(self.spark)
            driver.forget_all()
            if self.connect:
                from backend.spark import server_listener

                server_listener.remove_server_listeners(self.spark)
                self.spark.stop()
            self.server.stop()
            for pid in services(self.token, self.app_id)[0]:  # started by this run's workers: stop them
                os.kill(pid, signal.SIGTERM)
            from pyspark.find_spark_home import _find_spark_home

            work = Path(_find_spark_home()) / "work" / self.app_id
            if work.is_dir():
                shutil.move(str(work), str(self.root / "executor-logs"))
            _write_json(self.root / "result.json", self.result)


def main(argv: list[str]) -> int:
    began = time.monotonic()
    run = Run(Path(argv[0]), connect="--connect" in argv[1:])
    try:
        run.run()
    finally:
        run.close()
    run.result["total_s"] = round(time.monotonic() - began, 1)
    _write_json(run.root / "result.json", run.result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
