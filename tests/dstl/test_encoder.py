"""The file encoder's sessions: files queued while the encoder works are encoded together by its
next session, each still a file of its own; a file that cannot be encoded fails alone.

The encoder runs on a real thread whose sessions the test holds at a gate (an executor that
waits for an event before it runs what it was given), so "queued while a session runs" is
arranged by events, not by timing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from array import array
from collections.abc import Callable
from typing import Any

import pytest

from dstl.encoder import FileEncoder
from dstl.format import ChangeSet, decode_segment

WAIT_S = 30.0


class GatedExecutor(concurrent.futures.Executor):
    """One thread; each submitted call waits for ``gate`` before it runs. Counts the calls."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.submitted = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(1)

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        self.submitted += 1

        def held() -> Any:
            assert self.gate.wait(WAIT_S)
            return fn(*args, **kwargs)

        return self._pool.submit(held)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=cancel_futures)


def changeset(log_id: str, payloads: list[Any]) -> ChangeSet:
    kgs = array("H", range(len(payloads)))
    return ChangeSet(log_id, 1, kgs, payloads, sum(len(p) for p in payloads))


async def encode_held(encoder: FileEncoder, executor: GatedExecutor, files: list[ChangeSet]) -> list[Any]:
    """Queue every file while the first session is held at the gate, then let it go."""
    tasks = [asyncio.ensure_future(encoder.encode([cs])) for cs in files]
    await asyncio.sleep(0)  # every task has queued its file (no time passes: one loop turn)
    executor.gate.set()
    return await asyncio.gather(*tasks, return_exceptions=True)


def test_files_queued_while_the_encoder_works_are_encoded_by_one_session_each_a_file_of_its_own() -> None:
    executor = GatedExecutor()
    encoder = FileEncoder(1, executor)
    files = [changeset(f"op{i}", [b"change %d of op%d" % (j, i) for j in range(50)]) for i in range(5)]
    try:
        results = asyncio.run(encode_held(encoder, executor, files))
    finally:
        executor.shutdown()
    assert executor.submitted == 1  # one session took all five
    for cs, (data, segments) in zip(files, results, strict=True):
        (segment,) = segments
        assert segment.log_id == cs.log_id and segment.records == 50
        blob = data[segment.offset : segment.offset + segment.length]
        kgs, payloads = decode_segment("f", blob, log_id=cs.log_id, sqn=1, expected_records=50)
        assert list(kgs) == list(cs.key_groups) and payloads == list(cs.payloads)


def test_a_file_that_cannot_be_encoded_fails_alone() -> None:
    executor = GatedExecutor()
    encoder = FileEncoder(1, executor)
    files = [changeset("good-1", [b"a", b"b"]), changeset("bad", [b"a", "not bytes"]), changeset("good-2", [b"c"])]
    try:
        results = asyncio.run(encode_held(encoder, executor, files))
    finally:
        executor.shutdown()
    assert isinstance(results[1], TypeError)
    assert [seg.log_id for _, (seg,) in (results[0], results[2])] == ["good-1", "good-2"]


def test_the_encoder_keeps_working_after_a_failed_file() -> None:
    executor = GatedExecutor()
    executor.gate.set()
    encoder = FileEncoder(1, executor)

    async def scenario() -> tuple[BaseException | None, list[Any]]:
        with pytest.raises(TypeError) as failed:
            await encoder.encode([changeset("bad", ["not bytes"])])
        _, segments = await encoder.encode([changeset("good", [b"x"])])
        return failed.value, segments

    try:
        error, segments = asyncio.run(scenario())
    finally:
        executor.shutdown()
    assert isinstance(error, TypeError) and [s.log_id for s in segments] == ["good"]
