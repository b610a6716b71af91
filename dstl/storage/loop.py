"""The storage's own asyncio loop thread: running work on it, refusing work once it stops, settling.

Uploads, hedges and deletions run on one loop per storage; writers, readers and checkpoint code
call in from their own threads. The subtle part is the end: work scheduled on a loop that is about
to stop would never run and its caller would wait forever, so once ``stop_accepting`` has run
every new call is refused (``StorageClosedError``) under the same lock that admits calls, and
whatever got in before is waited for, then cancelled, by ``settle``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from dstl.errors import StorageClosedError

__all__ = ["CANCEL_ROUNDS", "CANCEL_WAIT_S", "StorageLoop"]

T = TypeVar("T")
_log = logging.getLogger(__name__)

#: how often, and how far apart, ``settle`` cancels leftover tasks before abandoning them
CANCEL_ROUNDS = 3
CANCEL_WAIT_S = 0.5


class StorageLoop:
    """An event loop running forever on a daemon thread, with calls refused once it stops."""

    def __init__(self, name: str = "dstl-uploader") -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        #: set once the storage's uploads are drained on close; from then on nothing new may start
        self._stopping = False
        self._stop_lock = threading.Lock()
        self.thread.start()

    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self.thread

    def check_open(self, what: str) -> None:
        """For a blocking call that does not run on the loop (``RetryingDfsFiles``' ranged reads):
        refuse it as ``submit`` refuses work, from the loop thread or once the loop is stopping."""
        if self.in_loop_thread():
            raise RuntimeError(f"{what} called from the changelog storage's own loop thread")
        if self._stopping:
            raise StorageClosedError(f"{what}: the changelog storage is closed, it takes no new call")

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a coroutine on the loop and wait for it (not from the loop thread)."""
        return self.submit(coro).result(timeout)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop, unless the loop is stopping: work scheduled then would
        never run. Checked under ``_stop_lock``, so whatever got in is settled by ``settle``."""
        if self.in_loop_thread():
            coro.close()
            raise RuntimeError("StateChangelogStorage.run called from its own loop thread")
        with self._stop_lock:
            if self._stopping:
                name = getattr(coro, "__qualname__", "a call")
                coro.close()
                raise StorageClosedError(f"the changelog storage is closed: cannot run {name}")
            return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, fn: Callable[..., object], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop; once the loop is stopping, raise StorageClosedError."""
        if not self._call_unless_stopping(fn, *args):
            raise StorageClosedError(f"the changelog storage is closed: cannot run {_name(fn)}")

    def call_or_drop(self, fn: Callable[..., object], *args: Any) -> None:
        """``call`` for housekeeping that may be skipped once the loop is stopping (a deletion
        of an unowned file: the orphan cleanup finds it), so that a writer closing while the
        storage closes never fails halfway through its bookkeeping."""
        if not self._call_unless_stopping(fn, *args):
            _log.debug("storage closed: skipped %s%s", _name(fn), args)

    def _call_unless_stopping(self, fn: Callable[..., object], *args: Any) -> bool:
        if self.in_loop_thread():
            self.loop.call_soon(fn, *args)
            return True
        with self._stop_lock:
            if self._stopping:
                return False
            self.loop.call_soon_threadsafe(fn, *args)
            return True

    def shut_down(self, final: Callable[[], Coroutine[Any, Any, None]], timeout: float | None) -> None:
        """Refuse new calls, run ``final()`` on the loop (it settles and closes what runs there),
        then stop the loop and close it once its thread has ended (within ``timeout``)."""
        with self._stop_lock:
            self._stopping = True
        try:
            asyncio.run_coroutine_threadsafe(final(), self.loop).result()
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout)
            if not self.thread.is_alive():
                self.loop.close()

    @staticmethod
    async def settle(timeout: float | None) -> None:
        """On the loop: let every other task end, so none is destroyed pending with the loop.

        Besides uploads (drained already, unless the drain timed out): reads a reader abandoned
        (it stopped early and cancelled its read-ahead fetches), ``run`` calls whose caller timed
        out, and whatever those start (deletions, hedges). They get ``timeout`` in all to finish,
        then are cancelled, up to ``CANCEL_ROUNDS`` times ``CANCEL_WAIT_S`` apart. A cancelled call
        returns at once even when its I/O runs in a thread (``dstl.uploaders.fsspec``): the thread
        ends in the background, and a write it lands after a delete of its path removes itself.
        Never raises for these tasks; it logs them.
        """
        loop = asyncio.get_running_loop()
        deadline = math.inf if timeout is None else loop.time() + timeout
        current = asyncio.current_task()
        while (pending := {t for t in asyncio.all_tasks() if t is not current}) and loop.time() < deadline:
            await asyncio.wait(pending, timeout=None if deadline == math.inf else deadline - loop.time())
        if pending:
            _log.warning("closing: cancelling %d task(s) still running after %s s", len(pending), timeout)
        for _ in range(CANCEL_ROUNDS):
            if not pending:
                return
            for task in pending:
                task.cancel()
            await asyncio.wait(pending, timeout=CANCEL_WAIT_S)
            pending = {t for t in asyncio.all_tasks() if t is not current}
        _log.warning("closing: %d task(s) ignored cancellation and are abandoned", len(pending))


def _name(fn: Callable[..., object]) -> str:
    return str(getattr(fn, "__qualname__", fn))
