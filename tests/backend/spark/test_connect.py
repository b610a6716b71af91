"""The drop-in on a Spark Connect session (a real Connect server in a process of its own, the
``connect`` fixture): ``use_for_session`` routes the Connect ``GroupedData`` and never leaves a
routed call to Spark's own operator; the checkpoints are completed on the server, without the
client; a client that goes away and a new one that starts the query again resume the state.
The outputs of the three operators against Spark's own on Connect are in
``parity/test_connect_differential.py``."""

from __future__ import annotations

import glob
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.backend.spark.conftest import connect_client
from tests.backend.spark.queries import count_rows, publish
from tests.support.polling import wait_until

pytestmark = pytest.mark.spark

pd = pytest.importorskip("pandas")

#: a batch on a loaded machine (Python workers start on the server), seconds
_BATCH_S = 180.0


def _counting_processor() -> Any:
    """Counts each key's rows in value state; outputs (user, n). Built here so that cloudpickle
    ships it by value (the server's workers do not import the tests)."""
    from pyspark.sql.streaming import StatefulProcessor

    class Counts(StatefulProcessor):  # type: ignore[misc]
        def init(self, handle: Any) -> None:
            self.count = handle.getValueState("count", "n long")

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
            import pandas as pd

            n = (self.count.get() or (0,))[0] + sum(len(f) for f in rows)
            self.count.update((n,))
            yield pd.DataFrame({"user": [key[0]], "n": [n]})

        def close(self) -> None:
            return None

    return Counts()


def _count(key: Any, frames: Iterator[Any], state: Any) -> Iterator[Any]:
    yield from count_rows(key, frames, state)


def _stream(spark: Any, source: Path) -> Any:
    return spark.readStream.schema("user string").json(str(source))


def _counts(source: Path, state: Path, local: Path) -> Any:
    """A function building, on a session, the counting query over ``source`` with the drop-in's
    explicit entry point, its state in ``state`` (operator uid ``counts``)."""
    from backend.spark.api import transform_with_state_in_pandas

    def build(spark: Any) -> Any:
        grouped = _stream(spark, source).groupBy("user")
        return transform_with_state_in_pandas(
            grouped, _counting_processor(), "user string, n long", "Update", "None",
            checkpoint_location=str(state), operator_uid="counts", local_dir=str(local),
        )  # fmt: skip

    return build


def _counted(spark: Any, source: Path) -> Any:
    """The counting query over ``source`` through ``applyInPandasWithState`` (routed or Spark's)."""
    return (
        _stream(spark, source)
        .groupBy("user")
        .applyInPandasWithState(_count, "user string, n long", "n long", "Update", "NoTimeout")
    )


def _input(source: Path, name: str, users: list[str]) -> None:
    publish(source / f"{name}.json", "".join(f'{{"user": "{u}"}}\n' for u in users))


def _run(out: Any, checkpoint: Path, table: str) -> Any:
    query = (
        out.writeStream.format("memory").queryName(table).outputMode("update")
        .option("checkpointLocation", str(checkpoint)).start()
    )  # fmt: skip
    query.processAllAvailable()
    return query


def _rows(spark: Any, table: str) -> list[tuple[Any, ...]]:
    return sorted(tuple(r) for r in spark.sql(f"select * from {table}").collect())


def _run_to_files(out: Any, checkpoint: Path, batches: Path) -> Any:
    """``out`` into a sink that survives a restart (the memory sink does not): a ``foreachBatch``
    function leaving each batch's rows in a file (``harness.file_sink``, run on the server)."""
    from tests.backend.spark.parity.harness import file_sink

    batches.mkdir(parents=True, exist_ok=True)
    query = (
        out.writeStream.outputMode("update").foreachBatch(file_sink(str(batches)))
        .option("checkpointLocation", str(checkpoint)).start()
    )  # fmt: skip
    query.processAllAvailable()
    return query


def _file_rows(batches: Path) -> list[tuple[Any, ...]]:
    return sorted(tuple(row) for path in batches.glob("*.json") for row in json.loads(path.read_text()))


@pytest.fixture
def routed(connect: Any, tmp_path: Path) -> Iterator[Any]:
    """Connect's GroupedData routed to the drop-in for the test."""
    from backend.spark.api import use_for_session

    restore = use_for_session(local_dir=str(tmp_path / "local"))
    try:
        yield connect
    finally:
        restore()


def test_routing_serves_the_three_methods_of_a_connect_session(routed: Any, tmp_path: Path) -> None:
    """Each routed method of the Connect GroupedData gives Spark's outputs, with the state in the
    drop-in's layout under the query's checkpoint location, and nothing in Spark's state store."""
    spark = routed
    source = tmp_path / "in"
    source.mkdir()
    _input(source, "a", ["a", "b", "a"])
    calls = {
        "pandas": lambda g: g.transformWithStateInPandas(
            _counting_processor(), "user string, n long", "Update", "None"
        ),
        "gs": lambda g: g.applyInPandasWithState(_count, "user string, n long", "n long", "Update", "NoTimeout"),
    }
    for name, call in calls.items():
        checkpoint = tmp_path / f"chk-{name}"
        query = _run(call(_stream(spark, source).groupBy("user")), checkpoint, f"routed_{name}")
        try:
            assert _rows(spark, f"routed_{name}") == [("a", 2), ("b", 1)]
        finally:
            query.stop()
        assert (checkpoint / "dstl" / "operators.json").exists()
        assert not (checkpoint / "state").exists(), "Spark's own operator ran: its state store is there"


def test_a_routed_row_api_processor_keeps_its_state_across_batches(routed: Any, tmp_path: Path) -> None:
    from pyspark.sql import Row
    from pyspark.sql.streaming import StatefulProcessor

    class RowCounts(StatefulProcessor):  # type: ignore[misc]
        def init(self, handle: Any) -> None:
            self.count = handle.getValueState("count", "n long")

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
            n = (self.count.get() or (0,))[0] + sum(1 for _ in rows)
            self.count.update((n,))
            yield Row(user=key[0], n=n)

        def close(self) -> None:
            return None

    spark = routed
    source = tmp_path / "in"
    source.mkdir()
    _input(source, "a", ["a", "b", "a"])
    grouped = _stream(spark, source).groupBy("user")
    out = grouped.transformWithState(RowCounts(), "user string, n long", "Update", "None")
    query = _run(out, tmp_path / "chk", "routed_rows")
    try:
        _input(source, "b", ["a"])
        query.processAllAvailable()
        assert _rows(spark, "routed_rows") == [("a", 2), ("a", 3), ("b", 1)]
    finally:
        query.stop()
    assert not (tmp_path / "chk" / "state").exists()


def test_a_routed_query_without_a_checkpoint_location_runs_on_the_drop_in_and_spark_runs_after_restore(
    connect: Any, tmp_path: Path
) -> None:
    """A routed query without a checkpoint location (Spark's tests start most queries so) runs on
    the drop-in, under a temporary location the client chooses and sets (the server runs on this
    host), never on Spark's operator; once routing is restored, Spark's own operator runs (its
    state store is in the checkpoint)."""
    import tempfile

    from backend.spark.api import use_for_session

    spark = connect
    source = tmp_path / "in"
    source.mkdir()
    _input(source, "a", ["a"])
    temporary = set(glob.glob(f"{tempfile.gettempdir()}/dstl-temporary-*"))
    restore = use_for_session(local_dir=str(tmp_path / "local"))
    try:
        out = _counted(spark, source)
        query = out.writeStream.format("memory").queryName("unplaced").outputMode("update").start()
        try:
            query.processAllAvailable()
            assert _rows(spark, "unplaced") == [("a", 1)]
        finally:
            query.stop()
        # the new temporary directories (another test process may make some too): the query's holds
        # the drop-in's checkpoints, and nothing of Spark's state store
        new = set(glob.glob(f"{tempfile.gettempdir()}/dstl-temporary-*")) - temporary
        chosen = [d for d in new if glob.glob(f"{d}/dstl/*/chk-*/_metadata")]
        assert chosen, f"no new temporary location holds the drop-in's state: {sorted(new)}"
        assert not any(Path(d, "state").exists() for d in chosen)
    finally:
        restore()
    out = _counted(spark, source)
    query = _run(out, tmp_path / "chk", "sparks_own")
    query.stop()
    assert (tmp_path / "chk" / "state").exists()
    assert not (tmp_path / "chk" / "dstl").exists()


def test_checkpoints_complete_on_the_server_and_a_new_client_resumes(
    connect: Any, connect_url: str, tmp_path: Path
) -> None:
    """The explicit entry point on Connect: the client's coordinators are closed after the first
    batch (the client holds no listener), yet the server completes every batch's checkpoint; then
    another client (a new session, as a restarted program has) starts the query again from its
    checkpoint and the counts go on from the state."""
    from backend.spark import driver

    source, state = tmp_path / "in", tmp_path / "state"
    source.mkdir()
    build = _counts(source, state, tmp_path / "local")

    batches = tmp_path / "batches"
    _input(source, "a", ["a", "b", "a"])
    query = _run_to_files(build(connect), tmp_path / "chk", batches)
    try:
        driver.forget_all()  # nothing of the client completes a checkpoint from here on
        _input(source, "b", ["a"])
        query.processAllAvailable()
        wait_until(lambda: (state / "chk-1" / "_metadata").exists(), "the server completed checkpoint 1", _BATCH_S)
        assert _file_rows(batches) == [("a", 2), ("a", 3), ("b", 1)]
    finally:
        query.stop()

    second = connect_client(connect_url)
    try:
        driver.forget_all()  # a new client process: no coordinator of the first one
        _input(source, "c", ["b", "a"])
        query = _run_to_files(build(second), tmp_path / "chk", batches)
        try:
            assert _file_rows(batches) == [("a", 2), ("a", 3), ("a", 4), ("b", 1), ("b", 2)]
            wait_until(lambda: (state / "chk-2" / "_metadata").exists(), "checkpoint 2", _BATCH_S)
        finally:
            query.stop()
    finally:
        from backend.spark import server_listener

        server_listener.remove_server_listeners(second)
        second.stop()


@pytest.mark.parametrize("entry", ["function", "routed"])
def test_a_foreach_batch_sink_runs_the_drop_in_on_connect(connect: Any, tmp_path: Path, entry: str) -> None:
    """On Connect a foreachBatch function evaluates the batch outside the query's jobs; the batch
    still runs on the drop-in, with its state, and the server completes its checkpoints (the
    tasks' records name the query)."""
    from backend.spark.api import apply_in_pandas_with_state, use_for_session
    from tests.backend.spark.parity.harness import file_sink

    source, batches = tmp_path / "in", tmp_path / "batches"
    source.mkdir()
    batches.mkdir()
    restore = use_for_session(local_dir=str(tmp_path / "local")) if entry == "routed" else None
    try:
        grouped = _stream(connect, source).groupBy("user")
        if restore is None:
            state = tmp_path / "state"
            out = apply_in_pandas_with_state(
                grouped, _count, "user string, n long", "n long", "Update", "NoTimeout",
                checkpoint_location=str(state), operator_uid="counts", local_dir=str(tmp_path / "local"),
            )  # fmt: skip
        else:
            state = tmp_path / "chk" / "dstl" / "*"  # the operator's directory, named at start
            out = grouped.applyInPandasWithState(_count, "user string, n long", "n long", "Update", "NoTimeout")
        _input(source, "a", ["a", "b", "a"])
        query = (
            out.writeStream.outputMode("update").foreachBatch(file_sink(str(batches)))
            .option("checkpointLocation", str(tmp_path / "chk")).start()
        )  # fmt: skip
        try:
            query.processAllAvailable()
            _input(source, "b", ["a"])
            query.processAllAvailable()
            assert _file_rows(batches) == [("a", 2), ("a", 3), ("b", 1)]
            completed = str(state / "chk-1" / "_metadata")
            wait_until(lambda: bool(glob.glob(completed)), "the server completed checkpoint 1", _BATCH_S)
        finally:
            query.stop()
    finally:
        if restore is not None:
            restore()


def test_a_client_is_refused_a_state_directory_whose_query_still_runs_on_the_server(
    connect: Any, connect_url: str, tmp_path: Path
) -> None:
    """A client that builds the query again on a state directory whose query still runs on the
    server (from another client's session, or from this session after its client process
    restarted) would recover the directory under the running query, deleting the chunks its tasks
    have uploaded and not yet named: it is refused, naming the location and the running query, and
    claims nothing (the running query's checkpoints go on being completed). Once the query is
    stopped, or its session released, the same build is accepted."""
    from backend.checkpointing.errors import DirectoryOwnedError
    from backend.spark import driver, server_listener

    source, state, batches = tmp_path / "in", tmp_path / "state", tmp_path / "batches"
    source.mkdir()
    build = _counts(source, state, tmp_path / "local")

    _input(source, "a", ["a", "b", "a"])
    query = _run_to_files(build(connect), tmp_path / "chk", batches)
    second = connect_client(connect_url)
    try:
        claims = sorted(p.name for p in (state / "_owner").iterdir())
        for client in (second, connect):  # another client; this one after a restart of its process
            driver.forget_all()
            with pytest.raises(DirectoryOwnedError) as refused:
                build(client)
            assert str(state) in str(refused.value) and str(query.id) in str(refused.value)
        assert sorted(p.name for p in (state / "_owner").iterdir()) == claims  # nobody was fenced
        _input(source, "b", ["a"])
        query.processAllAvailable()
        wait_until(lambda: (state / "chk-1" / "_metadata").exists(), "the server completed checkpoint 1", _BATCH_S)
        assert _file_rows(batches) == [("a", 2), ("a", 3), ("b", 1)]
        query.stop()
        driver.forget_all()
        _input(source, "c", ["b"])
        query = _run_to_files(build(second), tmp_path / "chk", batches)
        assert _file_rows(batches) == [("a", 2), ("a", 3), ("b", 1), ("b", 2)]
    finally:
        query.stop()
        server_listener.remove_server_listeners(second)
        second.stop()
    driver.forget_all()
    build(connect)  # the last run's session is released: nothing of it runs


@pytest.fixture(scope="module")
def server_without_the_package(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Connect server whose Python workers run an interpreter with pyspark, pandas and pyarrow
    (the test environment's packages, by a path file) but not this package (whose editable
    install a path file does not bring: its hook runs from the environment's own path file)."""
    import site
    import venv

    pytest.importorskip("grpc")
    where = tmp_path_factory.mktemp("workers-env")
    venv.EnvBuilder(with_pip=False).create(where)
    (target,) = where.glob("lib/python*/site-packages")
    (target / "test_packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    from tests.backend.spark.conftest import connect_server

    with connect_server("--workers-python", str(where / "bin" / "python")) as url:
        yield url


@pytest.mark.parametrize("entry", ["function", "routed"])
def test_a_server_whose_workers_lack_the_package_is_refused_naming_it(
    server_without_the_package: str, tmp_path: Path, entry: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both entry points refuse the operator when it is built, naming the missing module, and
    nothing runs: neither the drop-in nor Spark's own operator (no state anywhere)."""
    from backend.spark import driver
    from backend.spark.api import transform_with_state_in_pandas, use_for_session
    from dstl import ConfigurationError

    monkeypatch.setenv("SPARK_CONNECT_MODE_ENABLED", "1")  # as in the ``connect`` fixture
    client = connect_client(server_without_the_package)
    source, state = tmp_path / "in", tmp_path / "state"
    source.mkdir()
    _input(source, "a", ["a"])
    restore = use_for_session(local_dir=str(tmp_path / "local")) if entry == "routed" else None
    try:
        grouped = _stream(client, source).groupBy("user")
        with pytest.raises(ConfigurationError) as refused:
            if restore is None:
                transform_with_state_in_pandas(
                    grouped, _counting_processor(), "user string, n long", "Update", "None",
                    checkpoint_location=str(state), operator_uid="counts", local_dir=str(tmp_path / "local"),
                )  # fmt: skip
            else:
                grouped.transformWithStateInPandas(_counting_processor(), "user string, n long", "Update", "None")
        message = str(refused.value)
        assert "cannot import this package" in message and "No module named 'backend'" in message, message
        assert not client.streams.active
        assert not state.exists()
    finally:
        if restore is not None:
            restore()
        driver.forget_all()
        client.stop()
