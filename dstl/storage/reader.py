"""Reading a changelog handle back: checked segments, fetched a few ahead of decoding.

The ``StateChangelogHandleReader`` of FLIP-158. A handle lists byte ranges of log files; the
reader skips segments whose key-group bounds miss the requested range (a rescaled restore reads
only what it owns), fetches the others ``READ_AHEAD`` at a time on the storage's loop, and decodes
them on the caller's thread in SQN order. Anything inconsistent raises ``CorruptChangelogError``
naming the file: a path leaving the base directory, an SQN outside the handle, a byte range past
the largest file there can be (``dstl.types.MAX_FILE_BYTES``: refused before it is fetched, as a
parsed handle refuses it), a missing file, a segment whose key groups lie outside its index. Each
fetch has the DFS calls' deadline and retries (``dstl.retry``); one that fails for good
raises ``StorageError``.
"""

from __future__ import annotations

import concurrent.futures
from collections import deque
from collections.abc import Iterator

from dstl.errors import CorruptChangelogError
from dstl.format import decode_segment, iter_records
from dstl.paths import check_relative
from dstl.retry import RetryPolicy, call_with_retries
from dstl.storage.loop import StorageLoop
from dstl.types import MAX_FILE_BYTES, MAX_KEY_GROUP, ChangelogHandle, KeyGroupRange, SegmentRef
from dstl.uploaders import Uploader

__all__ = ["READ_AHEAD", "HandleReader"]

#: segments fetched ahead of the one being decoded when reading a handle
READ_AHEAD = 4


class HandleReader:
    """Reads handles through the storage's uploader, on the storage's loop."""

    def __init__(self, loop: StorageLoop, uploader: Uploader, policy: RetryPolicy) -> None:
        self._loop = loop
        self._uploader = uploader
        self._policy = policy

    def read(self, handle: ChangelogHandle, key_groups: KeyGroupRange | None = None) -> Iterator[tuple[int, bytes]]:
        """The changes of ``handle`` in SQN order, restricted to ``key_groups`` (all if None)."""
        if self._loop.in_loop_thread():
            raise RuntimeError("StateChangelogStorage.read would deadlock on the storage's own loop thread")
        wanted = key_groups if key_groups is not None else KeyGroupRange(0, MAX_KEY_GROUP)
        segments = checked_segments(handle)
        todo = deque(s for s in segments if wanted.intersects(s.min_key_group, s.max_key_group))
        fetching: deque[tuple[SegmentRef, concurrent.futures.Future[bytes]]] = deque()
        try:
            while todo or fetching:
                while todo and len(fetching) < READ_AHEAD:
                    seg = todo.popleft()
                    coro = self._fetch(seg)
                    fetching.append((seg, self._loop.submit(coro)))
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

    async def _fetch(self, seg: SegmentRef) -> bytes:
        try:
            return await call_with_retries(
                self._policy, "read", seg.path, lambda: self._uploader.get(seg.path, seg.offset, seg.length)
            )
        except FileNotFoundError:
            raise CorruptChangelogError(seg.path, "file is missing") from None


def checked_segments(handle: ChangelogHandle) -> list[SegmentRef]:
    """The handle's segments in SQN order, each path inside the base path and each SQN in range."""
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
        if not 0 <= seg.offset <= MAX_FILE_BYTES - seg.length:
            raise CorruptChangelogError(
                seg.path,
                f"handle of {handle.log_id} places sqn {seg.sqn} at bytes [{seg.offset}, {seg.offset + seg.length}), "
                f"past the largest changelog file ({MAX_FILE_BYTES} bytes)",
            )
        previous = seg.sqn
    return segments
