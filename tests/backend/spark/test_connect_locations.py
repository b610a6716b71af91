"""Where a Connect query without a checkpoint location keeps its checkpoint, when the server does
not run on the client's host: under the routing's ``checkpoint_root`` (both reach it), else
refused with an error naming the options; a read of a routed query's state by Spark's names from
a Connect client is served by the drop-in's sources."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from backend.spark.routing import _connect_temporary
from dstl import ConfigurationError


def _session(host: str) -> SimpleNamespace:
    """What ``_connect_temporary`` reads of a Connect session: its client's server host."""
    return SimpleNamespace(client=SimpleNamespace(host=host))


def test_a_server_on_another_host_gets_a_location_under_the_checkpoint_root() -> None:
    chosen = _connect_temporary(_session("spark-connect.example.com"), "s3://bucket/states/")
    assert chosen.startswith("s3://bucket/states/temporary-")


def test_a_server_on_another_host_without_a_checkpoint_root_is_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"checkpointLocation.*checkpoint_root"):
        _connect_temporary(_session("spark-connect.example.com"), None)


def _state_reader(checkpoint: str, directory: str) -> Any:
    """A ``foreachBatch`` function (it runs on the server, pickled by value) that reads the query's
    state by Spark's name from batch 1 on and leaves what it read in ``<directory>/<batch>.json``."""

    def read(batch_df: Any, batch_id: int) -> None:
        import json
        import os

        batch_df.collect()
        if batch_id == 0:
            return
        state = batch_df.sparkSession.read.format("statestore").load(checkpoint)
        rows = sorted([row["key"][0], row["value"][0][0]] for row in state.collect())
        with open(os.path.join(directory, f".{batch_id}.tmp"), "w") as out:
            json.dump(rows, out)
        os.replace(os.path.join(directory, f".{batch_id}.tmp"), os.path.join(directory, f"{batch_id}.json"))

    return read


@pytest.mark.spark
def test_sparks_state_source_reads_a_routed_connect_query_from_the_client_and_from_foreach_batch(
    connect: Any, tmp_path: Path
) -> None:
    """``format("statestore")`` on a routed query's checkpoint is served by the drop-in's source on
    Connect too: from the client after the query ran, and from the query's ``foreachBatch`` function
    on the server, where it reads the last batch before the running one (as Spark's source reads
    the last batch of the commit log)."""
    from backend.spark.api import use_for_session
    from tests.backend.spark.test_connect import _counted, _input

    source, reads, checkpoint = tmp_path / "in", tmp_path / "reads", str(tmp_path / "chk")
    source.mkdir()
    reads.mkdir()
    _input(source, "a", ["a", "b", "a"])
    restore = use_for_session(local_dir=str(tmp_path / "local"))
    try:
        out = _counted(connect, source)
        query = (
            out.writeStream.outputMode("update").foreachBatch(_state_reader(checkpoint, str(reads)))
            .option("checkpointLocation", checkpoint).start()
        )  # fmt: skip
        try:
            query.processAllAvailable()
            _input(source, "b", ["a", "c"])
            query.processAllAvailable()
        finally:
            query.stop()
        # in batch 1's function: the state after batch 0
        assert json.loads((reads / "1.json").read_text()) == [["a", 2], ["b", 1]]
        read = connect.read.format("statestore").load(checkpoint)
        assert sorted((row["key"][0], row["value"][0][0]) for row in read.collect()) == [("a", 3), ("b", 1), ("c", 1)]
    finally:
        restore()
