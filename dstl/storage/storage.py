"""``StateChangelogStorage``: one per process ("TaskManager"), composing the parts of the log's runtime.

Every writer of the process shares this storage's batching scheduler, so one flush writes one file
holding the changesets of many writers. The storage itself only wires the parts together and keeps
the public API in one place, as Flink's ``FsStateChangelogStorage`` does:

- ``loop.StorageLoop``: the asyncio loop thread uploads, hedges and deletions run on, and the
  refusal of new work once closing;
- ``BatchingScheduler`` -> ``UploadExecutor`` -> ``Uploader``: batching, retries and hedging, one
  file per flush (``dstl.scheduler``, ``dstl.hedging``, ``dstl.uploaders``);
- ``files.RetryingDfsFiles``: every file call under the base path, retried (``dstl.retry``), and
  deletions in the background; exposed as ``files``, the ``dstl.api.DfsFiles`` of the process;
- ``registry.FileRegistry``: the writers and the reference counts that decide when a file dies;
- ``throttle``: bytes in flight and pre-emptive persists, applied to writers from the loop;
- ``reader.HandleReader``: reading handles back with read-ahead.

Writers and readers call in from their own threads; a writer sees the storage through
``dstl.writer.WriterStorage``, everyone else through ``dstl.api.ChangelogStorage``.

An uploader with an ``open`` coroutine (S3: creating its client) is opened by the constructor, before
any writer exists: the loop thread that applies the in-flight bound must not be held by that work
while operators append. If it fails, it is logged and the uploader's first call opens it again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import uuid
from collections.abc import Collection, Coroutine, Iterator
from typing import Any, TypeVar

from dstl.api import StateChangelogWriter
from dstl.config import ChangelogConfig
from dstl.errors import CorruptChangelogError, StorageClosedError, WriterClosedError
from dstl.format import NOTES_PROBE_BYTES, parse_notes
from dstl.hedging import UploadExecutor
from dstl.metrics import ChangelogMetrics
from dstl.paths import LOG_DIRECTORY, check_name, new_file_name
from dstl.retry import RetryPolicy
from dstl.scheduler import BatchingScheduler, PendingNote, UploadEntry
from dstl.storage.files import RetryingDfsFiles
from dstl.storage.loop import StorageLoop
from dstl.storage.reader import HandleReader
from dstl.storage.registry import FileRegistry
from dstl.storage.throttle import InFlightBytes, WriterMonitor
from dstl.types import ChangelogHandle, KeyGroupRange, Note, NotedHandle, SegmentRef
from dstl.uploaders import Uploader, make_uploader
from dstl.writer import ChangelogWriter

__all__ = ["StateChangelogStorage"]

T = TypeVar("T")
_log = logging.getLogger(__name__)


class StateChangelogStorage:
    """The log of one process: creates writers, uploads their changes, reads handles back."""

    def __init__(self, config: ChangelogConfig, *, uploader: Uploader | None = None, owns_files: bool = True) -> None:
        """``owns_files=False``: never delete an uploaded file (another process, e.g. the Spark
        driver's registry, decides when files die, because this one never learns which
        checkpoints completed)."""
        self.config = config
        self.metrics = ChangelogMetrics()
        self._uploader = uploader if uploader is not None else make_uploader(config)
        self._closed = False
        self._close_lock = threading.Lock()
        self._loop = StorageLoop()
        #: the files under the base path (``dstl.api.DfsFiles``), the log's included
        self.files = RetryingDfsFiles(
            config.base_path,
            self._loop,
            self._uploader,
            RetryPolicy.for_calls(config),
            self.metrics,
            track=lambda task: self._executor.track(task),  # the executor needs the files
            parallel_reads=config.parallel_reads,
        )
        self._executor = UploadExecutor(
            self._uploader, config, self.metrics, lambda: new_file_name(config.prefix_count), discard=self.files.discard
        )
        self._registry = FileRegistry(self.files, owns_files=owns_files)
        self._in_flight = InFlightBytes(config.max_in_flight_bytes, self.metrics, self._registry.lock)
        self._scheduler = BatchingScheduler(
            config,
            self._executor,
            self.metrics,
            on_uploaded=self._registry.on_uploaded,
            on_failed=self._registry.on_failed,
            in_flight=self._in_flight,
        )
        self._reader = HandleReader(self._loop, self._uploader, self.files.policy)
        self._writer_monitor = monitor = WriterMonitor(
            self._registry.writers,
            self._in_flight,
            self._scheduler,
            self.metrics,
            policy=RetryPolicy.for_uploads(config),
            round_bytes=config.persist_size_threshold,
        )
        self._monitor = self._loop.submit(monitor.run())
        self._open_uploader()

    def _open_uploader(self) -> None:
        """Open the uploader now, if it opens at all (see the module doc); never raises."""
        opener = getattr(self._uploader, "open", None)
        if opener is None:
            return
        try:
            self._loop.run(opener(), self.files.policy.timeout_for(1))
        except Exception as exc:  # the first call opens it again and reports what fails then
            _log.warning("opening the uploader of %s failed (the first call retries): %r", self.config.base_path, exc)

    @property
    def owns_files(self) -> bool:
        return self._registry.owns_files

    @property
    def lock(self) -> threading.Lock:
        """Guards writers' entries and the file reference counts (``dstl.writer.WriterStorage``)."""
        return self._registry.lock

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a coroutine on the storage's loop and wait for it (not from the loop thread)."""
        return self._loop.run(coro, timeout)

    # -- writers (dstl.writer.WriterStorage) --------------------------------------------------

    def create_writer(self, operator_id: str, key_group_range: KeyGroupRange) -> ChangelogWriter:
        if self._closed:
            raise WriterClosedError("the changelog storage is closed: cannot create a writer")
        check_name(operator_id)
        log_id = f"{operator_id}-{key_group_range.start}-{key_group_range.end}-{uuid.uuid4().hex[:12]}"
        writer = ChangelogWriter(self, log_id, key_group_range)
        self._registry.add_writer(writer)
        self._loop.call(self._scheduler.register, log_id)
        return writer

    def reserve_in_flight(self, writer: StateChangelogWriter, size: int, retried: int) -> None:
        """Backpressure: block while other uploads would push the bytes uploading past the bound."""
        self._in_flight.reserve(writer, size, retried)

    def wait_for_capacity(self, writer: StateChangelogWriter) -> None:
        """Backpressure for appends: block while more than the bound is not yet durable."""
        self._in_flight.wait_for_capacity(writer)

    @property
    def over_limit(self) -> bool:
        return self._in_flight.over_limit

    def queue_preemptive(self, writer: StateChangelogWriter, entry: UploadEntry) -> None:
        """A changeset ``writer`` cut past its pre-emptive threshold on its own thread: counted in
        flight at once (the appending thread's next wait sees it), queued on the loop."""
        self._in_flight.add(entry.size)
        self._loop.call(self._writer_monitor.submit_preemptive, writer.log_id, entry)

    def submit_persist(
        self,
        writer: StateChangelogWriter,
        entries: list[UploadEntry],
        new: list[UploadEntry],
        after: int,
        upto: int,
        note: Note | None = None,
    ) -> concurrent.futures.Future[list[SegmentRef]]:
        segments: concurrent.futures.Future[list[SegmentRef]] = concurrent.futures.Future()
        self._loop.call(self._persist_on_loop, writer, entries, new, after, upto, segments, note)
        return segments

    def _persist_on_loop(
        self,
        writer: StateChangelogWriter,
        entries: list[UploadEntry],
        new: list[UploadEntry],
        after: int,
        upto: int,
        segments: concurrent.futures.Future[list[SegmentRef]],
        note: Note | None,
    ) -> None:
        pending = None
        if note is not None:
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            pending = PendingNote(writer.log_id, writer.key_group_range, note, after, upto, entries, done)
        self._scheduler.submit(writer.log_id, new, persist_request=True, note=pending)
        futures = [e.future for e in entries]  # after submit: it gives the new entries theirs
        noted = None if pending is None else pending.done
        self._executor.track(asyncio.ensure_future(_when_durable(futures, noted, segments)))

    def expect_persist(self, writer: StateChangelogWriter) -> None:
        self._loop.call(self._scheduler.expect, writer.log_id)

    def truncate_entries(self, entries: dict[int, UploadEntry], before: int) -> None:
        self._registry.truncate_entries(entries, before)

    def hold_files(self, paths: Collection[str]) -> str | None:
        return self._registry.hold(paths)

    def release_files(self, paths: Collection[str]) -> None:
        self._registry.release(paths)

    def hand_over_files(self, paths: Collection[str]) -> None:
        self._registry.hand_over(paths)

    def close_writer(self, writer: StateChangelogWriter) -> None:
        self._registry.close_writer(writer)
        self._in_flight.wake()  # an append or persist of the writer waiting for capacity ends
        self._loop.call_or_drop(self._scheduler.unregister, writer.log_id)

    def tracked_files(self) -> dict[str, tuple[int, bool]]:
        """Files this storage still tracks: path -> (references, confirmed). For tests and tools."""
        return self._registry.tracked_files()

    # -- reading --------------------------------------------------------------------------

    def read(self, handle: ChangelogHandle, key_groups: KeyGroupRange | None = None) -> Iterator[tuple[int, bytes]]:
        """The changes of ``handle`` in SQN order, restricted to ``key_groups`` (all if None).

        Segments whose key-group bounds miss ``key_groups`` are not fetched; the others are
        fetched a few ahead of decoding. Anything inconsistent raises ``CorruptChangelogError``.
        """
        return self._reader.read(handle, key_groups)

    async def list_files(self) -> list[str]:
        """The log files (for tests and tools; ``files.list`` lists any directory)."""
        return await self.files.call("list", LOG_DIRECTORY, lambda: self._uploader.list(LOG_DIRECTORY))

    def read_notes(self, path: str, timeout: float | None = None) -> list[NotedHandle]:
        """The notes of the changelog file at ``path`` with their persists' handles (``dstl.format``,
        notes): one ranged read of the file's start, two if the notes are long. A file without
        notes has none; a damaged one raises ``CorruptChangelogError`` naming it."""
        prefix = self.files.read_range(path, 0, NOTES_PROBE_BYTES, timeout)
        notes = parse_notes(path, prefix)
        if isinstance(notes, int):
            notes = parse_notes(path, self.files.read_range(path, 0, notes, timeout))
            if isinstance(notes, int):
                raise CorruptChangelogError(path, f"file truncated in its notes ({notes} bytes expected)")
        return notes

    def prometheus(self) -> str:
        return self.metrics.prometheus()

    # -- lifecycle ------------------------------------------------------------------------

    def flush(self, timeout: float | None = None) -> None:
        """Upload everything queued and wait for uploads and background deletions to finish."""
        self.run(self._scheduler.drain(), timeout)

    def close(self, timeout: float | None = 60.0) -> None:
        """Close every writer, finish uploads and deletions, close the uploader, stop the loop.

        The files of handles handed out and not yet confirmed or released stay, as when their
        writer closes (``dstl.storage.registry``): a checkpoint may name them.

        Calls from other threads keep working until the uploads are drained; from then on they
        raise ``StorageClosedError``, and what they had started is waited for (``_wind_down``)."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._in_flight.close()  # appends and persists waiting for capacity end
        for writer in self._registry.writers():
            writer.close()
        self._monitor.cancel()
        try:
            self.run(self._scheduler.drain(), timeout)
        finally:
            self._loop.shut_down(lambda: self._wind_down(timeout), timeout)

    async def _wind_down(self, timeout: float | None) -> None:
        """On the loop, once new calls are refused: flush what was queued before that, let every
        task end (``StorageLoop.settle``), then close the uploader, so no task uses a closed client."""
        try:
            self._scheduler.flush()
            await self._loop.settle(timeout)
        finally:
            await asyncio.wait_for(self._uploader.close(), timeout)

    def __enter__(self) -> StateChangelogStorage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _when_durable(
    futures: list[asyncio.Future[SegmentRef] | None],
    noted: asyncio.Future[None] | None,
    segments: concurrent.futures.Future[list[SegmentRef]],
) -> None:
    """Resolve ``segments`` with a persist's segments once every one is uploaded, and the file
    holding its note if it has one (the writer then builds and holds its handle), or with why not."""
    try:
        refs: list[SegmentRef] = list(await asyncio.gather(*futures))  # type: ignore[arg-type]
        if noted is not None:
            await noted
    except asyncio.CancelledError:  # by a close that timed out: the caller must not wait forever
        segments.set_exception(StorageClosedError("the changelog storage closed before this persist finished"))
        raise
    except Exception as exc:
        segments.set_exception(exc)
        return
    segments.set_result(refs)
