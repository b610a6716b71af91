"""``StateChangelogStorage``: one per process ("TaskManager"), owning one asyncio loop thread.

Every writer of the process shares this storage's batching scheduler, so one flush writes one
file holding the changesets of many writers. Uploads, hedging and deletions run on the loop
thread; writers and readers call in from their own threads.

File ownership (the fix for Flink's FLINK-25511, where uploaded but never used files leaked):
each uploaded file is reference counted by the changesets it holds that are not yet truncated,
plus one reference per segment of every handle handed out by ``persist_durably`` and not yet
confirmed or released. When the count drops to zero and no confirmed checkpoint owns the file,
the storage deletes it. Once a handle is confirmed, its files belong to the checkpoint (the
shared-state registry deletes them when no retained checkpoint references them).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import threading
import uuid
from collections import Counter, deque
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from dstl.config import ChangelogConfig
from dstl.errors import ChangelogError, CorruptChangelogError, StorageClosedError, WriterClosedError
from dstl.format import decode_segment, iter_records
from dstl.hedging import UploadExecutor
from dstl.metrics import ChangelogMetrics
from dstl.scheduler import BatchingScheduler, UploadEntry
from dstl.types import MAX_KEY_GROUP, ChangelogHandle, KeyGroupRange, SegmentRef
from dstl.uploaders import Uploader, check_relative, make_uploader, new_file_name
from dstl.writer import ChangelogWriter

T = TypeVar("T")
_log = logging.getLogger(__name__)

#: segments fetched ahead of the one being decoded when reading a handle
READ_AHEAD = 4
#: how often, and how far apart, ``close`` cancels leftover tasks before abandoning them
CANCEL_ROUNDS = 3
CANCEL_WAIT_S = 0.5
#: how often the loop thread checks writers for pre-emptive persists and backpressure; at
#: 10M appends/s of 32 bytes this lets an active changeset overshoot its threshold by ~1.6 MB
MONITOR_INTERVAL_S = 0.005


@dataclass
class _FileState:
    refs: int
    confirmed: bool = False


class StateChangelogStorage:
    def __init__(self, config: ChangelogConfig, *, uploader: Uploader | None = None, owns_files: bool = True) -> None:
        """``owns_files=False``: never delete an uploaded file (another process, e.g. the Spark
        driver's registry, decides when files die, because this one never learns which
        checkpoints completed)."""
        self.config = config
        self.owns_files = owns_files
        self.metrics = ChangelogMetrics()
        self.lock = threading.Lock()
        self._uploader = uploader if uploader is not None else make_uploader(config)
        self._files: dict[str, _FileState] = {}
        self._holds: Counter[ChangelogHandle] = Counter()
        self._writers: dict[str, ChangelogWriter] = {}
        self._in_flight = 0
        self._in_flight_cond = threading.Condition()
        self._closed = False
        #: set once ``close`` has drained the uploads; from then on nothing new may be scheduled
        self._stopping = False
        self._stop_lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="dstl-uploader", daemon=True)
        self._thread.start()
        self._executor = UploadExecutor(
            self._uploader, config, self.metrics, lambda: new_file_name(config.prefix_count)
        )
        self._scheduler = BatchingScheduler(
            config,
            self._executor,
            self.metrics,
            on_uploaded=self._on_uploaded,
            on_failed=self._on_failed,
            release_in_flight=self._release_in_flight,
        )
        self._monitor = asyncio.run_coroutine_threadsafe(self._watch_writers(), self._loop)

    # -- threads --------------------------------------------------------------------------

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a coroutine on the storage's loop and wait for it (not from the loop thread)."""
        return self._submit(coro).result(timeout)

    def _submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop, unless the loop is stopping: work scheduled then would
        never run. Checked under ``_stop_lock``, so whatever got in is settled by ``close``."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("StateChangelogStorage.run called from its own loop thread")
        with self._stop_lock:
            if self._stopping:
                coro.close()
                raise StorageClosedError("the changelog storage is closed")
            return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _call(self, fn: Callable[..., object], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop; once the loop is stopping, raise StorageClosedError."""
        if not self._call_unless_stopping(fn, *args):
            raise StorageClosedError("the changelog storage is closed")

    def _call_or_drop(self, fn: Callable[..., object], *args: Any) -> None:
        """``_call`` for housekeeping that may be skipped once the loop is stopping (a deletion
        of an unowned file: the orphan cleanup finds it), so that a writer closing while the
        storage closes never fails halfway through its bookkeeping."""
        if not self._call_unless_stopping(fn, *args):
            _log.debug("storage closed: skipped %s%s", getattr(fn, "__name__", fn), args)

    def _call_unless_stopping(self, fn: Callable[..., object], *args: Any) -> bool:
        if threading.current_thread() is self._thread:
            self._loop.call_soon(fn, *args)
            return True
        with self._stop_lock:
            if self._stopping:
                return False
            self._loop.call_soon_threadsafe(fn, *args)
            return True

    # -- writers --------------------------------------------------------------------------

    def create_writer(self, operator_id: str, key_group_range: KeyGroupRange) -> ChangelogWriter:
        if self._closed:
            raise WriterClosedError("the changelog storage is closed")
        if not operator_id or "/" in operator_id:
            raise ValueError(f"operator_id must be a non-empty name without '/', got {operator_id!r}")
        log_id = f"{operator_id}-{key_group_range.start}-{key_group_range.end}-{uuid.uuid4().hex[:12]}"
        writer = ChangelogWriter(self, log_id, key_group_range)
        self._writers[log_id] = writer
        self._call(self._scheduler.register, log_id)
        return writer

    def reserve_in_flight(self, size: int) -> None:
        """Backpressure: block while other uploads would push the bytes in flight past the bound."""
        if size <= 0:
            return
        with self._in_flight_cond:
            if self._in_flight and self._in_flight + size > self.config.max_in_flight_bytes:
                self.metrics.backpressure_waits += 1
                self._in_flight_cond.wait_for(
                    lambda: not self._in_flight or self._in_flight + size <= self.config.max_in_flight_bytes
                )
            self._in_flight += size
            self.metrics.bytes_in_flight = self._in_flight

    def _add_in_flight(self, size: int) -> None:
        with self._in_flight_cond:
            self._in_flight += size
            self.metrics.bytes_in_flight = self._in_flight

    def wait_for_capacity(self) -> None:
        """Backpressure for appends: block while more than the bound is in flight."""
        with self._in_flight_cond:
            if self._in_flight > self.config.max_in_flight_bytes:
                self.metrics.backpressure_waits += 1
                self._in_flight_cond.wait_for(lambda: self._in_flight <= self.config.max_in_flight_bytes)

    async def _watch_writers(self) -> None:
        """Pre-emptive persists and append backpressure, checked every ``MONITOR_INTERVAL_S``."""
        while True:
            await asyncio.sleep(MONITOR_INTERVAL_S)
            writers = list(self._writers.values())
            for writer in writers:
                entry = writer.check_preemptive()
                if entry is not None:  # created already marked as scheduled (see _cut_locked)
                    self.metrics.preemptive_persists += 1
                    self._add_in_flight(entry.size)
                    self._scheduler.submit(writer.log_id, [entry], persist_request=False)
            over = self._in_flight > self.config.max_in_flight_bytes
            for writer in writers:
                writer.set_backpressure(over)

    def _release_in_flight(self, size: int) -> None:
        with self._in_flight_cond:
            self._in_flight -= size
            self.metrics.bytes_in_flight = self._in_flight
            self._in_flight_cond.notify_all()

    def submit_persist(
        self,
        writer: ChangelogWriter,
        entries: list[UploadEntry],
        new: list[UploadEntry],
        after: int,
        upto: int,
        result: concurrent.futures.Future[ChangelogHandle],
    ) -> None:
        self._call(self._persist_on_loop, writer, entries, new, after, upto, result)

    def _persist_on_loop(
        self,
        writer: ChangelogWriter,
        entries: list[UploadEntry],
        new: list[UploadEntry],
        after: int,
        upto: int,
        result: concurrent.futures.Future[ChangelogHandle],
    ) -> None:
        self._scheduler.submit(writer.log_id, new, persist_request=True)
        futures = [e.future for e in entries]

        async def complete() -> None:
            try:
                refs: list[SegmentRef] = list(await asyncio.gather(*futures))  # type: ignore[arg-type]
            except asyncio.CancelledError:  # by a close that timed out: the caller must not wait forever
                result.set_exception(StorageClosedError("the changelog storage closed before this persist finished"))
                raise
            except Exception as exc:
                result.set_exception(exc)
                return
            handle = ChangelogHandle(writer.log_id, writer.key_group_range, after, upto, tuple(refs))
            with self.lock:
                if writer.closed:
                    result.set_exception(WriterClosedError(f"changelog writer {writer.log_id} was closed"))
                    return
                gone = [ref.path for ref in refs if ref.path not in self._files]
                if gone:  # truncate() released every reference before this handle could take one
                    result.set_exception(
                        ChangelogError(
                            f"changelog writer {writer.log_id}: changes after sqn {after} were truncated while "
                            f"being persisted; file {gone[0]} is already released"
                        )
                    )
                    return
                self._holds[handle] += 1
                for ref in refs:
                    self._files[ref.path].refs += 1
            result.set_result(handle)

        self._executor.track(asyncio.ensure_future(complete()))

    # -- reference counting (the loop thread and writer threads, under self.lock) ----------

    def _on_uploaded(self, path: str, batch: list[UploadEntry]) -> None:
        with self.lock:
            state = self._files[path] = _FileState(refs=len(batch))
            for entry in batch:
                entry.changeset = None  # durable now: free the memory
                if entry.truncated:
                    state.refs -= 1
            self._maybe_delete(path, state)

    def _on_failed(self, batch: list[UploadEntry]) -> None:
        with self.lock:
            for entry in batch:
                entry.scheduled = False  # the next persist request uploads it again

    def _release_ref(self, path: str, count: int = 1) -> None:
        state = self._files.get(path)
        if state is None:
            return
        state.refs -= count
        self._maybe_delete(path, state)

    def _maybe_delete(self, path: str, state: _FileState) -> None:
        if state.refs <= 0:
            del self._files[path]
            if not state.confirmed and self.owns_files:
                self._call_or_drop(self._delete_soon, path)

    def _delete_soon(self, path: str) -> None:
        async def delete() -> None:
            with contextlib.suppress(Exception):
                await self._uploader.delete(path)
                self.metrics.files_deleted += 1

        self._executor.track(asyncio.ensure_future(delete()))

    def truncate_entries(self, writer: ChangelogWriter, before: int) -> None:
        with self.lock:
            for sqn in [s for s in writer.entries if s < before]:
                entry = writer.entries.pop(sqn)
                entry.truncated = True
                if entry.ref is not None:
                    self._release_ref(entry.ref.path)

    def confirm_handle(self, handle: ChangelogHandle) -> None:
        with self.lock:
            for path in handle.files:
                if path in self._files:
                    self._files[path].confirmed = True
            self._drop_hold(handle)

    def release_handle(self, handle: ChangelogHandle) -> None:
        with self.lock:
            self._drop_hold(handle)

    def _drop_hold(self, handle: ChangelogHandle) -> None:
        if handle not in self._holds:
            return
        self._holds[handle] -= 1
        if not self._holds[handle]:
            del self._holds[handle]
        for ref in handle.segments:
            self._release_ref(ref.path)

    def close_writer(self, writer: ChangelogWriter) -> None:
        self.truncate_entries(writer, 1 << 62)
        with self.lock:
            for handle in [h for h in self._holds if h.log_id == writer.log_id]:
                for _ in range(self._holds[handle]):
                    self._drop_hold(handle)
        self._writers.pop(writer.log_id, None)
        self._call_or_drop(self._scheduler.unregister, writer.log_id)

    def tracked_files(self) -> dict[str, tuple[int, bool]]:
        """Files this storage still tracks: path -> (references, confirmed). For tests and tools."""
        with self.lock:
            return {p: (s.refs, s.confirmed) for p, s in self._files.items()}

    # -- reading --------------------------------------------------------------------------

    def read(self, handle: ChangelogHandle, key_groups: KeyGroupRange | None = None) -> Iterator[tuple[int, bytes]]:
        """The changes of ``handle`` in SQN order, restricted to ``key_groups`` (all if None).

        Segments whose key-group bounds miss ``key_groups`` are not fetched; the others are
        fetched a few ahead of decoding. Anything inconsistent raises ``CorruptChangelogError``.
        """
        if threading.current_thread() is self._thread:
            raise RuntimeError("StateChangelogStorage.read would deadlock on the storage's own loop thread")
        wanted = key_groups if key_groups is not None else KeyGroupRange(0, MAX_KEY_GROUP)
        segments = self._checked_segments(handle)
        todo = deque(s for s in segments if wanted.intersects(s.min_key_group, s.max_key_group))
        fetching: deque[tuple[SegmentRef, concurrent.futures.Future[bytes]]] = deque()
        try:
            while todo or fetching:
                while todo and len(fetching) < READ_AHEAD:
                    seg = todo.popleft()
                    coro = self._fetch(seg)
                    fetching.append((seg, self._submit(coro)))
                seg, fut = fetching.popleft()
                blob = fut.result()
                kgs, payloads = decode_segment(
                    seg.path, blob, log_id=handle.log_id, sqn=seg.sqn, expected_records=seg.records
                )
                if kgs and (min(kgs) < seg.min_key_group or max(kgs) > seg.max_key_group):
                    raise CorruptChangelogError(seg.path, f"segment of sqn {seg.sqn} has key groups outside its index")
                yield from iter_records(kgs, payloads, wanted.start, wanted.end)
        finally:
            for _, fut in fetching:
                fut.cancel()

    def _checked_segments(self, handle: ChangelogHandle) -> list[SegmentRef]:
        segments = sorted(handle.segments, key=lambda s: s.sqn)
        previous = handle.after
        for seg in segments:
            try:
                check_relative(seg.path)
            except ValueError as exc:
                raise CorruptChangelogError(seg.path, str(exc)) from None
            if seg.sqn <= previous or seg.sqn > handle.upto:
                raise CorruptChangelogError(
                    seg.path, f"handle of {handle.log_id} lists sqn {seg.sqn} outside ({handle.after}, {handle.upto}]"
                )
            previous = seg.sqn
        return segments

    async def _fetch(self, seg: SegmentRef) -> bytes:
        try:
            return await self._uploader.get(seg.path, seg.offset, seg.length)
        except FileNotFoundError:
            raise CorruptChangelogError(seg.path, "file is missing") from None

    async def list_files(self) -> list[str]:
        return await self._uploader.list("dstl")

    # -- other files under the base path (materialized chunks, metadata) -------------------

    def put_file(self, path: str, data: bytes, timeout: float | None = None) -> None:
        """Write a whole file under the base path (no hedging: callers retry at their level)."""
        self.run(self._uploader.put(check_relative(path), data), timeout)

    def get_file(self, path: str, timeout: float | None = None) -> bytes:
        """Read a whole file under the base path; a missing file raises ``FileNotFoundError``."""
        return self.run(self._uploader.get(check_relative(path)), timeout)

    def read_range(self, path: str, offset: int, length: int, timeout: float | None = None) -> bytes:
        """Read part of a file under the base path; a missing file raises ``FileNotFoundError``."""
        return self.run(self._uploader.get(check_relative(path), offset, length), timeout)

    def delete_file(self, path: str, timeout: float | None = None) -> None:
        self.run(self._uploader.delete(check_relative(path)), timeout)

    def remove_empty_directory(self, path: str) -> None:
        """Remove an empty directory under a local base path (object stores have none)."""
        remove = getattr(self._uploader, "remove_empty_directory", None)
        if remove is not None:
            remove(check_relative(path))

    def list_all(self, prefix: str = "") -> list[str]:
        return self.run(self._uploader.list(prefix))

    def prometheus(self) -> str:
        return self.metrics.prometheus()

    # -- lifecycle ------------------------------------------------------------------------

    def flush(self, timeout: float | None = None) -> None:
        """Upload everything queued and wait for uploads and background deletions to finish."""
        self.run(self._scheduler.drain(), timeout)

    def close(self, timeout: float | None = 60.0) -> None:
        """Close every writer, finish uploads and deletions, close the uploader, stop the loop.

        Calls from other threads keep working until the uploads are drained; from then on they
        raise ``StorageClosedError``, and what they had started is waited for (``_settle``)."""
        with self._stop_lock:
            if self._closed:
                return
            self._closed = True
        for writer in list(self._writers.values()):
            writer.close()
        self._monitor.cancel()
        try:
            self.run(self._scheduler.drain(), timeout)
        finally:
            with self._stop_lock:
                self._stopping = True
            try:
                asyncio.run_coroutine_threadsafe(self._wind_down(timeout), self._loop).result()
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout)
                if not self._thread.is_alive():
                    self._loop.close()

    async def _wind_down(self, timeout: float | None) -> None:
        try:
            await self._settle(timeout)
        finally:  # after the settle: no task uses a closed client
            await asyncio.wait_for(self._uploader.close(), timeout)

    async def _settle(self, timeout: float | None) -> None:
        """Let every other task on the loop end, so none is destroyed pending with the loop.

        Besides uploads (drained already, unless the drain timed out): reads a reader abandoned
        (it stopped early and cancelled its read-ahead fetches, but a cancelled local read still
        waits for its thread), ``run`` calls whose caller timed out, and whatever those start
        (deletions, hedges). Anything queued before new calls were refused is flushed too. They
        get ``timeout`` in all to finish, then are cancelled, up to ``CANCEL_ROUNDS`` times
        ``CANCEL_WAIT_S`` apart: the first cancel of a local read or write waits for its thread
        (so a cancelled put never lands behind its caller's back), the second abandons that wait
        (the thread may finish after close). ``close`` never raises for these tasks; it logs them.
        """
        loop = asyncio.get_running_loop()
        deadline = math.inf if timeout is None else loop.time() + timeout
        current = asyncio.current_task()
        self._scheduler.flush()
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

    def __enter__(self) -> StateChangelogStorage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
