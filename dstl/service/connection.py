"""A worker's connection to its changelog service: requests matched to replies, a sender, a reader and a watch.

One connection per ``RemoteChangelogStorage``; every writer of that storage ships through it
(what waits to be sent, and the backpressure on appends, is ``outbox``'s). Why it is shaped so:

- *The sender never blocks on the socket.* It sends without waiting and polls a blocked socket
  for a few milliseconds (``SEND_INTERVAL_S``) at a time, so that while the service applies
  backpressure it goes on measuring and gating the writers' buffers; idle, it sleeps until an
  append wakes it (``outbox``).
- *Order.* Every request first moves its writer's buffered appends into the outbox, under the
  same lock, so the service sees them before the request. Replies are matched by request id on
  a reader thread; persist futures are resolved on a thread of their own, so a callback that
  calls the writer again never blocks the reader it would wait for.
- *Liveness is every wait's deadline.* A control call, a persist's future and a gated append
  wait as long as the service is alive: under backpressure a healthy service answers late (a
  request waits behind another writer's appends on the service's connection thread), so a
  per-call deadline would fail calls of a working service. One that stopped answering is found by
  the liveness rule (``liveness``), which declares the connection lost. Only ``HELLO``, which
  nothing is queued ahead of, has a deadline (``DeadlineExceededError``).
- *Loss is settled in one place.* ``_lose`` (whichever thread comes first: reader, sender, watch,
  ``close``) fails every outstanding request and kills every writer for good, then stops the
  callback thread. A pending request is popped under the lock by exactly one party, and a
  persist's settlement is queued under that lock too, so every future is settled exactly once,
  before the callback thread stops. The errors are ``ServiceUnavailableError`` naming operation,
  socket and writer (``WriterClosedError`` after ``close``): SQNs die with the connection, so
  writers never reconnect. An ``ERROR`` with request id 0 is the service's reason for ending the
  connection (a protocol violation, a refusal) and becomes the cause every failure reports.
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
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dstl.append_buffer import BufferStatus
from dstl.config import ChangelogConfig
from dstl.errors import (
    ChangelogError,
    DeadlineExceededError,
    FencedWriterError,
    ProtocolError,
    ServiceUnavailableError,
    WriterClosedError,
)
from dstl.service.liveness import Liveness, probe
from dstl.service.outbox import IDLE_WAKE_S, BufferedWriter, Outbox
from dstl.service.protocol import (
    JOIN_S,
    PROTOCOL_VERSION,
    Error,
    Hello,
    Message,
    Opened,
    OpenWriter,
    Pong,
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


def expect(cls: type[Any], convert: Callable[[Any], Any] = lambda m: m) -> Callable[[Message], Any]:
    """A reply check: ``convert`` of a reply of class ``cls``, ``ProtocolError`` for any other."""

    def check(message: Message) -> Any:
        if not isinstance(message, cls):
            raise ProtocolError(f"expected a {cls.KIND.name} reply, got {message.KIND.name}")
        return convert(message)

    return check


def _what(op: str, writer: BufferedWriter | None) -> str:
    return f"{op} of writer {writer.log_id}" if writer is not None else op


@dataclass
class _Pending:
    future: concurrent.futures.Future[Any]
    op: str
    writer: BufferedWriter | None
    convert: Callable[[Message], Any]
    callback_thread: bool = False


def _settler(future: concurrent.futures.Future[Any], ok: bool, value: Any) -> Callable[[], None]:
    return (lambda: future.set_result(value)) if ok else (lambda: future.set_exception(value))


class Connection:
    """One connection to the service: outbox and sender, reader, watch, pending requests (module doc)."""

    def __init__(
        self, sock: socket.socket, socket_path: str, config: ChangelogConfig, liveness: Liveness | None = None
    ) -> None:
        self.socket_path = socket_path
        self._sock = sock
        self._timeout_ms = config.dfs_timeout_ms
        self._liveness = liveness or Liveness.of(config)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        #: what is still to be sent; its writers' buffers point at it (guarded by ``_lock``)
        self.outbox = Outbox(self._lock, config.preemptive_persist_threshold, self._wake.set)
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)
        self._callbacks: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        #: why the connection ended (None while it is up); ``closed``: by this client
        self.lost: str | None = None
        self.closed = False
        self.epoch = 0
        self.pid = 0
        #: when a byte last moved either way, or a probe was answered (``time.monotonic``)
        self._progress = time.monotonic()
        self._send_failure: str | None = None
        self._stop_watch = threading.Event()
        self._probe_sock: socket.socket | None = None
        #: liveness probes the service answered
        self.probes_answered = 0
        self._threads = [
            threading.Thread(target=target, name=f"dstl-remote-{name}", daemon=True)
            for target, name in ((self._read_loop, "reader"), (self._send_loop, "sender"), (self._run_callbacks, "cb"))
        ]
        self._watch_thread = threading.Thread(target=self._watch, name="dstl-remote-watch", daemon=True)
        for thread in self._threads:
            thread.start()

    # -- requests ---------------------------------------------------------------------------

    def error(self, op: str, writer: BufferedWriter | None) -> ChangelogError:
        """The error of an operation the lost connection ended."""
        what = _what(op, writer)
        if self.closed:
            return WriterClosedError(f"changelog service {self.socket_path}: {what}: {self.lost}")
        return ServiceUnavailableError(
            f"changelog service {self.socket_path} unavailable: {what} failed: {self.lost}; "
            "the writer's unpersisted changes and SQNs are lost with the connection, it never reconnects"
        )

    def submit(
        self,
        message: Message,
        op: str,
        writer: BufferedWriter | None,
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
                if op in ("last_appended_sqn", "persist_durably"):
                    writer.buffer.check(op)  # a bad change failed the writer
            request_id = next(self._ids) & 0xFFFFFFFF
            while not request_id or request_id in self._pending:  # 0 is the service's own
                request_id = next(self._ids) & 0xFFFFFFFF
            self._pending[request_id] = _Pending(future, op, writer, convert, callback_thread)
            self.outbox.put_locked(encode(message, request_id))
        self._wake.set()
        return request_id, future

    def call(
        self,
        message: Message,
        op: str,
        writer: BufferedWriter | None,
        convert: Callable[[Message], Any],
        deadline_ms: int | None = None,
    ) -> Any:
        """Send a request and wait for its reply: while the service is alive (module doc), or at
        most ``deadline_ms`` (``DeadlineExceededError``)."""
        request_id, future = self.submit(message, op, writer, convert)
        try:
            return future.result(None if deadline_ms is None else deadline_ms / 1000)
        except concurrent.futures.TimeoutError:
            with self._lock:
                self._pending.pop(request_id, None)
            raise DeadlineExceededError(
                f"changelog service {self.socket_path}: {_what(op, writer)}: no reply within {deadline_ms} ms"
            ) from None

    def hello(self, config_fingerprint: str) -> None:
        """The first request: protocol version and configuration; the service's epoch and pid come
        back, and the liveness watch starts. Closes the connection if the service refuses or does
        not answer within ``dfs_timeout_ms``."""
        try:
            welcome: Welcome = self.call(
                Hello(PROTOCOL_VERSION, config_fingerprint),
                "hello",
                None,
                expect(Welcome),
                deadline_ms=self._timeout_ms,
            )
        except BaseException:
            self.close()
            raise
        self.epoch, self.pid = welcome.epoch, welcome.pid
        self._progress = time.monotonic()
        self._watch_thread.start()

    def open_writer(self, operator_id: str, key_group_range: KeyGroupRange) -> Opened:
        """Open a writer on the service: its number on this connection and its log id."""
        opened: Opened = self.call(OpenWriter(operator_id, key_group_range), "create_writer", None, expect(Opened))
        return opened

    def register(self, writer: BufferedWriter) -> None:
        """Start shipping the buffer of a writer ``open_writer`` opened (dead at once if the
        connection was lost meanwhile)."""
        with self._lock:
            if self.lost is None:
                self.outbox.writers[writer.number] = writer
            else:
                writer.buffer.kill(BufferStatus.LOST, lambda op: self.error(op, writer))
        self._wake.set()

    def discard(self, writer: BufferedWriter) -> bool:
        """The writer is closed: drop its buffered changes and wake appends waiting at its gate.
        True if the service may still hold it (then the caller closes it there); False if it was
        closed already, or dead, or the connection lost."""
        with self._lock:
            return self.outbox.discard_locked(writer) and self.lost is None

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
                    idle = not current and self.outbox.sleep_locked()
                if not current:
                    self._wake.wait(IDLE_WAKE_S if idle else SEND_INTERVAL_S)
                    self._wake.clear()
                    continue
                try:
                    sent = self._sock.send(current, socket.MSG_DONTWAIT)
                except BlockingIOError:  # the service stopped reading (backpressure): keep measuring
                    poller.poll(SEND_INTERVAL_S * 1000)
                    continue
                self._progress = time.monotonic()
                current = current[sent:]
                if not current:
                    with self._lock:
                        self.outbox.sent_locked(length)
        except OSError as exc:
            # The service closed or reset the connection: the reader owns the loss, so that it
            # reports what the service said last (an ERROR with request id 0), then this.
            self._send_failure = f"sending failed: {exc}"
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
        except BaseException as exc:
            _log.exception("the sender of the connection to %s failed", self.socket_path)
            self._lose(f"the sender failed: {exc!r}")

    def _read_loop(self) -> None:
        cause = "the service closed the connection"
        stream = self._sock.makefile("rb")
        try:
            while (got := read_message(stream)) is not None:
                self._progress = time.monotonic()
                request_id, message = got
                if request_id == 0 and isinstance(message, Error):
                    cause = f"the service ended the connection: {message.type}: {message.message}"
                    break
                self._resolve(request_id, message)
            else:
                cause = self._send_failure or cause
        except ProtocolError as exc:
            cause = f"the service broke the protocol: {exc}"
        except OSError as exc:
            cause = f"connection error: {exc}"
        except BaseException as exc:
            _log.exception("the reader of the connection to %s failed", self.socket_path)
            cause = f"the reader failed: {exc!r}"
        finally:
            stream.close()
            self._lose(cause)

    def _resolve(self, request_id: int, message: Message) -> None:
        with self._lock:
            pending = self._pending.get(request_id)
        if pending is None:  # hello's caller gave up, or the connection was lost meanwhile
            return
        writer = pending.writer
        ok: bool
        value: Any
        if isinstance(message, Error):
            ok, value = (
                False,
                error_from_reply(message, f"changelog service {self.socket_path}: {_what(pending.op, writer)}"),
            )
            if isinstance(value, FencedWriterError) and writer is not None:
                self._fence(writer, str(value))
        else:
            try:
                ok, value = True, pending.convert(message)
            except ChangelogError as exc:
                ok, value = False, exc
        settle = _settler(pending.future, ok, value)
        with self._lock:
            if self._pending.pop(request_id, None) is None:
                return  # _lose settled it
            if pending.callback_thread:
                self._callbacks.put(settle)  # under the lock: before _lose's end of the queue
                return
        settle()

    def _run_callbacks(self) -> None:
        while (callback := self._callbacks.get()) is not None:
            try:
                callback()
            except Exception:
                _log.exception("a persist callback failed")

    def _watch(self) -> None:
        """The liveness rule (``liveness``): probe when something is awaited and nothing moved."""
        rule = self._liveness
        try:
            while True:
                with self._lock:
                    if self.lost is not None:
                        return
                    awaiting = bool(self._pending) or self.outbox.queued
                    quiet = time.monotonic() - self._progress
                if not awaiting or quiet < rule.quiet_s:
                    self._stop_watch.wait(rule.quiet_s - quiet if awaiting else rule.quiet_s)
                    continue
                why = self._probe()
                if why is not None:
                    self._lose(f"no answer for {time.monotonic() - self._progress:.1f} s ({why})")
        except BaseException as exc:
            _log.exception("the liveness watch of the connection to %s failed", self.socket_path)
            self._lose(f"the liveness watch failed: {exc!r}")

    def _probe(self) -> str | None:
        """None if the service answered a probe; else why it counts as not answering."""
        try:
            reply = probe(self.socket_path, self._liveness.answer_s, self._track_probe)
        except (OSError, ChangelogError) as exc:
            return f"a liveness probe got no answer within {self._liveness.answer_s:g} s: {exc or type(exc).__name__}"
        if isinstance(reply, Pong) and (reply.epoch, reply.pid) != (self.epoch, self.pid):
            return f"its socket is served by another service now (epoch {reply.epoch}, pid {reply.pid})"
        with self._lock:  # a Pong, or the refusal of a service that has too many connections
            self._progress = time.monotonic()
            self.probes_answered += 1
        return None

    def _track_probe(self, sock: socket.socket | None) -> None:
        self._probe_sock = sock

    def _fence(self, writer: BufferedWriter, message: str) -> None:
        with self._lock:
            self.outbox.kill_locked(writer, lambda op: FencedWriterError(message))

    def _lose(self, cause: str, closed: bool = False) -> None:
        """The connection ended: fail every outstanding request and every writer, for good, then
        stop the callback thread (module doc: the one place that does)."""
        direct: list[Callable[[], None]] = []
        with self._lock:
            if self.lost is not None:
                return
            self.lost, self.closed = cause, closed
            for p in self._pending.values():
                settle = _settler(p.future, False, self.error(p.op, p.writer))
                if p.callback_thread:
                    self._callbacks.put(settle)
                else:
                    direct.append(settle)
            self._pending.clear()
            self.outbox.clear_locked(lambda writer, op: self.error(op, writer))
            self._callbacks.put(None)  # after every settlement: they are all queued under this lock
        self._wake.set()
        self._stop_watch.set()
        for sock in (self._sock, self._probe_sock):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        for settle in direct:
            settle()

    def close(self) -> None:
        self._lose("the RemoteChangelogStorage was closed", closed=True)
        for thread in (*self._threads, self._watch_thread):
            if thread.ident is not None and thread is not threading.current_thread():
                thread.join(JOIN_S)
        self._sock.close()
