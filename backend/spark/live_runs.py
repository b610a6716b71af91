"""Never two writers on one state directory under Spark Connect: a client's run is refused a
directory whose query still runs on the server.

Why: a run's start-up (``DriverCoordinator``) claims the state directory and recovers it, deleting
what no checkpoint or pending handle names. Under a running query that deletes the chunks its tasks
uploaded and have not named in a handle yet (a materialization in flight), and the new claim
fences the running query's completer: its later checkpoints are never completed, and a restore
from its handles may miss files. On a classic session this does not happen by accident: the query
runs in the driver, a rebuild in the same driver reuses its coordinator (no second start-up), and
a new driver process comes only once the old one, and its queries, are gone. Under Connect the
query outlives its client: a client that restarts (a new process, a new session) or another
client builds the query again while it still runs on the server, and the start-up happens
before Spark's ``start`` could say anything.

How: a Connect client's run records in its claim the Connect session it runs in
(``Ownership.details``: the session's id and user). Before a new client's run claims the
directory, it reads the newest run's claim (``ownership.last_run``) and the query the directory is
bound to (``ownership.bound_identity``: the Spark query id its tasks bound it to); if that query is
active in that session (this session's ``spark.streams``; another session's through a client
attached to it by its id, as Spark's server-side listener process attaches to its session), the
start-up is refused with ``DirectoryOwnedError`` naming the location, the query (id, run id, name)
and the session, before anything is claimed or deleted. A session that is gone (released, or of a
server restarted since) runs nothing. A stopped query is not active: once ``stop()`` returned, the
same build is accepted.

Limits: the query is looked for on the server this client talks to. A query started against the
same storage from another Connect server, or from a classic driver elsewhere, is not seen: that
case keeps the ownership protocol's price (the later run takes the directory over and fences the
earlier one, whose checkpoints then fail naming it).
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from backend.checkpointing.errors import DirectoryOwnedError
from backend.checkpointing.ownership import bound_identity, last_run
from backend.spark.connect import is_connect
from dstl.api import DfsFiles

__all__ = ["claim_details", "refuse_if_running"]

_log = logging.getLogger(__name__)

#: the keys of a Connect run's claim details (``Ownership.details``)
SESSION = "connect_session"
USER = "connect_user"


def claim_details(spark: Any) -> dict[str, str]:
    """What a run's claim records of ``spark``'s session: on Connect, its session id and user."""
    if not is_connect(spark):
        return {}
    return {SESSION: str(spark.session_id), USER: str(spark.client._user_id or "")}


def refuse_if_running(spark: Any, files: DfsFiles, where: str) -> None:
    """``DirectoryOwnedError`` if the query bound to the directory of ``files`` runs on
    ``spark``'s Connect server in the session of the directory's newest run (module docstring).
    Reads only; nothing to check on a classic session."""
    if not is_connect(spark):
        return
    previous = last_run(files)
    details = (previous or {}).get("details") or {}
    session = details.get(SESSION) if isinstance(details, dict) else None
    query_id = bound_identity(files)
    if not session or not query_id:
        return  # no Connect run before, or no batch of it ran: no task of it writes here
    running = _active_query(spark, str(session), str(details.get(USER) or ""), query_id)
    if running is None:
        return
    ours = "this session" if str(session) == str(spark.session_id) else f"the Connect session {session}"
    raise DirectoryOwnedError(
        f"the state directory {where} is in use by streaming query {running['id']} (run {running['runId']}"
        f"{', name ' + repr(running['name']) if running['name'] else ''}), still running on the Spark Connect "
        f"server in {ours}: a second run would delete the chunks its tasks have not named yet and fence "
        "it. Stop that query first (its StreamingQuery.stop(), from a client of that session: "
        f"SparkSession.builder.remote('sc://<host>:<port>/;session_id={session}')), then start this one; "
        "nothing was claimed or deleted"
    )


def _active_query(spark: Any, session: str, user: str, query_id: str) -> dict[str, Any] | None:
    """The query ``query_id`` if it is active in Connect session ``session`` of ``spark``'s server."""
    if session == str(spark.session_id):
        return _find(spark, query_id)
    from pyspark.sql.connect.session import SparkSession

    builder = copy.copy(spark.client._builder)  # the same server, channel options and token
    builder._params = {**builder._params, "session_id": session}
    if user:
        builder._params["user_id"] = user
    attached = SparkSession(connection=builder)
    attached.release_session_on_close = False  # the session is the running query's: never released here
    try:
        return _find(attached, query_id)
    except Exception as exc:  # a session released or unknown to the server runs nothing
        if "SESSION_CLOSED" in str(exc) or "SESSION_NOT_FOUND" in str(exc):
            _log.info("Connect session %s of the previous run is gone: %s", session, exc)
            return None
        raise
    finally:
        attached.client.close()


def _find(session: Any, query_id: str) -> dict[str, Any] | None:
    for query in session.streams.active:
        if str(query.id) == query_id:
            return {"id": str(query.id), "runId": str(query.runId), "name": query.name}
    return None
