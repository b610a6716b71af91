"""Encoding a storage's changelog files on one thread, the files queued meanwhile in one go.

The scheduler hands every flush to ``FileEncoder.encode`` and awaits its bytes. The encoder thread
competes for the GIL with an operator thread that runs Python without pause, and each time it
needs the GIL back it waits up to the interpreter's switch interval (5 ms): when it wakes for a
file, when compression (which releases the GIL) ends, and when it has told the loop that the file
is ready (a write to the loop's wake-up socket releases it too). Those waits, not the
compression, bounded how fast files were encoded while an operator appended at full speed
(``dstl.format``, module doc). So a *session* of the encoder takes every file queued by the time
it starts and encodes them together (``dstl.format.encode_files``: one compression call for all
their segments), tells the loop once, and starts the next session with whatever was queued
meanwhile before it goes back to sleep. When encoding keeps up, a session is one file, as before;
when it falls behind, the waits are paid per session rather than per file, and sessions grow
until it keeps up again. Each file stays a file of its own (its flush's size, its own upload).

One thread, as before: encoding holds a few copies of its files at once, and one thread keeps
those multi-MiB buffers to one allocator arena (several encoding threads left their freed buffers
spread over as many glibc arenas, memory the process kept). The files of a session are counted
against the in-flight bound already (``dstl.scheduler``), so a larger session holds nothing more
than was queued.

An encoding that fails (a bug, memory) fails only its own file: a session that raises is encoded
again file by file, and each file's error goes to its own caller.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from dstl.format import ChangeSet, EncodedSegment, NoteSpec, encode_files

__all__ = ["FileEncoder"]

Encoded = tuple[bytes, list[EncodedSegment]]


@dataclass(eq=False, slots=True)
class _File:
    changesets: Sequence[ChangeSet]
    notes: Sequence[NoteSpec]
    done: asyncio.Future[Encoded]


class FileEncoder:
    """Encodes files in sessions on one thread (module doc); ``executor``: where sessions run
    (None: a thread of the encoder's own, started by the first file and let go by ``close``)."""

    def __init__(self, compression_level: int, executor: concurrent.futures.Executor | None = None) -> None:
        self._level = compression_level
        self._executor = executor
        self._owns_executor = executor is None
        self._lock = threading.Lock()
        self._queued: list[_File] = []
        self._running = False  # a session runs or is about to: files queued now are its

    async def encode(self, changesets: Sequence[ChangeSet], notes: Sequence[NoteSpec] = ()) -> Encoded:
        """The file of ``changesets`` and ``notes`` (``dstl.format.encode_file``), encoded by the
        current or the next session."""
        loop = asyncio.get_running_loop()
        file = _File(changesets, notes, loop.create_future())
        with self._lock:
            self._queued.append(file)
            start = not self._running
            self._running = True
        if start:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dstl-encode")
            try:
                self._executor.submit(self._sessions, loop)
            except BaseException:
                with self._lock:
                    self._running = False
                    self._queued.remove(file)
                raise
        return await file.done

    def _sessions(self, loop: asyncio.AbstractEventLoop) -> None:
        """The encoder thread: sessions until nothing is queued."""
        while True:
            with self._lock:
                files, self._queued = self._queued, []
                if not files:
                    self._running = False
                    return
            results = self._encode(files)
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody awaits the files
                loop.call_soon_threadsafe(_settle, files, results)

    def _encode(self, files: list[_File]) -> list[Encoded | BaseException]:
        try:
            return list(encode_files([(f.changesets, f.notes) for f in files], self._level))
        except Exception as exc:
            if len(files) == 1:
                return [exc]
        results: list[Encoded | BaseException] = []
        for file in files:  # which file failed, and why: each on its own
            try:
                results.append(encode_files([(file.changesets, file.notes)], self._level)[0])
            except Exception as exc:
                results.append(exc)
        return results

    def close(self) -> None:
        """Let the encoder's own thread go once its session ends (a session still running takes
        what is queued until nothing is; the next file after that starts another thread)."""
        with self._lock:
            if not self._owns_executor or self._executor is None:
                return
            executor, self._executor = self._executor, None
        executor.shutdown(wait=False)


def _settle(files: list[_File], results: list[Encoded | BaseException]) -> None:
    """On the loop: each file's bytes, or its error, to whoever awaits it (if anyone still does)."""
    for file, result in zip(files, results, strict=True):
        if file.done.done():
            continue
        if isinstance(result, BaseException):
            file.done.set_exception(result)
        else:
            file.done.set_result(result)
