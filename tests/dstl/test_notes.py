"""Notes: a persist may carry a JSON payload into the file that makes its changes durable, and a
reader finds it by listing the note's directory (``dstl.format``, ``dstl.scheduler``).

What a user relies on: the note's handle is exactly the persist's handle (so a record built
from it restores the same changes), notes of the writers of one round share the round's file,
a persist with nothing new still leaves its note durable before it returns, a hedged file is
never listed twice, and a damaged note is a clear error naming the file.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from typing import Any

import pytest

from dstl import HedgingPolicy, KeyGroupRange, Note, StateChangelogStorage
from dstl.errors import ConfigurationError, CorruptChangelogError
from dstl.format import FILE_HEADER, NOTES_HEADER
from tests.dstl.fake_uploader import MemoryUploader, fake_storage

WAIT = 10.0
NEVER = 600_000


@pytest.fixture
def uploader() -> MemoryUploader:
    return MemoryUploader()


@pytest.fixture
def storage(uploader: MemoryUploader) -> Iterator[StateChangelogStorage]:
    s = fake_storage(uploader, persist_delay_ms=0.0, expected_persist_wait_ms=NEVER)
    yield s
    s.close()


def noted_files(uploader: MemoryUploader, directory: str) -> list[str]:
    return sorted(p for p in uploader.objects if p.startswith(f"{directory}/"))


def test_a_note_lands_with_the_changes_and_gives_back_the_persists_handle(
    storage: StateChangelogStorage, uploader: MemoryUploader
) -> None:
    w = storage.create_writer("op", KeyGroupRange(0, 9))
    w.append(3, b"first")
    earlier = w.persist_durably(0).result(WAIT)  # an earlier file of the same log
    w.append(4, b"second")
    handle = w.persist_durably(0, Note("pending/7/op", {"subtask": 2, "now_ms": 5})).result(WAIT)
    [path] = noted_files(uploader, "pending/7/op")
    assert path.endswith(".dstl") and handle.files == earlier.files | {path}
    [noted] = storage.read_notes(path)
    assert noted.payload == {"subtask": 2, "now_ms": 5}
    assert noted.handle == handle
    assert list(storage.read(noted.handle)) == [(3, b"first"), (4, b"second")]


def test_the_notes_of_one_round_share_its_file(storage: StateChangelogStorage, uploader: MemoryUploader) -> None:
    writers = [storage.create_writer(f"op{i}", KeyGroupRange(i * 10, i * 10 + 9)) for i in range(3)]
    for w in writers:
        w.expect_persist()
    futures = []
    for i, w in enumerate(writers):
        w.append(i * 10, f"change {i}".encode())
        futures.append(w.persist_durably(0, Note("pending/1/op", {"subtask": i})))
    handles = [f.result(WAIT) for f in futures]
    [path] = noted_files(uploader, "pending/1/op")
    assert len(uploader.objects) == 1  # the changes and the notes: one file
    notes = storage.read_notes(path)
    assert sorted((n.payload["subtask"], n.handle) for n in notes) == list(enumerate(handles))


def test_a_persist_with_nothing_new_still_waits_for_its_note(
    storage: StateChangelogStorage, uploader: MemoryUploader
) -> None:
    w = storage.create_writer("op", KeyGroupRange(0, 9))
    w.append(1, b"x")
    handle = w.persist_durably(0).result(WAIT)
    again = w.persist_durably(0, Note("pending/2/op", {"batch": 2})).result(WAIT)
    assert again == handle
    [path] = noted_files(uploader, "pending/2/op")
    [noted] = storage.read_notes(path)
    assert noted.handle == handle and noted.payload == {"batch": 2}
    assert list(storage.read(noted.handle)) == [(1, b"x")]


def test_notes_for_two_directories_go_to_two_files(storage: StateChangelogStorage, uploader: MemoryUploader) -> None:
    a, b = storage.create_writer("a", KeyGroupRange(0, 9)), storage.create_writer("b", KeyGroupRange(10, 19))
    a.expect_persist()
    b.expect_persist()
    a.append(1, b"a")
    b.append(11, b"b")
    fa = a.persist_durably(0, Note("pending/3/a", {"who": "a"}))
    fb = b.persist_durably(0, Note("pending/3/b", {"who": "b"}))
    ha, hb = fa.result(WAIT), fb.result(WAIT)
    [pa], [pb] = noted_files(uploader, "pending/3/a"), noted_files(uploader, "pending/3/b")
    assert [n.handle for n in storage.read_notes(pa)] == [ha]
    assert [n.handle for n in storage.read_notes(pb)] == [hb]
    assert list(storage.read(hb)) == [(11, b"b")]


def test_a_noted_file_has_one_name_for_every_attempt() -> None:
    """Hedges and retries of a noted file write the same name: a listing never shows it twice."""
    uploader = MemoryUploader(gated=True)
    policy = HedgingPolicy(initial_delay_ms=1, min_delay_ms=1, budget=1.0, burst=10.0)
    storage = fake_storage(uploader, hedging=policy, persist_delay_ms=0.0)
    try:
        w = storage.create_writer("op", KeyGroupRange(0, 9))
        w.append(1, b"x")
        future = w.persist_durably(0, Note("pending/4/op", {}))
        assert uploader.wait_for_puts(2, WAIT)  # the first attempt is held: a hedge started
        uploader.open_gate(storage)
        future.result(WAIT)
        assert len(noted_files(uploader, "pending/4/op")) == 1
        assert storage.metrics.hedges >= 1
    finally:
        storage.close()


def test_a_damaged_note_is_an_error_naming_the_file(storage: StateChangelogStorage, uploader: MemoryUploader) -> None:
    w = storage.create_writer("op", KeyGroupRange(0, 9))
    w.append(1, b"x")
    w.persist_durably(0, Note("pending/5/op", {"k": "v"})).result(WAIT)
    [path] = noted_files(uploader, "pending/5/op")
    data = bytearray(uploader.objects[path])
    data[FILE_HEADER.size + NOTES_HEADER.size + 2] ^= 0xFF
    uploader.objects[path] = bytes(data)
    with pytest.raises(CorruptChangelogError, match=rf"{path}.*notes checksum"):
        storage.read_notes(path)
    # valid framing around malformed JSON: still named, never a raw decoder error
    start = FILE_HEADER.size + NOTES_HEADER.size
    length, _ = NOTES_HEADER.unpack_from(data, FILE_HEADER.size)
    bad = b"[" + b" " * (length - 1)
    data[start : start + length] = bad
    data[FILE_HEADER.size : start] = NOTES_HEADER.pack(length, zlib.crc32(bad))
    uploader.objects[path] = bytes(data)
    with pytest.raises(CorruptChangelogError, match=rf"{path}.*malformed notes"):
        storage.read_notes(path)


def test_a_file_without_notes_has_none(storage: StateChangelogStorage, uploader: MemoryUploader) -> None:
    w = storage.create_writer("op", KeyGroupRange(0, 9))
    w.append(1, b"x")
    handle = w.persist_durably(0).result(WAIT)
    [path] = handle.files
    assert storage.read_notes(path) == []


@pytest.mark.parametrize("directory", ["/abs", "../up", "a/../../b", ""])
def test_a_note_outside_the_base_path_is_refused(directory: str) -> None:
    with pytest.raises(ConfigurationError):
        Note(directory, {})


def test_a_note_payload_must_be_an_object() -> None:
    bad: Any = ["not", "an", "object"]
    with pytest.raises(ConfigurationError, match="JSON object"):
        Note("pending/1", bad)
