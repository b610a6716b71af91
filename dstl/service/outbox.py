"""What a worker's connection has still to send: its writers' unsent changes and the frames queued.

Why it is shaped so:

- *The hot path stays two list appends.* A remote writer's ``append`` is its
  ``AppendBuffer``'s (``dstl.append_buffer``), as a local writer's is. The connection's sender
  thread cuts every writer's buffer every few milliseconds and queues the cut as APPEND frames of
  bounded size (``APPEND_FRAME_BYTES``). A bad change fails its writer's buffer at the cut, to be
  raised by its next append, ``last_appended_sqn`` or persist.
- *Bounded memory.* When the service applies backpressure it stops reading, the socket fills,
  and the frames stay queued. The sender never blocks on the socket, so it keeps measuring: while
  the queued frames exceed ``preemptive_persist_threshold`` no writer is cut, and a writer with
  more than that many bytes unsent is gated: its next append blocks the appending thread until
  the sender cut its buffer (the appending thread's own look, every ``LOOK_EVERY`` changes, gates
  it too when the sender has not run); closing the writer or losing the connection meanwhile raises
  ``WriterClosedError`` (``ServiceUnavailableError`` is one). That wait has no deadline of its
  own: the connection's liveness rule ends it by declaring the connection lost (``liveness``).
- *An idle sender sleeps.* When every buffer is empty and nothing is queued, the sender parks
  each writer's buffer (its next append wakes the sender) and sleeps until then (or
  ``IDLE_WAKE_S``, which also ships an append that raced with the parking).

Everything here is guarded by the connection's lock (the ``*_locked`` methods expect it held):
a request must cut its writer's buffer and queue itself behind the cut atomically.
"""

from __future__ import annotations

import functools
import threading
from collections import deque
from collections.abc import Callable
from typing import Protocol

from dstl.append_buffer import AppendBuffer, BufferStatus
from dstl.errors import ChangelogError, ConfigurationError, WriterClosedError
from dstl.service.appends import encode_frames

__all__ = ["APPEND_FRAME_BYTES", "IDLE_WAKE_S", "BufferedWriter", "Outbox"]

#: changes per APPEND frame, about (one change more if it is larger)
APPEND_FRAME_BYTES = 1 << 20
#: how long an idle sender sleeps at most (see module doc)
IDLE_WAKE_S = 1.0


class BufferedWriter(Protocol):
    """What the outbox needs of a writer (``RemoteChangelogWriter`` is one): its number on the
    connection, its log id, its buffer, and a count of the appends that waited for the sender."""

    @property
    def number(self) -> int: ...
    @property
    def log_id(self) -> str: ...
    @property
    def buffer(self) -> AppendBuffer: ...

    backpressure_waits: int


class Outbox:
    """The frames a connection has still to send, and the buffers of its writers (module doc)."""

    def __init__(self, lock: threading.Lock, bound: int, wake: Callable[[], None]) -> None:
        self._bound = bound
        #: wakes the sender (an append to a parked buffer)
        self.wake = wake
        self._drained = threading.Condition(lock)
        self._frames: deque[bytes] = deque()
        self._bytes = 0
        #: the writers whose buffers the sender cuts, by number
        self.writers: dict[int, BufferedWriter] = {}

    def put_locked(self, frame: bytes) -> None:
        self._frames.append(frame)
        self._bytes += len(frame)

    def next_frame_locked(self) -> bytes | None:
        """The next frame to send; it counts as queued until ``sent_locked``."""
        return self._frames.popleft() if self._frames else None

    def sent_locked(self, length: int) -> None:
        self._bytes -= length

    @property
    def queued(self) -> bool:
        """Whether any frame is queued or partly sent."""
        return self._bytes > 0

    def sleep_locked(self) -> bool:
        """Nothing is queued and every buffer is empty: make each writer's next append wake the
        sender (True). False, and nothing changed, if there is something to ship."""
        if self._frames or not all(w.buffer.empty for w in self.writers.values()):
            return False
        for writer in self.writers.values():
            writer.buffer.park()
        return True

    def cut_locked(self, writer: BufferedWriter) -> None:
        """Move the writer's buffered changes into the outbox as APPEND frames."""
        buffer = writer.buffer
        if buffer.ungate():
            self._drained.notify_all()
        cut = buffer.cut()
        if cut is None:
            return
        try:
            frames = encode_frames(writer.number, cut.key_groups, cut.payloads, APPEND_FRAME_BYTES)
        except ConfigurationError as exc:
            buffer.fail(ConfigurationError(f"changelog writer {writer.log_id}: bad change appended: {exc}"))
            return
        self._frames.extend(frames)
        self._bytes += sum(map(len, frames))

    def service_writers_locked(self) -> None:
        """Measure every writer's buffer, cut it while the outbox has room, gate it when it cannot."""
        for writer in list(self.writers.values()):
            buffer = writer.buffer
            buffer.unpark()
            size = buffer.measure()
            if not buffer.empty and self._bytes < self._bound:
                self.cut_locked(writer)
            elif size > self._bound:
                buffer.gate()

    def wait_drained(self, writer: BufferedWriter) -> None:
        """An append hit the gate: wait until the sender cut the writer's buffer (or it died or
        closed: the append then raises its error)."""
        with self._drained:
            writer.backpressure_waits += 1
            self._drained.wait_for(lambda: not writer.buffer.gated)
            if writer.buffer.status is BufferStatus.CLOSED:
                raise WriterClosedError(f"changelog writer {writer.log_id} closed while its append waited")

    def look(self, writer: BufferedWriter, estimate: int) -> None:
        """The appending thread's own look (``dstl.append_buffer``, the bound): a buffer holding
        about more than the bound unsent (``estimate``) is gated and waits for the sender's cut,
        as the sender's own look would do, had it run. Gated under the connection's lock, and only
        if it still holds changes: the sender cuts under that lock, and never cuts (so never
        ungates) an empty buffer, so a gate set after a cut that emptied it would hold for good."""
        if estimate <= self._bound:
            return
        with self._drained:
            if writer.buffer.empty:
                return
            writer.buffer.gate()
        self.wake()  # a sleeping sender would look only after IDLE_WAKE_S
        self.wait_drained(writer)  # returns at once if the sender cut it meanwhile

    def discard_locked(self, writer: BufferedWriter) -> bool:
        """The writer is closed: drop its buffered changes and wake appends waiting at its gate.
        False if it was closed already, fenced or lost."""
        closed = writer.buffer.close()
        self.writers.pop(writer.number, None)
        self._drained.notify_all()
        return closed

    def kill_locked(self, writer: BufferedWriter, error: Callable[[str], ChangelogError]) -> None:
        """The writer can never ship again (fenced): stop cutting it, fail its calls with ``error``."""
        self.writers.pop(writer.number, None)
        writer.buffer.kill(BufferStatus.FENCED, error)
        self._drained.notify_all()

    def clear_locked(self, error: Callable[[BufferedWriter, str], ChangelogError]) -> None:
        """The connection is lost: kill every writer (``error(writer, op)``), drop every frame."""
        for writer in self.writers.values():
            writer.buffer.kill(BufferStatus.LOST, functools.partial(error, writer))
        self.writers.clear()
        self._frames.clear()
        self._bytes = 0
        self._drained.notify_all()
