"""``ChangelogService``: one ``StateChangelogStorage`` per executor, reachable over a Unix socket.

FLIP-158 batches the changes of every writer of a TaskManager into one file per flush. Under
Spark the writers of an executor live in several Python worker processes, so the storage moves
into a process of its own and the workers stream to it. The service is a transport around the
ordinary storage (its writers, scheduler, hedging and file registry), not a second implementation.

Why it is shaped so:

- *Accepting is all the service does itself.* Each connection is served by a
  ``handler.ConnectionHandler`` on threads of its own (its order, backpressure and replies are
  explained there); the service keeps the storage, the set of connections and who owns what.
  It serves at most ``max_connections`` at once (liveness probes count): the accept thread
  answers one more with an ``ERROR`` of request id 0 and closes it, starting no thread for it.
- *Fencing.* A retried Spark task opens the same operator and key-group range while its
  predecessor may still run (a zombie). ``OPEN_WRITER`` for a pair another writer holds closes
  the older writer; every later request naming it fails with ``FencedWriterError``. This only
  stops a stale writer of this service from holding resources and writing: exactly-once does not
  rest on it (a zombie on another executor, or of another service, is not fenced; the driver
  commits the handles of one attempt).
- *Epochs.* Each start takes the next integer from ``<socket>.epoch`` under the start lock; log
  ids carry it, so a restarted service is recognisable in them (their uuid alone makes them unique).
- *Idle exit.* With no connection and nothing uploading for ``idle_timeout_ms``, the service
  takes the start lock, stops listening, unlinks its socket, flushes and closes the storage.
  Clients connect and say ``HELLO`` under that lock, so a client never reaches a service that
  is about to exit.

The socket's name and the files next to it (``<socket>.lock``, ``.epoch``, ``.log``) are
``launch``'s, shared with the client.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import selectors
import socket
import stat
import threading
import time

from dstl.config import ChangelogConfig
from dstl.errors import ConfigurationError, ServiceUnavailableError, StorageClosedError
from dstl.paths import check_name
from dstl.service.configjson import fingerprint
from dstl.service.handler import ConnectionHandler, Slot
from dstl.service.launch import next_epoch, prepare_socket_dir, start_lock, try_connect
from dstl.service.protocol import JOIN_S, Error, OpenWriter, encode
from dstl.storage import StateChangelogStorage
from dstl.uploaders import Uploader

__all__ = ["ChangelogService"]

_log = logging.getLogger(__name__)

#: how long the service waits for the start lock before exiting idle (a client holds it briefly)
LOCK_WAIT_S = 30.0
#: how often an idle service with uploads still running looks again
_IDLE_POLL_S = 0.05
#: defaults of the bounds on what clients may make the service hold (``ChangelogService``)
MAX_CONNECTIONS = 256
HELLO_TIMEOUT_S = 10.0
MAX_QUEUED_REPLIES = 4096


class ChangelogService:
    """The changelog service of one socket path and configuration (see module doc).

    ``start()`` binds and returns once listening; ``serve_forever()`` also waits until the service
    stops (``close()``, a signal handled by ``__main__``, or the idle timeout; ``None``: never).
    ``epoch=None`` takes the next epoch itself under the start lock (a client starting a service
    passes the one it took). ``owns_files`` goes to the storage: False, the default, never deletes
    a log file (under Spark the driver's registry decides which files die). ``max_connections``,
    ``hello_timeout_s`` and ``max_queued_replies`` bound what clients may make it hold (module
    doc, ``handler``). ``close_error``: why the final flush or close failed, if it did."""

    def __init__(
        self,
        config: ChangelogConfig,
        socket_path: str | os.PathLike[str],
        *,
        idle_timeout_ms: int | None = 60_000,
        epoch: int | None = None,
        uploader: Uploader | None = None,
        owns_files: bool = False,
        max_connections: int = MAX_CONNECTIONS,
        hello_timeout_s: float = HELLO_TIMEOUT_S,
        max_queued_replies: int = MAX_QUEUED_REPLIES,
    ) -> None:
        if idle_timeout_ms is not None and idle_timeout_ms < 0:
            raise ConfigurationError(f"idle_timeout_ms must not be negative, got {idle_timeout_ms}")
        if max_connections < 1 or max_queued_replies < 1 or not hello_timeout_s > 0:
            raise ConfigurationError(
                f"max_connections ({max_connections}), max_queued_replies ({max_queued_replies}) and "
                f"hello_timeout_s ({hello_timeout_s}) must be positive"
            )
        self.max_connections = max_connections
        self.hello_timeout_s = hello_timeout_s
        self.max_queued_replies = max_queued_replies
        self.close_error: BaseException | None = None
        self.config = config
        self.socket_path = os.fspath(socket_path)
        self.fingerprint = fingerprint(config)
        self.epoch = epoch if epoch is not None else 0
        self._take_epoch = epoch is None
        self._idle_timeout_ms = idle_timeout_ms
        self._uploader = uploader
        self._owns_files = owns_files
        self.storage: StateChangelogStorage | None = None
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._connections: set[ConnectionHandler] = set()
        self._owners: dict[tuple[str, int, int], Slot] = {}
        self._connection_numbers = itertools.count(1)
        self._writer_numbers = itertools.count(1)
        self._idle_since = time.monotonic()
        self._closing = False
        self._closed = False
        self._stopped = threading.Event()
        self._listener: socket.socket | None = None
        self._identity: tuple[int, int] | None = None
        self._wake: tuple[int, int] | None = None  # wakes the accept loop; created by start()
        self._accept_thread: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Bind the socket and start accepting; returns once listening."""
        if self.storage is not None:
            raise ConfigurationError(f"changelog service {self.socket_path} was started already")
        prepare_socket_dir(self.socket_path)
        with start_lock(self.socket_path, LOCK_WAIT_S) if self._take_epoch else contextlib.nullcontext():
            if self._take_epoch:
                self.epoch = next_epoch(self.socket_path)
            if (probe := try_connect(self.socket_path, None)) is not None:
                probe.close()
                raise ConfigurationError(f"a changelog service already listens on {self.socket_path}")
            with contextlib.suppress(FileNotFoundError):
                if not stat.S_ISSOCK(os.lstat(self.socket_path).st_mode):
                    raise ConfigurationError(f"{self.socket_path} exists and is not a socket")
                os.unlink(self.socket_path)  # a stale socket of a service that died
            self.storage = StateChangelogStorage(self.config, uploader=self._uploader, owns_files=self._owns_files)
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                listener.bind(self.socket_path)
                os.chmod(self.socket_path, 0o600)
                listener.listen(128)
            except OSError:
                listener.close()
                self.storage.close()
                raise
            st = os.lstat(self.socket_path)
            self._identity = (st.st_dev, st.st_ino)
            self._listener = listener
            self._wake = os.pipe()
        self._accept_thread = threading.Thread(target=self._accept_loop, name="dstl-svc-accept", daemon=True)
        self._accept_thread.start()
        if self._idle_timeout_ms is not None:
            threading.Thread(target=self._watch_idle, name="dstl-svc-idle", daemon=True).start()
        _log.info(
            "changelog service listening on %s (epoch %d, pid %d, base path %s)",
            self.socket_path,
            self.epoch,
            os.getpid(),
            self.config.base_path,
        )

    def serve_forever(self) -> None:
        """Start if not started, then wait until the service stops."""
        if self.storage is None:
            self.start()
        self._stopped.wait()

    def close(self) -> None:
        """Stop listening, drop every connection (closing its writers), flush and close the storage."""
        with self._lock:
            if self._closed:
                return
            self._closed = self._closing = True
            connections = list(self._connections)
            self._changed.notify_all()
        try:
            self._stop_listening()
            for conn in connections:
                conn.shutdown()
            if self.storage is not None:
                self.storage.close()  # also ends appends and persists waiting for capacity
            for conn in connections:
                conn.join(JOIN_S)
        except BaseException as exc:
            self.close_error = exc
            _log.error("changelog service %s: closing failed: %r", self.socket_path, exc)
            raise
        finally:
            for fd in self._wake or ():
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._stopped.set()
            _log.info("changelog service %s stopped", self.socket_path)

    def __enter__(self) -> ChangelogService:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _close_listener_if_idle(self) -> bool:
        with self._lock:
            if self._connections or self._closing:
                return False
            self._closing = True  # connections accepted from now on are closed at once
        self._stop_listening()
        return True

    def _stop_listening(self) -> None:
        listener, self._listener = self._listener, None
        if listener is None:
            return
        if self._wake is not None:
            with contextlib.suppress(OSError):
                os.write(self._wake[1], b"x")
        if self._accept_thread is not None and self._accept_thread is not threading.current_thread():
            self._accept_thread.join(JOIN_S)
        listener.close()
        try:
            st = os.lstat(self.socket_path)
            if (st.st_dev, st.st_ino) == self._identity:  # never a newer service's socket
                os.unlink(self.socket_path)
        except FileNotFoundError:
            pass

    # -- connections ------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        listener, wake = self._listener, self._wake
        assert listener is not None and wake is not None
        with selectors.DefaultSelector() as selector:
            selector.register(listener, selectors.EVENT_READ)
            selector.register(wake[0], selectors.EVENT_READ)
            while True:
                for key, _ in selector.select():
                    if key.fileobj is not listener:
                        return
                    try:
                        sock, _ = listener.accept()
                    except OSError as exc:
                        if exc.errno in (errno.EBADF, errno.EINVAL):
                            return
                        _log.warning("accept on %s failed: %s", self.socket_path, exc)
                        time.sleep(0.1)  # e.g. out of file descriptors: do not spin
                        continue
                    self._admit(sock)

    def _admit(self, sock: socket.socket) -> None:
        with self._lock:
            if self._closing:
                sock.close()
                return
            full = len(self._connections) >= self.max_connections
            if not full:
                conn = ConnectionHandler(sock, next(self._connection_numbers), self)
                self._connections.add(conn)
                self._changed.notify_all()
        if full:
            self._refuse(sock)
        else:
            conn.start()

    def _refuse(self, sock: socket.socket) -> None:
        """One connection too many: say why (request id 0) without waiting, and close it."""
        why = f"the changelog service on {self.socket_path} serves at most {self.max_connections} connections"
        _log.warning("refusing a connection: %s", why)
        with contextlib.suppress(OSError):
            sock.send(encode(Error("ServiceUnavailableError", why), 0), socket.MSG_DONTWAIT)
        sock.close()

    def disconnected(self, conn: ConnectionHandler, slots: list[Slot]) -> None:
        """The connection ended (its thread then closes ``slots``, the writers it held): forget it."""
        with self._lock:
            self._connections.discard(conn)
            for slot in slots:
                self._release_locked(slot)
            if not self._connections:
                self._idle_since = time.monotonic()
            self._changed.notify_all()

    # -- who owns which writer -------------------------------------------------------------

    def open_writer(self, conn: ConnectionHandler, message: OpenWriter) -> Slot:
        """A new writer for ``conn`` (on its thread); the writer that held the same operator and
        key-group range until now, if any, is fenced and closed."""
        operator_id, rng = message.operator_id, message.key_group_range
        check_name(operator_id)  # the name a client sent, before it becomes a key and a log id
        key = (operator_id, rng.start, rng.end)
        with self._lock:
            if self._closing or self.storage is None:
                raise StorageClosedError(f"the changelog service on {self.socket_path} is shutting down")
            # the epoch in the log id: log ids never repeat across restarts of the service
            writer = self.storage.create_writer(f"{operator_id}.e{self.epoch}", rng)
            slot = Slot(next(self._writer_numbers), writer, key)
            old = self._owners.get(key)
            self._owners[key] = slot
            if old is not None:
                old.fenced = f"writer {old.writer.log_id} was taken over by a newer attempt (writer {writer.log_id})"
        conn.writers[slot.number] = slot
        if old is not None:
            _log.info("%s: %s", conn.name, old.fenced)
            old.writer.close()
        return slot

    def release_slot(self, slot: Slot) -> None:
        """The writer was closed by its connection: no longer the owner of its operator and range."""
        with self._lock:
            self._release_locked(slot)

    def _release_locked(self, slot: Slot) -> None:
        if self._owners.get(slot.key) is slot:  # not if a newer writer took its place
            del self._owners[slot.key]

    # -- idle exit ----------------------------------------------------------------------------

    def _uploading(self) -> bool:
        storage = self.storage
        if storage is None:
            return False
        m = storage.metrics
        return bool(m.bytes_in_flight or m.bytes_encoded or m.upload_queue_size)

    def _watch_idle(self) -> None:
        assert self._idle_timeout_ms is not None
        timeout = self._idle_timeout_ms / 1000
        while True:
            with self._changed:
                while True:
                    if self._closing:
                        return
                    if self._connections:
                        self._changed.wait()
                        continue
                    left = self._idle_since + timeout - time.monotonic()
                    if left > 0:
                        self._changed.wait(left)
                    elif self._uploading():
                        self._changed.wait(_IDLE_POLL_S)
                    else:
                        break
            if self._exit_if_idle():
                return

    def _exit_if_idle(self) -> bool:
        """Exit if no client is connected. The start lock keeps a client from connecting while the
        service exits; when the lock's directory was removed (a /tmp cleaner, a harness deleting
        its temporary directory), no client can find this service any more, so it exits without
        the lock instead of lingering."""
        try:
            with start_lock(self.socket_path, LOCK_WAIT_S):
                if not self._close_listener_if_idle():
                    return False
        except ServiceUnavailableError as exc:
            _log.warning("changelog service %s could not exit idle: %s", self.socket_path, exc)
            return False
        except FileNotFoundError:
            _log.warning("changelog service %s: its directory was removed; exiting once idle", self.socket_path)
            if not self._close_listener_if_idle():
                return False
        _log.info("changelog service %s idle for %s ms: exiting", self.socket_path, self._idle_timeout_ms)
        with contextlib.suppress(Exception):  # logged, and kept in close_error
            self.close()
        return True
