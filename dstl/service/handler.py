"""One worker's connection as the changelog service serves it: the handshake, its writers, its requests in order.

Why it is shaped so:

- *A thread per connection, blocking reads.* An executor has a handful of workers. A
  connection's frames are handled strictly in order on its thread, and ``APPEND`` calls the real
  ``ChangelogWriter.append_many`` there: when the storage applies backpressure that call blocks,
  the thread stops reading, the kernel buffer fills and the worker's send blocks. Backpressure
  reaches the worker with no mechanism of its own.
- *Replies leave through a sender thread per connection.* A ``PERSIST`` is answered when its
  future resolves, on the storage's loop thread; a client that stops reading must never block
  that loop (every upload of the process runs on it), so replies are queued, not sent there. The
  queue is bounded (``Service.max_queued_replies``): a client that sends requests and never reads
  their replies is cut off rather than filling the service's memory.
- *Nothing untrusted is read unbounded.* Until ``HELLO`` every frame may hold only a few hundred
  bytes, and ``HELLO`` must come within ``Service.hello_timeout_s``; after it each kind has its
  bound (``framing.payload_limit``). A connection whose first frame is ``PING`` is a liveness
  probe: it is answered ``PONG`` at once, from this thread, which has touched no storage yet
  (``liveness``), and closed.
- *Errors are replies, protocol violations end the connection.* A request that fails answers
  ``ERROR`` with its ``dstl.errors`` class; an ``APPEND`` has no reply, so its error is kept and
  raised by its writer's next request. A request of a writer that was fenced while it ran answers
  ``FencedWriterError``, whatever the closed writer raised. A frame that breaks the protocol is
  answered once with an ``ERROR`` of request id 0 and the connection is closed; a peer that dies
  mid-frame is a lost connection.
- *A closed connection closes its writers* (those not fenced): a dead worker releases what it
  held, and the scheduler stops waiting for it before flushing (its "every writer waits" trigger).

Which writer owns an operator and key-group range, and fencing the older one, is the service's
(``server.ChangelogService``); this module reaches it through ``Service`` and never imports it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import queue
import socket
import threading
from dataclasses import dataclass
from typing import Any, Protocol

from dstl.errors import (
    ChangelogError,
    ConfigurationError,
    FencedWriterError,
    ProtocolError,
    StorageClosedError,
    TruncatedFrameError,
    WriterClosedError,
)
from dstl.service.appends import Append
from dstl.service.framing import MAX_SMALL_PAYLOAD
from dstl.service.protocol import (
    JOIN_S,
    PROTOCOL_VERSION,
    Ack,
    CloseWriter,
    Confirm,
    Error,
    Expect,
    Hello,
    LastSqn,
    Message,
    Opened,
    OpenWriter,
    Persist,
    Persisted,
    Ping,
    Pong,
    Release,
    Sqn,
    Truncate,
    Welcome,
    encode,
    error_reply,
    read_message,
)
from dstl.types import ChangelogHandle
from dstl.writer import ChangelogWriter

__all__ = ["ConnectionHandler", "Service", "Slot"]

_log = logging.getLogger(__name__)


def _small(kind: int) -> int:
    return MAX_SMALL_PAYLOAD


@dataclass(eq=False)
class Slot:
    """A writer opened on a connection; ``fenced`` says by whom it was taken over."""

    number: int
    writer: ChangelogWriter
    key: tuple[str, int, int]
    fenced: str | None = None
    error: ChangelogError | None = None


class Service(Protocol):
    """What a connection needs of the service that accepted it (``server.ChangelogService``)."""

    socket_path: str
    fingerprint: str
    epoch: int
    #: how long a new connection may take to say HELLO (or PING)
    hello_timeout_s: float
    #: replies a connection may have queued before the service cuts it off
    max_queued_replies: int

    def open_writer(self, conn: ConnectionHandler, message: OpenWriter) -> Slot: ...

    def release_slot(self, slot: Slot) -> None: ...

    def disconnected(self, conn: ConnectionHandler, slots: list[Slot]) -> None: ...


class ConnectionHandler:
    """Serves one connection on a thread of its own, its replies sent by another (module doc)."""

    def __init__(self, sock: socket.socket, number: int, service: Service) -> None:
        self.sock = sock
        self.name = f"connection {number}"
        self.writers: dict[int, Slot] = {}  # touched by the connection's own thread only
        self._service = service
        self._replies: queue.Queue[bytes | None] = queue.Queue(service.max_queued_replies)
        self._overflowed = False
        self.thread = threading.Thread(target=self._serve, name=f"dstl-svc-{self.name}", daemon=True)
        self.sender = threading.Thread(target=self._send_replies, name=f"dstl-svc-reply-{number}", daemon=True)

    def start(self) -> None:
        self.sender.start()
        self.thread.start()

    def join(self, timeout: float) -> None:
        """Wait for the connection's thread to finish (not if it never started)."""
        if self.thread.ident is not None:
            self.thread.join(timeout)

    # -- the socket -------------------------------------------------------------------------

    def reply(self, request_id: int, message: Message) -> None:
        """Queue a reply (any thread; never blocks, never raises); a client with too many replies
        unread is cut off (module doc)."""
        try:
            frame = encode(message, request_id)
        except ProtocolError as exc:
            frame = encode(error_reply(exc), request_id)
        try:
            self._replies.put_nowait(frame)
        except queue.Full:
            if not self._overflowed:
                self._overflowed = True
                _log.warning(
                    "%s on %s does not read its replies (%d queued): cutting it off",
                    self.name,
                    self._service.socket_path,
                    self._replies.maxsize,
                )
            self.shutdown()  # the reading thread sees the end and drops the connection

    def _send_replies(self) -> None:
        while (frame := self._replies.get()) is not None:
            try:
                self.sock.sendall(frame)
            except OSError:
                self.shutdown()  # the reading thread sees the end and drops the connection
                return

    def shutdown(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def _finish(self) -> None:
        """After the reading thread is done: send what is queued, then close the socket."""
        try:
            self._replies.put_nowait(None)
        except queue.Full:  # cut off: its sender fails on the shut socket
            self.shutdown()
        if self.sender.is_alive() and self.sender is not threading.current_thread():
            self.sender.join(JOIN_S)
        self.shutdown()
        self.sock.close()

    # -- the connection's thread ------------------------------------------------------------

    def _serve(self) -> None:
        socket_path = self._service.socket_path
        stream = self.sock.makefile("rb")
        try:
            if self._handshake(stream):
                while (got := read_message(stream)) is not None:
                    self._dispatch(*got)
        except TruncatedFrameError as exc:  # the client died or closed mid-frame: a lost connection
            _log.info("%s on %s lost: %s", self.name, socket_path, exc)
        except TimeoutError:  # only the handshake has a deadline
            timeout = self._service.hello_timeout_s
            _log.warning("%s on %s said no HELLO within %g s: closing it", self.name, socket_path, timeout)
            self.reply(0, Error("ProtocolError", f"no HELLO within {timeout:g} s"))
        except ProtocolError as exc:
            _log.warning("%s on %s broke the protocol, closing it: %s", self.name, socket_path, exc)
            self.reply(0, error_reply(exc))
        except OSError as exc:
            _log.info("%s on %s lost: %s", self.name, socket_path, exc)
        finally:
            stream.close()
            self._drop()

    def _handshake(self, stream: Any) -> bool:
        service = self._service
        self.sock.settimeout(service.hello_timeout_s)
        got = read_message(stream, _small)  # nothing but HELLO or PING, and small, before HELLO
        self.sock.settimeout(None)
        if got is None:
            return False
        request_id, hello = got
        if isinstance(hello, Ping):  # a liveness probe (``liveness``): answered, then closed
            self.reply(request_id, Pong(service.epoch, os.getpid()))
            return False
        if not isinstance(hello, Hello):
            raise ProtocolError(f"the first frame must be HELLO, got {hello.KIND.name}")
        if hello.version != PROTOCOL_VERSION:
            raise ProtocolError(f"protocol version {hello.version} is not spoken here (version {PROTOCOL_VERSION})")
        if hello.fingerprint != service.fingerprint:
            self.reply(
                request_id,
                Error(
                    "ConfigurationError",
                    f"the service on {service.socket_path} serves another configuration "
                    f"(fingerprint {service.fingerprint[:16]}..., the client's {hello.fingerprint[:16]}...)",
                ),
            )
            return False
        self.reply(request_id, Welcome(service.epoch, os.getpid()))
        return True

    def _drop(self) -> None:
        """The connection ended: close the writers it held (those not taken over)."""
        slots = list(self.writers.values())
        self.writers.clear()
        self._service.disconnected(self, slots)
        for slot in slots:
            if slot.fenced is None:
                try:
                    slot.writer.close()
                except Exception:  # one writer must not keep the others open
                    _log.exception("%s: closing writer %s failed", self.name, slot.writer.log_id)
        self._finish()

    # -- requests ---------------------------------------------------------------------------

    def _dispatch(self, request_id: int, message: Message) -> None:
        if isinstance(message, Append):
            slot = self.writers.get(message.writer)
            if slot is not None and slot.fenced is None and slot.error is None:
                try:
                    slot.writer.append_many(message.pairs)  # blocks under backpressure (module doc)
                except ChangelogError as exc:
                    slot.error = exc  # no reply to an append: its writer's next request fails
            return
        reply: Message
        try:
            reply_or_none = self._request(request_id, message)
            if reply_or_none is None:
                return
            reply = reply_or_none
        except ProtocolError:
            raise
        except ChangelogError as exc:
            reply = error_reply(exc)
        except Exception as exc:
            _log.exception("%s: %s failed", self.name, message.KIND.name)
            reply = Error("StorageError", f"internal error of the changelog service: {exc!r}")
        self.reply(request_id, reply)

    def _request(self, request_id: int, message: Message) -> Message | None:
        if isinstance(message, OpenWriter):
            slot = self._service.open_writer(self, message)
            return Opened(slot.number, slot.writer.log_id)
        if isinstance(message, CloseWriter):
            self._close_writer(message.writer)
            return Ack()
        if not isinstance(message, LastSqn | Persist | Truncate | Expect | Confirm | Release):
            raise ProtocolError(f"{message.KIND.name} is not a request")
        slot = self._slot(message.writer)
        try:
            return self._writer_request(request_id, slot, message)
        except ChangelogError:
            if slot.fenced is not None:  # fenced while it ran: the writer was closed under it
                raise FencedWriterError(slot.fenced) from None
            raise

    def _writer_request(
        self, request_id: int, slot: Slot, message: LastSqn | Persist | Truncate | Expect | Confirm | Release
    ) -> Message | None:
        writer = slot.writer
        if isinstance(message, Confirm | Release) and message.handle.log_id != writer.log_id:
            raise ConfigurationError(
                f"{message.KIND.name.lower()}: the handle of log {message.handle.log_id} does not belong to "
                f"writer {writer.log_id}"
            )
        if isinstance(message, LastSqn):
            return Sqn(writer.last_appended_sqn())
        if isinstance(message, Persist):
            future = writer.persist_durably(message.after, message.note)
            future.add_done_callback(functools.partial(self._persisted, request_id, slot))
            return None
        if isinstance(message, Truncate):
            writer.truncate(message.before)
        elif isinstance(message, Expect):
            writer.expect_persist()
        elif isinstance(message, Confirm):
            writer.confirm(message.handle)
        else:
            writer.release(message.handle)
        return Ack()

    def _slot(self, number: int) -> Slot:
        slot = self.writers.get(number)
        if slot is None:
            raise WriterClosedError(f"writer number {number} is not open on this connection (closed or never opened)")
        if slot.fenced is not None:
            raise FencedWriterError(slot.fenced)
        if slot.error is not None:
            raise slot.error
        return slot

    def _close_writer(self, number: int) -> None:
        slot = self.writers.pop(number, None)
        if slot is None:
            return  # closing is idempotent
        self._service.release_slot(slot)
        if slot.fenced is None:
            slot.writer.close()

    def _persisted(self, request_id: int, slot: Slot, future: Any) -> None:
        """Done callback of a persist (on the storage's loop thread, or at once): queue the reply."""
        reply: Message
        if slot.fenced is not None:
            reply = error_reply(FencedWriterError(slot.fenced))
        elif future.cancelled():
            reply = error_reply(StorageClosedError("the persist was cancelled: the service is closing"))
        elif future.exception() is not None:
            reply = error_reply(future.exception())
        else:
            handle: ChangelogHandle = future.result()
            reply = Persisted(handle)
        self.reply(request_id, reply)
