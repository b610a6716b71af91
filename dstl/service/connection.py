"""A worker's connection to its changelog service: requests matched to replies, a sender and a reader thread.

One connection per ``RemoteChangelogStorage``; every writer of that storage ships through it
(what waits to be sent, and the backpressure on appends, is ``outbox``'s). Why it is shaped so:

- *The sender never blocks on the socket.* It sends without waiting and polls a blocked socket
  for a few milliseconds (``SEND_INTERVAL_S``) at a time, so that while the service applies
  backpressure it goes on measuring and gating the writers' buffers.
- *Order.* Every request first moves its writer's buffered appends into the outbox, under the
  same lock, so the service sees them before the request. Replies are matched by request id on
  a reader thread; persist futures are resolved on a thread of their own, so a callback that
  calls the writer again never blocks the reader it would wait for.
- *Deadlines and loss.* ``call`` waits at most ``dfs_timeout_ms`` (``DeadlineExceededError``);
  ``submit``'s futures are waited by the caller, but a lost connection fails every outstanding
  one at once, and kills every writer for good, with ``ServiceUnavailableError`` naming the
  operation, socket and writer: their SQNs died with the connection, so they never reconnect.
  A reply to an ``OPEN_WRITER`` whose caller gave up waiting closes that orphan writer.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import logging
import queue
import select
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dstl.config import ChangelogConfig
from dstl.errors import ChangelogError, DeadlineExceededError, WriterClosedError
from dstl.service.framing import ProtocolError
from dstl.service.outbox import Outbox, WriterBuffer
from dstl.service.protocol import (
    PROTOCOL_VERSION,
    Ack,
    CloseWriter,
    Error,
    FencedWriterError,
    Hello,
    Message,
    Opened,
    OpenWriter,
    ServiceUnavailableError,
    Welcome,
    encode,
    error_from_reply,
    read_message,
)
from dstl.types import KeyGroupRange

__all__ = ["SEND_INTERVAL_S", "Connection", "expect"]

_log = logging.getLogger(__name__)

#: how often the sender cuts the writers' lists and looks at a blocked socket
SEND_INTERVAL_S = 0.005
_JOIN_S = 10.0


def expect(cls: type[Any], convert: Callable[[Any], Any] = lambda m: m) -> Callable[[Message], Any]:
    """A reply check: ``convert`` of a reply of class ``cls``, ``ProtocolError`` for any other."""

    def check(message: Message) -> Any:
        if not isinstance(message, cls):
            raise ProtocolError(f"expected a {cls.KIND.name} reply, got {message.KIND.name}")
        return convert(message)

    return check


def _what(op: str, writer: WriterBuffer | None) -> str:
    return f"{op} of writer {writer.log_id}" if writer is not None else op


@dataclass
class _Pending:
    future: concurrent.futures.Future[Any]
    op: str
    writer: WriterBuffer | None
    convert: Callable[[Message], Any]
    callback_thread: bool = False


class Connection:
    """One connection to the service: outbox and sender thread, reader thread, pending requests (module doc)."""

    def __init__(self, sock: socket.socket, socket_path: str, config: ChangelogConfig) -> None:
        self.socket_path = socket_path
        self._sock = sock
        self._timeout_ms = config.dfs_timeout_ms
        self._lock = threading.Lock()
        #: what is still to be sent; its writers' buffers point at it (guarded by ``_lock``)
        self.outbox = Outbox(self._lock, config.preemptive_persist_threshold)
        self._wake = threading.Event()
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)
        self._callbacks: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        #: why the connection ended (None while it is up); ``closed``: by this client
        self.lost: str | None = None
        self.closed = False
        self.epoch = 0
        self.pid = 0
        self._threads = [
            threading.Thread(target=target, name=f"dstl-remote-{name}", daemon=True)
            for target, name in ((self._read_loop, "reader"), (self._send_loop, "sender"), (self._run_callbacks, "cb"))
        ]
        for thread in self._threads:
            thread.start()

    # -- requests ---------------------------------------------------------------------------

    def error(self, op: str, writer: WriterBuffer | None) -> ChangelogError:
        """The error of an operation the lost connection ended."""
        what = _what(op, writer)
        if self.closed:
            return WriterClosedError(f"changelog service {self.socket_path}: {what}: {self.lost}")
        return ServiceUnavailableError(
            f"changelog service {self.socket_path} unavailable: {what} failed: {self.lost}; "
            "the writer's unpersisted changes and SQNs are lost with the connection, it never reconnects"
        )

    def _writer_error(self, writer: WriterBuffer, op: str) -> ChangelogError:
        return self.error(op, writer)

    def submit(
        self,
        message: Message,
        op: str,
        writer: WriterBuffer | None,
        convert: Callable[[Message], Any],
        callback_thread: bool = False,
    ) -> tuple[int, concurrent.futures.Future[Any]]:
        """Queue a request behind its writer's buffered appends; returns its id and future."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self.lost is not None:
                raise self.error(op, writer)
            if writer is not None:
                self.outbox.cut_locked(writer)
                if writer._failure is not None and op in ("last_appended_sqn", "persist_durably"):
                    raise writer._failure
            request_id = next(self._ids) & 0xFFFFFFFF
            self._pending[request_id] = _Pending(future, op, writer, convert, callback_thread)
            self.outbox.put_locked(encode(message, request_id))
        self._wake.set()
        return request_id, future

    def call(self, message: Message, op: str, writer: WriterBuffer | None, convert: Callable[[Message], Any]) -> Any:
        """Send a request and wait for its reply, at most ``dfs_timeout_ms``."""
        request_id, future = self.submit(message, op, writer, convert)
        try:
            return future.result(self._timeout_ms / 1000)
        except concurrent.futures.TimeoutError:
            with self._lock:
                self._pending.pop(request_id, None)
            raise DeadlineExceededError(
                f"changelog service {self.socket_path}: {_what(op, writer)}: no reply within {self._timeout_ms} ms"
            ) from None

    def hello(self, config_fingerprint: str) -> None:
        """The first request: protocol version and configuration; the service's epoch and pid come
        back. Closes the connection if the service refuses or does not answer."""
        try:
            welcome: Welcome = self.call(Hello(PROTOCOL_VERSION, config_fingerprint), "hello", None, expect(Welcome))
        except BaseException:
            self.close()
            raise
        self.epoch, self.pid = welcome.epoch, welcome.pid

    def open_writer(self, operator_id: str, key_group_range: KeyGroupRange) -> Opened:
        """Open a writer on the service: its number on this connection and its log id."""
        opened: Opened = self.call(OpenWriter(operator_id, key_group_range), "create_writer", None, expect(Opened))
        return opened

    def register(self, writer: WriterBuffer) -> None:
        """Start shipping the buffer of a writer ``open_writer`` opened (dead at once if the
        connection was lost meanwhile)."""
        with self._lock:
            if self.lost is None:
                self.outbox.writers[writer.number] = writer
            else:
                writer._kill(lambda op: self.error(op, writer))
        self._wake.set()

    def discard(self, writer: WriterBuffer) -> bool:
        """The writer is closed: drop its buffered changes and wake appends waiting at its gate.
        True if the service may still hold it (then the caller closes it there); False if it was
        closed already, or dead, or the connection lost."""
        with self._lock:
            return self.outbox.discard_locked(writer) and writer._dead is None and self.lost is None

    # -- threads ----------------------------------------------------------------------------

    def _send_loop(self) -> None:
        poller = select.poll()
        poller.register(self._sock.fileno(), select.POLLOUT)
        current = memoryview(b"")
        length = 0
        try:
            while True:
                with self._lock:
                    if self.lost is not None:
                        return
                    self.outbox.service_writers_locked()
                    if not current and (frame := self.outbox.next_frame_locked()) is not None:
                        current, length = memoryview(frame), len(frame)
                    busy = bool(self.outbox.writers)
                if not current:
                    self._wake.wait(SEND_INTERVAL_S if busy else None)
                    self._wake.clear()
                    continue
                try:
                    sent = self._sock.send(current, socket.MSG_DONTWAIT)
                except BlockingIOError:  # the service stopped reading (backpressure): keep measuring
                    poller.poll(SEND_INTERVAL_S * 1000)
                    continue
                current = current[sent:]
                if not current:
                    with self._lock:
                        self.outbox.sent_locked(length)
        except OSError as exc:
            self._lose(f"sending failed: {exc}")

    def _read_loop(self) -> None:
        cause = "the service closed the connection"
        stream = self._sock.makefile("rb")
        try:
            while (got := read_message(stream)) is not None:
                request_id, message = got
                with self._lock:
                    pending = self._pending.pop(request_id, None)
                if pending is not None:
                    self._resolve(pending, message)
                elif isinstance(message, Opened):  # its caller gave up waiting: close the orphan
                    self.submit(CloseWriter(message.writer), "close", None, expect(Ack))
        except ProtocolError as exc:
            cause = f"the service broke the protocol: {exc}"
        except (OSError, ChangelogError) as exc:
            cause = f"connection error: {exc}"
        finally:
            stream.close()
            self._lose(cause)
            self._callbacks.put(None)  # after every resolution this thread or _lose queued

    def _resolve(self, pending: _Pending, message: Message) -> None:
        writer = pending.writer
        outcome: tuple[bool, Any]
        if isinstance(message, Error):
            exc = error_from_reply(message, f"changelog service {self.socket_path}: {_what(pending.op, writer)}")
            if isinstance(exc, FencedWriterError) and writer is not None:
                self._fence(writer, str(exc))
            outcome = (False, exc)
        else:
            try:
                outcome = (True, pending.convert(message))
            except ChangelogError as exc:
                outcome = (False, exc)
        self._settle(pending, outcome)

    def _settle(self, pending: _Pending, outcome: tuple[bool, Any]) -> None:
        ok, value = outcome
        future = pending.future

        def settle() -> None:
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)

        if pending.callback_thread:
            self._callbacks.put(settle)
        else:
            settle()

    def _run_callbacks(self) -> None:
        while (callback := self._callbacks.get()) is not None:
            try:
                callback()
            except Exception:
                _log.exception("a persist callback failed")

    def _fence(self, writer: WriterBuffer, message: str) -> None:
        with self._lock:
            self.outbox.kill_locked(writer, lambda op: FencedWriterError(message))

    def _lose(self, cause: str, closed: bool = False) -> None:
        """The connection ended: fail every outstanding request and every writer, for good."""
        with self._lock:
            if self.lost is not None:
                return
            self.lost, self.closed = cause, closed
            pending = list(self._pending.values())
            self._pending.clear()
            self.outbox.clear_locked(self._writer_error)
        self._wake.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        for p in pending:
            self._settle(p, (False, self.error(p.op, p.writer)))

    def close(self) -> None:
        self._lose("the RemoteChangelogStorage was closed", closed=True)
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(_JOIN_S)
        self._sock.close()
