"""Checkpoint completion on the Spark Connect server: the driver's listener, without the client.

Why: on a classic session the driver process is the user's, and its ``StreamingQueryListener``
completes checkpoint ``b`` when Spark reports batch ``b`` (``backend.spark.driver``). A Connect
client is not the driver: pyspark's Connect client delivers listener events to the client, over a
stream that ends when the client disconnects (and which pyspark closes on events it does not know,
such as the metrics of a Python data source's accumulators), while the query goes on running on
the server. So the checkpoints of a Connect query are completed on the server, by a listener the
server runs in a Python process of its own (Spark Connect's server-side Python listener, the
``add_listener`` command with a pickled listener: what pyspark 3.5's client registered). It holds
no variable of the client: it is shipped with what it needs, the operators' configs, the number
of checkpoints to retain, and the id of the client's run.

**Under whose claim.** The run's start-up happens in the client, as on a classic driver, before
the query starts: its ``DriverCoordinator`` claims the state directory (an epoch,
``backend.checkpointing.ownership``), recovers it (deletes what no checkpoint or pending handle
names) and checks the operators. Recovering again on the server while the query runs would delete
the chunks of materializations still uploading; so the server's coordinator *follows* that claim
(``CheckpointCoordinator.follow``): it reads the retained checkpoints, deletes nothing at start,
and completes, subsumes and cleans pending files as the classic listener does, fenced exactly when
the client's run is.

**Disconnects and restarts.** Completion no longer needs the client: a client that disconnects
leaves its query and this listener running on the server (until Spark ends the session). A client
that builds the query again while it still runs is refused (``backend.spark.live_runs``); once it
was stopped, a client that starts it again (a new process, a new session) makes a new run: its
claim fences the old listener, whose next completion fails (``OwnershipLostError``) and writes
nothing, and which from then on does nothing (``driver.complete_as_follower`` keeps one follower
per run, whose registration writes nothing and checks the run's ownership first). The new run's
recovery keeps the pending handles after the latest checkpoint, from which the next batch
restores. A batch whose checkpoint was not completed (the listener was fenced or gone) loses
nothing: the next batch's tasks restore from its pending handles, as after a driver's crash on a
classic session. A checkpoint is never completed twice (``complete_batch`` skips a batch at or
before the latest checkpoint, and ids only grow).

One listener per state directory and session: registering the directory again (an operator
added, a restart at another parallelism) replaces it; ``remove_server_listeners`` removes a
session's (tests; Spark removes them with the session).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from backend.spark.config import OperatorConfig
from backend.spark.driver import DriverCoordinator, complete_as_follower

__all__ = ["complete_on_server", "remove_server_listeners"]

_log = logging.getLogger(__name__)
#: (session id, state directory) -> the id of its server-side listener (in the client)
_REGISTERED: dict[tuple[str, str], str] = {}
_LOCK = threading.Lock()


def complete_on_server(spark: Any, coordinator: DriverCoordinator) -> None:
    """Register (or replace) the server-side listener completing ``coordinator``'s checkpoints."""
    configs = list(coordinator.configs.values())
    listener = _completer_class()(configs, coordinator.num_retained, coordinator.ownership.run)
    job_dir = configs[0].job_dir
    key = (str(spark.session_id), job_dir)
    with _LOCK:
        replaced = _REGISTERED.pop(key, None)
    # The old listener goes first: two listeners of one run, each with its own registry in a
    # process of its own, would both complete a batch whose event reached both, and each subsume
    # by what it knows. A batch whose event falls between the two calls is not completed, which
    # costs nothing: the next batch restores from its pending handles, and the next completion
    # covers it.
    if replaced is not None:
        _listener_command(spark, "remove_listener", replaced)
    _listener_command(spark, "add_listener", listener._id, listener)
    with _LOCK:
        _REGISTERED[key] = listener._id


def remove_server_listeners(spark: Any) -> None:
    """Remove the server-side listeners this client registered on ``spark``'s session."""
    session = str(spark.session_id)
    with _LOCK:
        ids = [(key, lid) for key, lid in _REGISTERED.items() if key[0] == session]
        for key, _ in ids:
            del _REGISTERED[key]
    for _, listener_id in ids:
        try:
            _listener_command(spark, "remove_listener", listener_id)
        except Exception as exc:  # a session already closed: its listeners went with it
            _log.info("server-side listener %s not removed: %s", listener_id, exc)


def _listener_command(spark: Any, kind: str, listener_id: str, listener: Any = None) -> None:
    """Spark Connect's ``add_listener`` / ``remove_listener`` command for a Python listener."""
    from pyspark.serializers import CloudPickleSerializer
    from pyspark.sql.connect import proto
    from pyspark.sql.connect.utils import get_python_ver

    cmd = proto.StreamingQueryManagerCommand()
    target = getattr(cmd, kind)
    target.id = listener_id
    if listener is not None:
        payload = proto.PythonUDF()
        payload.command = CloudPickleSerializer().dumps(listener)  # type: ignore[no-untyped-call]
        payload.python_ver = get_python_ver()
        target.python_listener_payload.CopyFrom(payload)
    spark.streams._execute_streaming_query_manager_cmd(cmd)


def _completer_class() -> type:
    """The listener class, built on first use (so that importing this package never imports
    pyspark); cloudpickle ships it by value, its module's functions by reference."""
    from pyspark.sql.streaming.listener import StreamingQueryListener

    class ServerCompleter(StreamingQueryListener):
        def __init__(self, configs: list[OperatorConfig], num_retained: int, run: str) -> None:
            self.configs, self.num_retained, self.run = configs, num_retained, run
            self._init_listener_id()

        def onQueryStarted(self, event: Any) -> None:
            return None

        def onQueryProgress(self, event: Any) -> None:
            progress = event.progress
            complete_as_follower(self.configs, self.num_retained, self.run, int(progress.batchId), str(progress.id))

        def onQueryIdle(self, event: Any) -> None:
            return None

        def onQueryTerminated(self, event: Any) -> None:
            return None

    return ServerCompleter
