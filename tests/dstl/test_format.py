"""The changelog file format: round trips, and every kind of damage raising a clear error naming the file."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import re
import struct
import threading
import time
import zlib
from array import array
from pathlib import Path

import pytest
import zstandard
from hypothesis import given
from hypothesis import strategies as st

from dstl import (
    ChangelogConfig,
    ChangelogHandle,
    CorruptChangelogError,
    KeyGroupRange,
    SegmentRef,
    StateChangelogStorage,
    StorageClosedError,
)
from dstl.format import (
    FILE_HEADER,
    FORMAT_VERSION,
    SEGMENT_HEADER,
    SEGMENT_MAGIC,
    TRAILER,
    ChangeSet,
    decode_segment,
    encode_file,
    iter_records,
    log_crc,
    read_footer,
    verify_file,
)
from dstl.uploaders import FsspecUploader

PATH = "dstl/ab/some-file"


def changeset(log_id: str, sqn: int, records: list[tuple[int, bytes]]) -> ChangeSet:
    payloads = [p for _, p in records]
    return ChangeSet(log_id, sqn, array("H", [kg for kg, _ in records]), payloads, sum(map(len, payloads)))


SAMPLE = [
    changeset("op-a", 1, [(3, b"alpha"), (1, b""), (3, b"gamma" * 50)]),
    changeset("op-b", 7, [(100, b"\x00\xff" * 300)]),
    changeset("op-a", 2, [(0, b"x"), (127, b"y"), (5, b"z")]),
]


@pytest.fixture(scope="module")
def sample() -> tuple[bytes, list[dict[str, object]]]:
    data, segments = encode_file(SAMPLE)
    return data, [dataclasses.asdict(s) for s in segments]


def segment_blob(data: bytes, seg: dict[str, object]) -> bytes:
    offset, length = int(seg["offset"]), int(seg["length"])  # type: ignore[call-overload]
    return data[offset : offset + length]


def flip(data: bytes, index: int, mask: int = 0x01) -> bytes:
    out = bytearray(data)
    out[index] ^= mask
    return bytes(out)


def assert_corrupt(exc_info: pytest.ExceptionInfo[CorruptChangelogError], path: str = PATH) -> str:
    message = str(exc_info.value)
    assert path in message
    assert exc_info.value.path == path
    return message


# -- round trips ----------------------------------------------------------------------------


def test_file_round_trip_every_segment_decodes_to_its_changeset(sample: tuple[bytes, list[dict[str, object]]]) -> None:
    data, segments = sample
    assert data.startswith(b"DSTL") and data.endswith(b"LTSD")
    assert [(s["log_id"], s["sqn"], s["records"]) for s in segments] == [
        (cs.log_id, cs.sqn, cs.records) for cs in SAMPLE
    ]
    for cs, seg in zip(SAMPLE, segments, strict=True):
        kgs, payloads = decode_segment(
            PATH, segment_blob(data, seg), log_id=cs.log_id, sqn=cs.sqn, expected_records=cs.records
        )
        assert list(kgs) == list(cs.key_groups)
        assert payloads == list(cs.payloads)
        assert seg["min_key_group"] == min(cs.key_groups)
        assert seg["max_key_group"] == max(cs.key_groups)


def test_footer_indexes_every_segment_and_verify_counts_records(sample: tuple[bytes, list[dict[str, object]]]) -> None:
    data, segments = sample
    index = read_footer(PATH, data)
    assert index.version == FORMAT_VERSION
    assert [(s["log_id"], s["sqn"], s["offset"], s["length"]) for s in index.segments] == [
        (s["log_id"], s["sqn"], s["offset"], s["length"]) for s in segments
    ]
    assert verify_file(PATH, data) == sum(cs.records for cs in SAMPLE)


def test_empty_file_round_trips() -> None:
    data, segments = encode_file([])
    assert segments == []
    assert read_footer(PATH, data).segments == []
    assert verify_file(PATH, data) == 0


records_strategy = st.lists(st.tuples(st.integers(0, 2**15 - 1), st.binary(max_size=64)), min_size=1, max_size=40)


@given(
    st.lists(st.tuples(st.text(min_size=1, max_size=12), records_strategy), min_size=1, max_size=5),
    st.integers(-3, 5),
)
def test_any_changesets_round_trip(logs: list[tuple[str, list[tuple[int, bytes]]]], level: int) -> None:
    changesets = [changeset(log_id, sqn, recs) for sqn, (log_id, recs) in enumerate(logs, start=1)]
    data, segments = encode_file(changesets, compression_level=level)
    assert verify_file(PATH, data) == sum(cs.records for cs in changesets)
    for cs, seg in zip(changesets, segments, strict=True):
        blob = data[seg.offset : seg.offset + seg.length]
        kgs, payloads = decode_segment(PATH, blob, log_id=cs.log_id, sqn=cs.sqn, expected_records=cs.records)
        assert list(zip(kgs, payloads, strict=True)) == list(zip(cs.key_groups, cs.payloads, strict=True))


@given(records_strategy, st.integers(0, 2**15 - 1), st.integers(0, 2**15 - 1))
def test_iter_records_keeps_order_and_filters_key_groups(records: list[tuple[int, bytes]], a: int, b: int) -> None:
    lo, hi = min(a, b), max(a, b)
    kgs = array("H", [kg for kg, _ in records])
    got = list(iter_records(kgs, [p for _, p in records], lo, hi))
    assert got == [(kg, p) for kg, p in records if lo <= kg <= hi]


# -- damaged segments -----------------------------------------------------------------------


def test_flipped_byte_in_segment_payload(sample: tuple[bytes, list[dict[str, object]]]) -> None:
    data, segments = sample
    seg = segments[1]
    blob = segment_blob(data, seg)
    with pytest.raises(CorruptChangelogError) as exc_info:
        decode_segment(PATH, flip(blob, len(blob) - 3), log_id="op-b", sqn=7)
    assert "checksum" in assert_corrupt(exc_info)
    damaged = flip(data, int(seg["offset"]) + int(seg["length"]) - 3)  # type: ignore[call-overload]
    with pytest.raises(CorruptChangelogError) as exc_info:
        verify_file(PATH, damaged)
    assert_corrupt(exc_info)


@pytest.mark.parametrize("index", range(SEGMENT_HEADER.size))
def test_flipped_byte_anywhere_in_segment_header(sample: tuple[bytes, list[dict[str, object]]], index: int) -> None:
    data, segments = sample
    blob = segment_blob(data, segments[0])
    with pytest.raises(CorruptChangelogError) as exc_info:
        decode_segment(PATH, flip(blob, index, 0x80), log_id="op-a", sqn=1)
    assert_corrupt(exc_info)


def _repack_segment_header(blob: bytes, **changes: int) -> bytes:
    """The segment with some header fields replaced and header_crc recomputed to match."""
    fields = list(SEGMENT_HEADER.unpack_from(blob))
    names = ["magic", "version", "flags", "sqn", "log_crc", "raw_len", "comp_len", "payload_crc", "header_crc"]
    for name, value in changes.items():
        fields[names.index(name)] = value
    head = SEGMENT_HEADER.pack(*fields)[: SEGMENT_HEADER.size - 4]
    return head + struct.pack("<I", zlib.crc32(head)) + blob[SEGMENT_HEADER.size :]


def test_segment_of_unknown_version_is_rejected_by_the_version_check(
    sample: tuple[bytes, list[dict[str, object]]],
) -> None:
    data, segments = sample
    blob = _repack_segment_header(segment_blob(data, segments[0]), version=FORMAT_VERSION + 1)
    with pytest.raises(CorruptChangelogError) as exc_info:
        decode_segment(PATH, blob, log_id="op-a", sqn=1)
    message = assert_corrupt(exc_info)
    assert f"version {FORMAT_VERSION + 1}" in message
    assert "checksum" not in message


@pytest.mark.parametrize("cut", [0, 10, SEGMENT_HEADER.size - 1, SEGMENT_HEADER.size, SEGMENT_HEADER.size + 5, -1])
def test_truncated_segment(sample: tuple[bytes, list[dict[str, object]]], cut: int) -> None:
    data, segments = sample
    blob = segment_blob(data, segments[2])
    with pytest.raises(CorruptChangelogError) as exc_info:
        decode_segment(PATH, blob[:cut], log_id="op-a", sqn=2)
    assert_corrupt(exc_info)


@pytest.mark.parametrize(
    ("log_id", "sqn", "segment", "expected_records"),
    [
        ("op-b", 1, 0, None),  # another log's id
        ("op-a", 2, 0, None),  # another sqn of the same log
        ("op-a", 1, 0, 4),  # the handle expects another record count
    ],
)
def test_handle_naming_another_segment_is_rejected(
    sample: tuple[bytes, list[dict[str, object]]], log_id: str, sqn: int, segment: int, expected_records: int | None
) -> None:
    data, segments = sample
    with pytest.raises(CorruptChangelogError) as exc_info:
        decode_segment(
            PATH, segment_blob(data, segments[segment]), log_id=log_id, sqn=sqn, expected_records=expected_records
        )
    assert_corrupt(exc_info)


@pytest.mark.parametrize("shift", [-1, 1, 8, -8])
def test_wrong_offset_is_rejected(sample: tuple[bytes, list[dict[str, object]]], shift: int) -> None:
    data, segments = sample
    seg = segments[1]
    start = int(seg["offset"]) + shift  # type: ignore[call-overload]
    blob = data[start : start + int(seg["length"])]  # type: ignore[call-overload]
    with pytest.raises(CorruptChangelogError) as exc_info:
        decode_segment(PATH, blob, log_id="op-b", sqn=7)
    assert_corrupt(exc_info)


def _segment_with_payload(raw: bytes, *, compress: bool = True, sqn: int = 1, log_id: str = "op") -> bytes:
    """A segment whose header and checksums are valid for the given (possibly inconsistent) content."""
    payload = zstandard.ZstdCompressor().compress(raw) if compress else raw
    head = SEGMENT_HEADER.pack(
        SEGMENT_MAGIC, FORMAT_VERSION, 0, sqn, log_crc(log_id), len(raw), len(payload), zlib.crc32(payload), 0
    )[: SEGMENT_HEADER.size - 4]
    return head + struct.pack("<I", zlib.crc32(head)) + payload


@pytest.mark.parametrize(
    "raw",
    [
        struct.pack("<I", 2) + struct.pack("<HH", 1, 2) + struct.pack("<II", 3, 3) + b"abc",  # lengths exceed data
        struct.pack("<I", 1000) + b"\x00" * 12,  # count larger than the columns
        b"\x01\x00",  # shorter than the count field
    ],
)
def test_checksummed_but_inconsistent_columns_raise_not_crash(raw: bytes) -> None:
    with pytest.raises(CorruptChangelogError) as exc_info:
        decode_segment(PATH, _segment_with_payload(raw), log_id="op", sqn=1)
    assert_corrupt(exc_info)


def test_checksummed_payload_that_is_not_zstd_raises() -> None:
    with pytest.raises(CorruptChangelogError) as exc_info:
        decode_segment(PATH, _segment_with_payload(b"definitely not zstd", compress=False), log_id="op", sqn=1)
    assert "decompress" in assert_corrupt(exc_info)


# -- damaged files --------------------------------------------------------------------------


def _footer_start(data: bytes) -> int:
    footer_len = struct.unpack_from("<I", data, len(data) - TRAILER.size)[0]
    return len(data) - TRAILER.size - footer_len


def test_flipped_byte_in_footer(sample: tuple[bytes, list[dict[str, object]]]) -> None:
    data, _ = sample
    start = _footer_start(data)
    for index in (start, start + 10, len(data) - TRAILER.size - 1):
        with pytest.raises(CorruptChangelogError) as exc_info:
            read_footer(PATH, flip(data, index))
        assert "footer" in assert_corrupt(exc_info)


@pytest.mark.parametrize("index", range(-TRAILER.size, 0))
def test_flipped_byte_in_trailer(sample: tuple[bytes, list[dict[str, object]]], index: int) -> None:
    data, _ = sample
    with pytest.raises(CorruptChangelogError) as exc_info:
        verify_file(PATH, flip(data, len(data) + index))
    assert_corrupt(exc_info)


def test_every_single_bit_flip_is_detected_by_verify(sample: tuple[bytes, list[dict[str, object]]]) -> None:
    data, _ = sample
    undetected = []
    for index in range(len(data)):
        for bit in range(8):
            try:
                verify_file(PATH, flip(data, index, 1 << bit))
            except CorruptChangelogError as exc:
                assert exc.path == PATH
            else:
                undetected.append((index, bit))
    assert undetected == []


def test_truncated_file_at_many_points(sample: tuple[bytes, list[dict[str, object]]]) -> None:
    data, segments = sample
    seg = segments[1]
    mid_segment = int(seg["offset"]) + int(seg["length"]) // 2  # type: ignore[call-overload]
    cuts = [0, 3, FILE_HEADER.size, FILE_HEADER.size + 5, mid_segment, _footer_start(data), len(data) - 5]
    cuts.append(len(data) - 1)
    for cut in cuts:
        with pytest.raises(CorruptChangelogError) as exc_info:
            verify_file(PATH, data[:cut])
        assert_corrupt(exc_info)


def test_file_of_unknown_version(sample: tuple[bytes, list[dict[str, object]]]) -> None:
    data, _ = sample
    future = FORMAT_VERSION + 1
    patched = bytearray(data)
    struct.pack_into("<H", patched, 4, future)  # the file header's version
    struct.pack_into("<H", patched, len(data) - 6, future)  # the trailer's version, consistent with it
    with pytest.raises(CorruptChangelogError) as exc_info:
        read_footer(PATH, bytes(patched))
    assert f"version {future}" in assert_corrupt(exc_info)


@pytest.mark.parametrize(
    "garbage",
    [b"", b"DSTL", b"hello world, this is not a changelog file at all" * 3, bytes(range(256)), b"\x00" * 100],
)
def test_garbage_is_not_a_changelog_file(garbage: bytes) -> None:
    with pytest.raises(CorruptChangelogError) as exc_info:
        verify_file(PATH, garbage)
    assert_corrupt(exc_info)
    with pytest.raises(CorruptChangelogError) as exc_info:
        decode_segment(PATH, garbage, log_id="op", sqn=1)
    assert_corrupt(exc_info)


def _with_footer(data: bytes, footer: bytes) -> bytes:
    body = data[: _footer_start(data)]
    return body + footer + TRAILER.pack(len(footer), zlib.crc32(footer), FORMAT_VERSION, b"LTSD")


@pytest.mark.parametrize(
    "footer",
    [
        b"not json",
        b"[]",
        json.dumps({"version": 1}).encode(),
        json.dumps({"version": 1, "segments": {}}).encode(),
        json.dumps({"version": 1, "segments": [{"offset": "8", "length": 10}]}).encode(),
        json.dumps({"version": 1, "segments": [{"offset": 8, "length": 10**9}]}).encode(),
        json.dumps({"version": 1, "segments": [{"offset": 0, "length": 4}]}).encode(),
    ],
)
def test_checksummed_but_malformed_footer(sample: tuple[bytes, list[dict[str, object]]], footer: bytes) -> None:
    data, _ = sample
    with pytest.raises(CorruptChangelogError) as exc_info:
        read_footer(PATH, _with_footer(data, footer))
    assert "footer" in assert_corrupt(exc_info)


# -- through the storage --------------------------------------------------------------------


def persisted(storage: StateChangelogStorage) -> tuple[ChangelogHandle, list[tuple[int, bytes]]]:
    writer = storage.create_writer("op", KeyGroupRange(0, 15))
    records = [(kg % 16, f"record-{kg}".encode() * 5) for kg in range(40)]
    for kg, payload in records[:20]:
        writer.append(kg, payload)
    writer.last_appended_sqn()
    for kg, payload in records[20:]:
        writer.append(kg, payload)
    handle = writer.persist_durably(0).result(10)
    assert list(storage.read(handle)) == records
    return handle, records


def test_corrupted_file_on_disk_is_detected_on_read(local_storage: StateChangelogStorage, tmp_path: Path) -> None:
    handle, _ = persisted(local_storage)
    seg = handle.segments[1]
    file = tmp_path / "dfs" / seg.path
    file.write_bytes(flip(file.read_bytes(), seg.offset + seg.length - 2))
    with pytest.raises(CorruptChangelogError) as exc_info:
        list(local_storage.read(handle))
    assert_corrupt(exc_info, seg.path)


def test_truncated_file_on_disk_is_detected_on_read(local_storage: StateChangelogStorage, tmp_path: Path) -> None:
    handle, _ = persisted(local_storage)
    seg = handle.segments[1]
    file = tmp_path / "dfs" / seg.path
    file.write_bytes(file.read_bytes()[: seg.offset + seg.length // 2])
    with pytest.raises(CorruptChangelogError) as exc_info:
        list(local_storage.read(handle))
    assert_corrupt(exc_info, seg.path)


def test_missing_file_is_reported_as_missing(local_storage: StateChangelogStorage, tmp_path: Path) -> None:
    handle, _ = persisted(local_storage)
    for path in handle.files:
        (tmp_path / "dfs" / path).unlink()
    with pytest.raises(CorruptChangelogError, match="file is missing") as exc_info:
        list(local_storage.read(handle))
    assert exc_info.value.path in handle.files


class _HeldReads(FsspecUploader):
    """Local reads of one segment (and whole reads of its file) block in their thread until the
    test releases them."""

    def __init__(self, base_path: Path, held: SegmentRef) -> None:
        super().__init__(str(base_path))
        self.held = held
        self.release = threading.Event()
        self.started = threading.Event()

    def _get_sync(self, full: str, offset: int, length: int | None) -> bytes:
        if full.endswith(self.held.path) and (offset == self.held.offset or length is None):
            self.started.set()
            self.release.wait(60)
        return super()._get_sync(full, offset, length)


def held_storage(tmp_path: Path) -> tuple[StateChangelogStorage, _HeldReads, ChangelogHandle]:
    """A storage over a persisted handle of two segments, the second one's read held."""
    config = ChangelogConfig.local(tmp_path / "dfs")
    with StateChangelogStorage(config, owns_files=False) as writing:
        handle, _ = persisted(writing)
    uploader = _HeldReads(tmp_path / "dfs", held=handle.segments[1])
    return StateChangelogStorage(config, uploader=uploader, owns_files=False), uploader, handle


@pytest.mark.parametrize("abandoned_by", ["a reader that met a corrupt segment", "a caller whose timeout passed"])
def test_close_leaves_no_task_pending_behind_abandoned_reads(
    tmp_path: Path, abandoned_by: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A read nobody awaits any more (a cancelled read-ahead fetch, which ends at once while its
    thread stays blocked; a ``run`` that timed out, which gets close's timeout to finish and is
    then cancelled) does not hold close: no task is left to be destroyed pending with the loop."""
    storage, uploader, handle = held_storage(tmp_path)
    first, second = handle.segments
    try:
        if abandoned_by.startswith("a reader"):
            shifted = dataclasses.replace(first, offset=first.offset + 1)
            corrupt = dataclasses.replace(handle, segments=(shifted, second))
            with pytest.raises(CorruptChangelogError):
                list(storage.read(corrupt))
        else:
            with pytest.raises(TimeoutError):  # a whole read: through the loop, unlike a ranged one
                storage.files.get(second.path, timeout=0.05)
        storage.close(timeout=0.2)
        assert not asyncio.all_tasks(storage._loop.loop)
        if abandoned_by.startswith("a caller"):
            assert "cancelling 1 task(s) still running after 0.2 s" in caplog.text
    finally:
        uploader.release.set()
        storage.close()


def test_calls_during_and_after_close_raise_storage_closed_instead_of_hanging(tmp_path: Path) -> None:
    """Once close has drained the uploads, a new call raises StorageClosedError (scheduled on a
    loop about to stop it would never run: a Spark progress listener hung on that), while what
    was started before is still waited for."""
    storage, uploader, handle = held_storage(tmp_path)
    held = handle.segments[1]
    expected = (tmp_path / "dfs" / held.path).read_bytes()[held.offset : held.offset + held.length]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        try:
            started = pool.submit(storage.files.read_range, held.path, held.offset, held.length)
            assert uploader.started.wait(10)
            closing = pool.submit(storage.close, 30)
            deadline = time.monotonic() + 30  # a guard against a hang, not a speed check
            with pytest.raises(StorageClosedError):
                while time.monotonic() < deadline:
                    with contextlib.suppress(FileNotFoundError):
                        storage.files.get("not-there")
        finally:
            uploader.release.set()
        assert started.result(30) == expected
        closing.result(30)
    with pytest.raises(StorageClosedError):
        storage.files.get("not-there")
    with pytest.raises(StorageClosedError):
        storage.files.list()
    with pytest.raises(StorageClosedError, match=f"read .*{re.escape(held.path)}: the changelog storage is closed"):
        storage.files.read_range(held.path, held.offset, held.length)  # not through the loop, named all the same


@pytest.mark.parametrize("bad_path", ["../x", "../../etc/passwd", "/etc/passwd", "dstl/../../x", "file:///etc/passwd"])
def test_handle_escaping_the_base_path_is_rejected(local_storage: StateChangelogStorage, bad_path: str) -> None:
    handle, _ = persisted(local_storage)
    segments = (dataclasses.replace(handle.segments[0], path=bad_path), *handle.segments[1:])
    with pytest.raises(CorruptChangelogError) as exc_info:
        list(local_storage.read(dataclasses.replace(handle, segments=segments)))
    assert_corrupt(exc_info, bad_path)


def test_handle_pointing_at_wrong_offset_sqn_or_log_is_rejected(local_storage: StateChangelogStorage) -> None:
    handle, _ = persisted(local_storage)
    first, second = handle.segments
    bad_handles = [
        dataclasses.replace(handle, segments=(dataclasses.replace(first, offset=first.offset + 1), second)),
        dataclasses.replace(handle, segments=(first, dataclasses.replace(second, offset=first.offset))),
        dataclasses.replace(handle, segments=(dataclasses.replace(first, sqn=2), dataclasses.replace(second, sqn=1))),
        dataclasses.replace(handle, log_id="another-log"),
        # segments outside the handle's (after, upto] range
        dataclasses.replace(handle, after=1),
        dataclasses.replace(handle, upto=1),
    ]
    for bad in bad_handles:
        with pytest.raises(CorruptChangelogError) as exc_info:
            list(local_storage.read(bad))
        assert exc_info.value.path in handle.files


def test_handle_json_round_trip(local_storage: StateChangelogStorage) -> None:
    handle, records = persisted(local_storage)
    text = handle.dumps()
    assert json.loads(text)["version"] == 1
    loaded = ChangelogHandle.loads(text)
    assert loaded == handle
    assert ChangelogHandle.from_json(handle.to_json()) == handle
    assert all(not s.path.startswith("/") for s in loaded.segments)
    assert list(local_storage.read(loaded)) == records
    assert list(local_storage.read(loaded, KeyGroupRange(3, 4))) == [(kg, p) for kg, p in records if 3 <= kg <= 4]


def _handle_json() -> dict[str, object]:
    seg = {"path": "dstl/00/f", "offset": 8, "length": 50, "sqn": 1, "records": 2, "key_groups": [0, 1]}
    return {"version": 1, "log_id": "op-1", "key_group_range": [0, 9], "after": 0, "upto": 1, "segments": [seg]}


def _without(key: str) -> dict[str, object]:
    value = _handle_json()
    del value[key]
    return value


def _with(**changes: object) -> dict[str, object]:
    value = _handle_json()
    value.update(changes)
    return value


def _with_segment(**changes: object) -> dict[str, object]:
    value = _handle_json()
    segment = dict(value["segments"][0])  # type: ignore[index]
    segment.update(changes)
    value["segments"] = [segment]
    return value


@pytest.mark.parametrize(
    "text",
    [
        "",
        "{",
        "not json",
        "[]",
        "null",
        "42",
        json.dumps(_with(version=2)),
        json.dumps(_without("version")),
        json.dumps(_without("log_id")),
        json.dumps(_without("segments")),
        json.dumps(_without("upto")),
        json.dumps(_with(after="0")),
        json.dumps(_with(key_group_range=[0])),
        json.dumps(_with(key_group_range=[0, 2**20])),
        json.dumps(_with(segments={})),
        json.dumps(_with_segment(offset=-1)),
        json.dumps(_with_segment(length=0)),
        json.dumps(_with_segment(path=7)),
        json.dumps(_with_segment(key_groups=[0])),
        json.dumps(_with(segments=[{"path": "dstl/00/f"}])),
    ],
)
def test_malformed_handle_json_raises_corrupt_changelog_error(text: str) -> None:
    with pytest.raises(CorruptChangelogError) as exc_info:
        ChangelogHandle.loads(text)
    assert "handle" in str(exc_info.value)


def test_well_formed_handle_json_parses() -> None:
    handle = ChangelogHandle.loads(json.dumps(_handle_json()))
    assert handle.log_id == "op-1"
    assert handle.key_group_range == KeyGroupRange(0, 9)
    assert handle.files == frozenset({"dstl/00/f"})
    assert handle.size == 50
