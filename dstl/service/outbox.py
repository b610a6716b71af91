"""What a worker's connection has still to send: its writers' unsent changes and the frames queued.

Why it is shaped so:

- *The hot path stays one list operation.* A writer's ``append`` is ``records += (kg, data)``
  on a list (``WriterBuffer``), as in ``ChangelogWriter``. The connection's sender thread cuts
  every writer's list every few milliseconds the way ``ChangelogWriter`` is cut (copy the first
  ``n`` items, delete exactly those: an append racing with it lands in the next cut) and queues
  the cut as APPEND frames of bounded size (``APPEND_FRAME_BYTES``). A bad change fails its
  writer at the cut (``_failure``), to be raised by its next ``last_appended_sqn`` or persist.
- *Bounded memory.* When the service applies backpressure it stops reading, the socket fills,
  and the frames stay queued. The sender never blocks on the socket, so it keeps measuring: while
  the queued frames exceed ``preemptive_persist_threshold`` no writer is cut, and a writer with
  more than that many bytes unsent gets a gate whose ``+=`` blocks the appending thread until
  the sender cut its list; closing the writer or losing the connection meanwhile raises
  ``WriterClosedError`` (``ServiceUnavailableError`` is one). That wait has no deadline of its
  own: the connection's liveness rule ends it by declaring the connection lost (``liveness``).
- *An idle sender sleeps.* When every buffer is empty and nothing is queued, the sender swaps each
  writer's list for a stand-in (``_Waker``) whose ``+=`` appends and wakes it, and sleeps until
  then (or ``IDLE_WAKE_S``, which also ships an append that raced with the swap).

Everything here is guarded by the connection's lock (the ``*_locked`` methods expect it held):
a request must cut its writer's buffer and queue itself behind the cut atomically.
"""

from __future__ import annotations

import functools
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from dstl.errors import ChangelogError, ConfigurationError, WriterClosedError
from dstl.service.appends import append_frames

__all__ = ["APPEND_FRAME_BYTES", "IDLE_WAKE_S", "Outbox", "WriterBuffer"]

#: changes per APPEND frame, about (one change more if it is larger)
APPEND_FRAME_BYTES = 1 << 20
#: how long an idle sender sleeps at most (see module doc)
IDLE_WAKE_S = 1.0


class WriterBuffer:
    """A writer's changes not yet shipped: the list appends extend (``_records``: the list, its
    gate, or a stand-in that raises) and what the sender measured of it. ``RemoteChangelogWriter``
    is one, with the writer's calls on top."""

    def __init__(self, outbox: Outbox, number: int, log_id: str) -> None:
        self.log_id = log_id
        self.number = number
        self._outbox = outbox
        self._active: list[Any] = []
        self._records: Any = self._active
        self._gate = _Gate(self)
        self._waker = _Waker(self)
        self._measured = 0  # items of _active whose bytes are counted (sender thread)
        self._measured_bytes = 0
        self._failure: ChangelogError | None = None
        self._dead: Callable[[str], ChangelogError] | None = None
        self.closed = False
        #: appends that waited for the sender (client-side backpressure)
        self.backpressure_waits = 0

    def _kill(self, error: Callable[[str], ChangelogError]) -> None:
        """Under the connection's lock: the writer can never ship again; its calls raise ``error(op)``."""
        if self._dead is None:
            self._dead = error
            self._records = _Raising(error)


class _Gate:
    """Stands in for a writer's list while too much is unsent (see module doc)."""

    def __init__(self, writer: WriterBuffer) -> None:
        self._writer = writer

    def __iadd__(self, items: tuple[int, bytes] | list[Any]) -> list[Any]:
        writer = self._writer
        writer._outbox.wait_drained(writer)
        writer._active += items
        return writer._active


class _Waker:
    """Stands in for a writer's list while the sender sleeps: appends, then wakes it (module doc)."""

    def __init__(self, writer: WriterBuffer) -> None:
        self._writer = writer

    def __iadd__(self, items: tuple[int, bytes] | list[Any]) -> list[Any]:
        writer = self._writer
        writer._active += items
        writer._outbox.wake()
        return writer._active


class _Raising:
    """Stands in for a writer's list once it can never ship again (connection lost, fenced)."""

    def __init__(self, error: Callable[[str], ChangelogError]) -> None:
        self._error = error

    def __iadd__(self, items: object) -> Any:
        raise self._error("append")


class Outbox:
    """The frames a connection has still to send, and the buffers of its writers (module doc)."""

    def __init__(self, lock: threading.Lock, bound: int, wake: Callable[[], None]) -> None:
        self._bound = bound
        #: wakes the sender (an append to a writer whose list is the ``_Waker``)
        self.wake = wake
        self._drained = threading.Condition(lock)
        self._frames: deque[bytes] = deque()
        self._bytes = 0
        #: the writers whose buffers the sender cuts, by number
        self.writers: dict[int, WriterBuffer] = {}

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
        if self._frames or any(w._active for w in self.writers.values()):
            return False
        for writer in self.writers.values():
            if writer._records is writer._active:
                writer._records = writer._waker
        return True

    def cut_locked(self, writer: WriterBuffer) -> None:
        """Move the writer's buffered changes into the outbox as APPEND frames."""
        if writer._records is writer._gate:
            writer._records = writer._active
            self._drained.notify_all()
        active = writer._active
        n = len(active)
        writer._measured = writer._measured_bytes = 0
        if not n:
            return
        chunk = active[:n]
        del active[:n]
        if writer._failure is not None or writer._dead is not None:
            return
        try:
            frames = append_frames(writer.number, chunk, APPEND_FRAME_BYTES)
        except ConfigurationError as exc:
            writer._failure = ConfigurationError(f"changelog writer {writer.log_id}: bad change appended: {exc}")
            return
        self._frames.extend(frames)
        self._bytes += sum(map(len, frames))

    def service_writers_locked(self) -> None:
        """Measure every writer's buffer, cut it while the outbox has room, gate it when it cannot."""
        for writer in list(self.writers.values()):
            if writer._records is writer._waker:
                writer._records = writer._active
            active = writer._active
            n = len(active)
            if n > writer._measured:
                try:
                    writer._measured_bytes += sum(map(len, active[writer._measured + 1 : n : 2]))
                except TypeError:  # not bytes: the cut fails the writer
                    writer._measured_bytes += self._bound + 1
                writer._measured = n
            if n and self._bytes < self._bound:
                self.cut_locked(writer)
            elif writer._measured_bytes > self._bound and writer._records is writer._active:
                writer._records = writer._gate

    def wait_drained(self, writer: WriterBuffer) -> None:
        """An append hit the gate: wait until the sender cut the writer's buffer."""
        with self._drained:
            writer.backpressure_waits += 1
            self._drained.wait_for(lambda: writer._records is not writer._gate or writer.closed)
            if writer._dead is not None:
                raise writer._dead("append")
            if writer.closed:
                raise WriterClosedError(f"changelog writer {writer.log_id} closed while its append waited")

    def discard_locked(self, writer: WriterBuffer) -> bool:
        """The writer is closed: drop its buffered changes and wake appends waiting at its gate.
        False if it was closed already."""
        if writer.closed:
            return False
        writer.closed = True
        del writer._active[:]
        writer._measured = writer._measured_bytes = 0
        if writer._records is writer._gate or writer._records is writer._waker:
            writer._records = writer._active
        self.writers.pop(writer.number, None)
        self._drained.notify_all()
        return True

    def kill_locked(self, writer: WriterBuffer, error: Callable[[str], ChangelogError]) -> None:
        """The writer can never ship again (fenced): stop cutting it, fail its appends with ``error``."""
        self.writers.pop(writer.number, None)
        writer._kill(error)
        self._drained.notify_all()

    def clear_locked(self, error: Callable[[WriterBuffer, str], ChangelogError]) -> None:
        """The connection is lost: kill every writer (``error(writer, op)``), drop every frame."""
        for writer in self.writers.values():
            writer._kill(functools.partial(error, writer))
        self.writers.clear()
        self._frames.clear()
        self._bytes = 0
        self._drained.notify_all()
