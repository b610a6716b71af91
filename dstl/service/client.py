"""``RemoteChangelogStorage``: what a Python worker uses when its executor's changelog service writes the log.

It is a ``dstl.api.ChangelogStorage``, as a ``StateChangelogStorage`` is (mypy checks both
against the protocol where the Spark tasks pick one). Everything but writers is a local storage's
that never deletes log files (``owns_files=False``): reads and ``files`` (chunks, metadata: the
local storage's ``DfsFiles``) go straight to the DFS, as before. ``create_writer`` returns a
``RemoteChangelogWriter``, whose changes travel to the service over one Unix-socket connection
per storage (``connection``); the service's scheduler batches the changes of every worker into
one file per flush.

Why it is shaped so:

- *The writer's hot path is ``ChangelogWriter``'s:* ``append`` is an ``AppendBuffer``'s
  (``dstl.append_buffer``), which the connection's sender cuts and ships (``outbox``); control
  calls are requests on the connection, each behind the writer's buffered appends. A call waits
  for its reply and ``persist_durably``'s future for its handle as long as the service is alive;
  one that stops answering is declared lost by the connection's liveness rule (``liveness``),
  which fails them all at once.
- *A writer never reconnects* (its SQNs died with its connection): after the connection is lost
  every call of it raises. ``create_writer`` on a storage whose connection was lost connects
  again, starting a new service if needed (``launch``).
- *Start on demand.* The storage finds the service of its configuration, or starts one, and says
  HELLO (protocol version and config fingerprint) under the start lock.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import subprocess
import threading
from collections.abc import Iterator

from dstl.api import DfsFiles
from dstl.append_buffer import AppendBuffer, Appender, BufferStatus
from dstl.config import ChangelogConfig
from dstl.errors import ChangelogError, ConfigurationError, WriterClosedError
from dstl.metrics import ChangelogMetrics
from dstl.service.configjson import fingerprint
from dstl.service.connection import Connection, expect
from dstl.service.launch import START_TIMEOUT_MS, reach_service, service_socket_path
from dstl.service.liveness import Liveness
from dstl.service.protocol import (
    Ack,
    CloseWriter,
    Confirm,
    Expect,
    LastSqn,
    Message,
    Persist,
    Persisted,
    Release,
    Sqn,
    Truncate,
)
from dstl.storage import StateChangelogStorage
from dstl.types import ChangelogHandle, KeyGroupRange, Note, NotedHandle, SequenceNumber

__all__ = ["RemoteChangelogStorage", "RemoteChangelogWriter"]

_log = logging.getLogger(__name__)
#: the statuses in which nothing of a writer is open on the service any more
_SHUT = frozenset((BufferStatus.CLOSED, BufferStatus.FENCED, BufferStatus.LOST))


class RemoteChangelogWriter(Appender):
    """A ``dstl.api.StateChangelogWriter`` whose changes go to the changelog service (module doc).

    Differences from ``ChangelogWriter``: ``persist_durably`` reports a bad ``after`` through its
    future, not by raising; after the connection is lost every call raises
    ``ServiceUnavailableError``, after a newer attempt took the writer over ``FencedWriterError``.
    Its buffer's status says which (``dstl.append_buffer``); ``append`` and ``append_many``
    (``Appender``: closures its buffer gives it) extend the buffer, as a local writer's do."""

    def __init__(self, conn: Connection, number: int, log_id: str, key_group_range: KeyGroupRange) -> None:
        self.number = number
        self.log_id = log_id
        self.key_group_range = key_group_range
        self._conn = conn
        #: the changes not yet shipped; the connection's sender drives it (``outbox``)
        self.buffer = AppendBuffer(
            self,
            log_id,
            key_group_range,
            wait=lambda: conn.outbox.wait_drained(self),
            wake=conn.outbox.wake,
            look=lambda estimate: conn.outbox.look(self, estimate),
        )
        #: appends that waited for the sender (client-side backpressure)
        self.backpressure_waits = 0

    @property
    def closed(self) -> bool:
        """True once closed, fenced or its service lost: nothing of it is open on the service."""
        return self.buffer.status in _SHUT

    # -- control calls ----------------------------------------------------------------------

    def _usable(self, op: str) -> None:
        if self.closed:
            self.buffer.check(op)

    def last_appended_sqn(self) -> SequenceNumber:
        """Close the active changeset (on the service); every change appended so far is <= the result."""
        self._usable("last_appended_sqn")
        sqn: SequenceNumber = self._conn.call(
            LastSqn(self.number), "last_appended_sqn", self, expect(Sqn, lambda m: SequenceNumber(m.sqn))
        )
        return sqn

    def persist_durably(self, after: int, note: Note | None = None) -> concurrent.futures.Future[ChangelogHandle]:
        """Make every change with SQN > ``after`` durable; the future yields their handle once the
        service replies (no deadline of its own: a lost connection, the liveness rule's verdict on
        a service that stopped answering included, fails it at once)."""
        self._usable("persist_durably")
        _, future = self._conn.submit(
            Persist(self.number, after, note),
            "persist_durably",
            self,
            expect(Persisted, lambda m: m.handle),
            callback_thread=True,
        )
        return future

    def _control(self, op: str, message: Message) -> None:
        if self.buffer.status is BufferStatus.CLOSED:
            return  # as ChangelogWriter: a closed writer holds nothing any more
        self._usable(op)
        self._conn.call(message, op, self, expect(Ack))

    def truncate(self, before: int) -> None:
        self._control("truncate", Truncate(self.number, before))

    def expect_persist(self) -> None:
        """Tell the service this writer will persist soon, so that its flushes may wait for it."""
        self._control("expect_persist", Expect(self.number))

    @property
    def usable(self) -> bool:
        """False once the writer can never persist again: closed, fenced, or its service lost."""
        return not self.closed

    def confirm(self, handle: ChangelogHandle) -> None:
        self._control("confirm", Confirm(self.number, handle))

    def release(self, handle: ChangelogHandle) -> None:
        self._control("release", Release(self.number, handle))

    def close(self) -> None:
        """Drop the buffered changes and close the writer on the service (best effort: a service
        that is gone closed it already)."""
        conn = self._conn
        if not conn.discard(self):
            return
        try:
            conn.call(CloseWriter(self.number), "close", None, expect(Ack))
        except ChangelogError as exc:
            _log.info("closing changelog writer %s on %s: %s", self.log_id, conn.socket_path, exc)


class RemoteChangelogStorage:
    """The storage of a worker whose writers live in the executor's changelog service (module doc).

    ``socket_dir``: where the service's socket lives (default ``<tmp>/dstl-svc-<uid>``);
    ``start``: start a service if none listens (else ``ServiceUnavailableError``); ``local``: the
    storage that serves reads and files (default: a new one with ``owns_files=False``, closed with
    this one); ``idle_timeout_ms``: passed to a service this storage starts; ``start_timeout_ms``:
    how long a service this storage starts may take to be ready; ``liveness``: how long the
    service may be silent (default ``Liveness.of(config)``, from ``dfs_timeout_ms``)."""

    def __init__(
        self,
        config: ChangelogConfig,
        *,
        socket_dir: str | os.PathLike[str] | None = None,
        start: bool = True,
        local: StateChangelogStorage | None = None,
        idle_timeout_ms: int = 60_000,
        start_timeout_ms: int = START_TIMEOUT_MS,
        liveness: Liveness | None = None,
    ) -> None:
        if local is not None and local.config.base_path != config.base_path:
            raise ConfigurationError(
                f"the local storage's base path {local.config.base_path} is not {config.base_path}"
            )
        self.config = config
        self.socket_path = service_socket_path(config, socket_dir)
        self._start = start
        self._idle_timeout_ms = idle_timeout_ms
        self._start_timeout_ms = start_timeout_ms
        self._liveness = liveness
        self._lock = threading.Lock()
        self._closed = False
        #: the service process this storage started (None if it found one running)
        self.service_process: subprocess.Popen[bytes] | None = None
        self._local = local if local is not None else StateChangelogStorage(config, owns_files=False)
        self._owns_local = local is None
        try:
            self._conn = self._connect()
        except BaseException:
            if self._owns_local:
                self._local.close()
            raise

    def _connect(self) -> Connection:
        reached = reach_service(
            self.config,
            self.socket_path,
            start=self._start,
            idle_timeout_ms=self._idle_timeout_ms,
            start_timeout_ms=self._start_timeout_ms,
            started=self._started,
        )
        with reached as sock:
            conn = Connection(sock, self.socket_path, self.config, self._liveness)
            conn.hello(fingerprint(self.config))
        return conn

    def _started(self, process: subprocess.Popen[bytes]) -> None:
        self.service_process = process

    # -- the service ------------------------------------------------------------------------

    @property
    def service_epoch(self) -> int:
        """The epoch of the service this storage is connected to (one per service start)."""
        return self._conn.epoch

    @property
    def service_pid(self) -> int:
        return self._conn.pid

    @property
    def lost(self) -> str | None:
        """Why the current connection to the service ended (None while it is up)."""
        return self._conn.lost

    @property
    def liveness_probes(self) -> int:
        """How many liveness probes the service answered on the current connection (``liveness``)."""
        return self._conn.probes_answered

    @property
    def owns_files(self) -> bool:
        """Always False: the service's writers never delete log files, nor does the local storage."""
        return False

    @property
    def metrics(self) -> ChangelogMetrics:
        """The local storage's metrics (reads, files); uploads are counted by the service."""
        return self._local.metrics

    def create_writer(self, operator_id: str, key_group_range: KeyGroupRange) -> RemoteChangelogWriter:
        """A writer on the service; a newer writer of the same operator and range fences older ones."""
        with self._lock:
            if self._closed:
                raise WriterClosedError("the changelog storage is closed: cannot create a writer")
            if self._conn.lost is not None:  # its writers stay dead; new ones get a new connection
                self._conn.close()
                self._conn = self._connect()
            conn = self._conn
        opened = conn.open_writer(operator_id, key_group_range)
        writer = RemoteChangelogWriter(conn, opened.writer, opened.log_id, key_group_range)
        conn.register(writer)
        return writer

    # -- everything else: the local storage -----------------------------------------------------

    def read(self, handle: ChangelogHandle, key_groups: KeyGroupRange | None = None) -> Iterator[tuple[int, bytes]]:
        return self._local.read(handle, key_groups)

    @property
    def files(self) -> DfsFiles:
        """The local storage's files (reads and writes go straight to the DFS)."""
        return self._local.files

    def read_notes(self, path: str, timeout: float | None = None) -> list[NotedHandle]:
        return self._local.read_notes(path, timeout)

    def flush(self, timeout: float | None = None) -> None:
        """Wait for the local storage's background deletions (uploads are the service's)."""
        self._local.flush(timeout)

    def close(self, timeout: float | None = 60.0) -> None:
        """Close the connection (the service closes its writers) and the local storage if ours."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._conn.close()
        if self._owns_local:
            self._local.close(timeout)

    def __enter__(self) -> RemoteChangelogStorage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
