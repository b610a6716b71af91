"""Extreme values in files and handles raise the project's corruption error naming the file.

Huge integers, offsets and sizes, and nesting past the JSON parser's stack, must not escape as a
raw ``ValueError``, ``OverflowError``, ``MemoryError`` or ``RecursionError`` from deep inside a
decoder, nor be accepted (``after = 2**64`` used to pass). The damaged bytes carry valid
checksums, as a buggy writer or a hand edit would leave them.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.core.errors import StateRestoreError
from backend.core.handles import KeyedStateHandle
from benchmarks.support.faulty_fs import FaultPlan, faulty_base_path
from dstl import ChangelogConfig, ChangelogHandle, CorruptChangelogError, StateChangelogStorage
from dstl.format import SEGMENT_HEADER, SEGMENT_MAGIC, TRAILER, decode_segment, log_crc, read_footer
from dstl.types import KeyGroupRange
from materializer.chunks import CHUNK_TRAILER, chunk_info, encode_chunk
from materializer.errors import CorruptChunkError

PATH = "dstl/1/damaged"
DEEP = 100_000  # past any recursion limit


def handle_json(**changes: Any) -> dict[str, Any]:
    segment = {"path": PATH, "offset": 8, "length": 60, "sqn": 2, "records": 3, "key_groups": [0, 3]}
    segment.update(changes.pop("segment", {}))
    value = {"version": 1, "log_id": "op-0-3", "key_group_range": [0, 3], "after": 1, "upto": 2, "segments": [segment]}
    value.update(changes)
    return value


def test_a_valid_handle_parses() -> None:
    assert ChangelogHandle.from_json(handle_json()).upto == 2


@pytest.mark.parametrize(
    "changes",
    [
        {"after": 2**64},
        {"upto": 2**64},
        {"after": 5, "upto": 2},
        {"after": -1},
        {"segment": {"offset": 2**64}},
        {"segment": {"offset": 2**62}},  # below a seek's limit, past any file: the store would refuse it
        {"segment": {"offset": 2**40 - 59}},  # its 60 bytes end past the largest file
        {"segment": {"length": 2**40}},
        {"segment": {"sqn": 2**64}},
        {"segment": {"records": 2**32}},
        {"segment": {"key_groups": [0, 2**20]}},
    ],
)
def test_out_of_range_numbers_in_a_log_handle_are_refused(changes: dict[str, Any]) -> None:
    with pytest.raises(CorruptChangelogError, match="malformed handle"):
        ChangelogHandle.from_json(handle_json(**changes))


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(["after", "upto", "offset", "length", "sqn", "records"]),
    st.one_of(st.integers(max_value=-1), st.integers(min_value=2**64)),
)
def test_any_out_of_range_integer_in_a_log_handle_is_refused(field: str, value: int) -> None:
    changes: dict[str, Any] = {field: value} if field in ("after", "upto") else {"segment": {field: value}}
    with pytest.raises(CorruptChangelogError):
        ChangelogHandle.from_json(handle_json(**changes))


def test_a_segment_past_the_largest_file_is_refused_before_anything_is_read(tmp_path: Path) -> None:
    """A handle built in memory, not parsed, is checked by the reader the same way."""
    plan = FaultPlan()
    config = ChangelogConfig(base_path=faulty_base_path(tmp_path / "dfs", plan), retry_delay_ms=1)
    with StateChangelogStorage(config) as storage:
        writer = storage.create_writer("op", KeyGroupRange(0, 3))
        writer.append(1, b"change")
        handle = writer.persist_durably(0).result(30)
        (segment,) = handle.segments
        forged = dataclasses.replace(handle, segments=(dataclasses.replace(segment, offset=2**62),))
        with pytest.raises(CorruptChangelogError, match=rf"{segment.path}: .* past the largest changelog file"):
            list(storage.read(forged))
        assert plan.calls_of("get") == []


def test_deep_nesting_in_handles_is_corruption_not_a_recursion_error() -> None:
    deep = "[" * DEEP + "]" * DEEP
    with pytest.raises(CorruptChangelogError):
        ChangelogHandle.loads(deep)
    with pytest.raises(StateRestoreError):
        KeyedStateHandle.loads('{"version": 2, "states": ' + deep + "}")
    nested: Any = "x"
    for _ in range(50):
        nested = [nested]
    keyed = {
        "version": 2, "operator_id": "op", "checkpoint_id": 1, "max_parallelism": 8, "key_group_range": [0, 7],
        "states": {"count": {"kind": "value", "serializer": nested}}, "materialized": [], "changelog": [],
    }  # fmt: skip
    with pytest.raises(StateRestoreError, match="nested"):
        KeyedStateHandle.from_json(keyed)


def test_a_keyed_handle_with_a_log_after_2_pow_64_is_refused() -> None:
    keyed = {
        "version": 1, "operator_id": "op", "checkpoint_id": 1, "max_parallelism": 8, "key_group_range": [0, 3],
        "states": {}, "materialized": [], "changelog": [{"key_groups": [0, 3], "log": handle_json(after=2**64)}],
    }  # fmt: skip
    with pytest.raises(StateRestoreError, match="after"):
        KeyedStateHandle.from_json(keyed)


def test_a_deeply_nested_log_footer_names_the_file() -> None:
    footer = ("[" * DEEP + "]" * DEEP).encode()
    data = b"DSTL\x01\x00\x00\x00" + footer + TRAILER.pack(len(footer), zlib.crc32(footer), 1, b"LTSD")
    with pytest.raises(CorruptChangelogError) as info:
        read_footer(PATH, data)
    assert PATH in str(info.value)


def test_a_segment_whose_frame_states_a_huge_size_names_the_file() -> None:
    """python-zstandard allocates what a frame states: checked against the header before."""
    frame = struct.pack("<IB", 0xFD2FB528, 0b11100000) + struct.pack("<Q", 1 << 40) + b"\x01\x00\x00"
    head = SEGMENT_HEADER.pack(SEGMENT_MAGIC, 1, 0, 2, log_crc("op"), 16, len(frame), zlib.crc32(frame), 0)[:-4]
    blob = head + struct.pack("<I", zlib.crc32(head)) + frame
    with pytest.raises(CorruptChangelogError) as info:
        decode_segment(PATH, blob, log_id="op", sqn=2)
    assert PATH in str(info.value)


@pytest.mark.parametrize("field", [("sections", 0, "raw_length"), ("sections", 0, "count"), ("index", "raw_length")])
def test_a_chunk_footer_with_huge_numbers_names_the_file(field: tuple[str | int, ...]) -> None:
    data = encode_chunk(KeyGroupRange(0, 0), 1, {"s": [(b"\x00\x00k", b"v")]})
    index_len, footer_len, _, version, magic = CHUNK_TRAILER.unpack_from(data, len(data) - CHUNK_TRAILER.size)
    start = len(data) - CHUNK_TRAILER.size - footer_len
    footer = json.loads(data[start : len(data) - CHUNK_TRAILER.size])
    target = footer
    for part in field[:-1]:
        target = target[part]
    target[field[-1]] = 2**80
    body = json.dumps(footer).encode()
    damaged = data[:start] + body + CHUNK_TRAILER.pack(index_len, len(body), zlib.crc32(body), version, magic)
    with pytest.raises(CorruptChunkError) as info:
        chunk_info(PATH, damaged)
    assert PATH in str(info.value)
    assert "must be an int" in str(info.value)
