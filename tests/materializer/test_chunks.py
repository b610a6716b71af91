"""Materialized chunks of version 1 (the frozen writer of ``chunk_v1``): round trips, sub-range reads, and every
kind of damage raising an error naming the file; round trips of both versions and the encoder's input checks.

Version 2 (blocks and their index, point reads) is tested in ``test_chunk_blocks``.
"""

from __future__ import annotations

import copy
import json
import struct
import zlib
from collections.abc import Callable
from typing import Any

import pytest
import zstandard
from hypothesis import given
from hypothesis import strategies as st

from dstl.errors import ChangelogError
from dstl.format import encode_file
from dstl.types import MAX_KEY_GROUP, KeyGroupRange
from materializer.chunks import (
    CHUNK_HEADER,
    CHUNK_MAGIC,
    CHUNK_TRAILER_MAGIC,
    Chunk,
    CorruptChunkError,
    chunk_info,
    decode_chunk,
    encode_chunk,
    iter_chunk_entries,
)
from tests.materializer.chunk_v1 import CHUNK_TRAILER, encode_chunk_v1

V1 = 1
#: both writers: version 1 (frozen) and today's
WRITERS = pytest.mark.parametrize("write", [encode_chunk_v1, encode_chunk], ids=["v1", "v2"])
Writer = Callable[..., bytes]

PATH = "materialized/op-a/chunk-0003-0009.dmat"

Entries = list[tuple[bytes, bytes]]


def key(key_group: int, rest: bytes = b"") -> bytes:
    return key_group.to_bytes(2, "big") + rest


SAMPLE_RANGE = KeyGroupRange(3, 9)
SAMPLE: dict[str, Entries] = {
    "counts": [(key(3, b"a"), b"\x01" * 8), (key(3, b"b"), b""), (key(7), b"seven"), (key(9, b"zz"), b"v" * 40)],
    "empty": [],
    "timers": [(key(4, b"\x00\xff"), b"t1"), (key(8, b"\x00"), b"t2")],
}


@pytest.fixture(scope="module")
def sample() -> bytes:
    return encode_chunk_v1(SAMPLE_RANGE, 17, SAMPLE)


def flip(data: bytes, index: int, mask: int = 0x01) -> bytes:
    out = bytearray(data)
    out[index] ^= mask
    return bytes(out)


def assert_corrupt(exc_info: pytest.ExceptionInfo[CorruptChunkError], path: str = PATH) -> str:
    message = str(exc_info.value)
    assert path in message
    assert exc_info.value.path == path
    return message


def key_group_of(k: bytes) -> int:
    return int.from_bytes(k[:2], "big")


# -- round trips ----------------------------------------------------------------------------


def test_sample_round_trips(sample: bytes) -> None:
    assert sample.startswith(CHUNK_MAGIC) and sample.endswith(CHUNK_TRAILER_MAGIC)
    chunk = decode_chunk(PATH, sample)
    assert chunk == Chunk(SAMPLE_RANGE, 17, SAMPLE)
    assert list(chunk.sections) == ["counts", "empty", "timers"]


def test_chunk_info_reads_header_and_footer(sample: bytes) -> None:
    info = chunk_info(PATH, sample)
    assert info.version == V1
    assert info.key_groups == SAMPLE_RANGE and info.sqn == 17
    assert info.counts == {"counts": 4, "empty": 0, "timers": 2}
    assert info.entries == 6
    assert [(s.min_key_group, s.max_key_group) for s in info.sections] == [(3, 9), (0, -1), (4, 8)]
    payload = sum(len(k) + len(v) for entries in SAMPLE.values() for k, v in entries)
    assert info.raw_size == payload + sum(4 + 8 * len(entries) for entries in SAMPLE.values())
    assert info.compressed_size < len(sample)


def test_chunk_info_does_not_decompress_sections(sample: bytes) -> None:
    info = chunk_info(PATH, sample)
    damaged = flip(sample, info.sections[0].offset + 2)
    assert chunk_info(PATH, damaged) == info
    with pytest.raises(CorruptChunkError):
        decode_chunk(PATH, damaged)


@WRITERS
@pytest.mark.parametrize("key_groups", [KeyGroupRange(0, 9), KeyGroupRange.empty()])
def test_empty_chunk_round_trips(write: Writer, key_groups: KeyGroupRange) -> None:
    data = write(key_groups, 0, {})
    assert decode_chunk(PATH, data) == Chunk(key_groups, 0, {})
    assert chunk_info(PATH, data).sections == ()
    assert list(iter_chunk_entries(PATH, data, KeyGroupRange(0, MAX_KEY_GROUP))) == []


@WRITERS
def test_empty_sections_survive_even_in_an_empty_range(write: Writer) -> None:
    data = write(KeyGroupRange.empty(), 5, {"a": [], "b": []})
    assert decode_chunk(PATH, data).sections == {"a": [], "b": []}


@WRITERS
def test_encoding_is_deterministic_whatever_the_mapping_order(write: Writer) -> None:
    reordered = dict(reversed(SAMPLE.items()))
    assert write(SAMPLE_RANGE, 17, reordered) == write(SAMPLE_RANGE, 17, SAMPLE)


@WRITERS
def test_extreme_key_groups_and_fixed_and_variable_widths(write: Writer) -> None:
    full = KeyGroupRange(0, MAX_KEY_GROUP)
    sections = {
        "fixed": [(key(kg, b"x" * 11), kg.to_bytes(8, "little")) for kg in (0, 1, 2, MAX_KEY_GROUP)],
        "varied": [(key(0), b""), (key(0, b"\x00"), b"a" * 1000), (key(MAX_KEY_GROUP, b"\xff" * 9), b"b")],
    }
    data = write(full, 2**63, sections, level=19)
    assert decode_chunk(PATH, data) == Chunk(full, 2**63, sections)


@st.composite
def chunks(draw: st.DrawFn) -> tuple[KeyGroupRange, int, dict[str, Entries]]:
    start = draw(st.integers(0, MAX_KEY_GROUP))
    end = draw(st.integers(start - 1, min(MAX_KEY_GROUP, start + 50)))
    key_groups = KeyGroupRange(start, end)
    names = draw(st.lists(st.text(max_size=8), max_size=4, unique=True))
    sections: dict[str, Entries] = {}
    for name in names:
        keys: set[bytes] = set()
        if len(key_groups):
            keys = draw(st.sets(st.builds(key, st.integers(start, end), st.binary(max_size=6)), max_size=30))
        sections[name] = [(k, draw(st.binary(max_size=20))) for k in sorted(keys)]
    return key_groups, draw(st.integers(0, 2**64)), sections


@WRITERS
@given(chunks(), st.sampled_from([-5, 1, 3, 9]))
def test_any_chunk_round_trips(write: Writer, chunk: tuple[KeyGroupRange, int, dict[str, Entries]], level: int) -> None:
    key_groups, sqn, sections = chunk
    data = write(key_groups, sqn, sections, level=level)
    assert decode_chunk(PATH, data) == Chunk(key_groups, sqn, sections)
    info = chunk_info(PATH, data)
    assert info.counts == {name: len(entries) for name, entries in sections.items()}
    assert list(info.counts) == sorted(sections)


# -- sub-range iteration --------------------------------------------------------------------


def filtered(sections: dict[str, Entries], want: KeyGroupRange) -> list[tuple[str, bytes, bytes]]:
    return [(name, k, v) for name in sorted(sections) for k, v in sections[name] if key_group_of(k) in want]


@WRITERS
@given(chunks(), st.integers(0, MAX_KEY_GROUP), st.integers(-60, 60))
def test_sub_range_iteration_equals_filtering(
    write: Writer, chunk: tuple[KeyGroupRange, int, dict[str, Entries]], start: int, width: int
) -> None:
    key_groups, sqn, sections = chunk
    data = write(key_groups, sqn, sections)
    # a range near the chunk's most of the time, anywhere otherwise
    if key_groups.start <= MAX_KEY_GROUP and start % 3:
        start = min(MAX_KEY_GROUP, key_groups.start + start % 40)
    want = KeyGroupRange(start, max(start - 1, min(MAX_KEY_GROUP, start + width)))
    assert list(iter_chunk_entries(PATH, data, want)) == filtered(sections, want)


@WRITERS
def test_sub_range_iteration_of_a_dense_chunk(write: Writer) -> None:
    key_groups = KeyGroupRange(10, 19)
    sections = {
        "a": [(key(kg, i.to_bytes(2, "big")), bytes([i % 256]) * (i % 5)) for kg in key_groups for i in range(50)],
        "b": [(key(kg), b"only") for kg in (12, 13)],
    }
    data = write(key_groups, 1, sections)
    for lo in range(8, 22):
        for hi in range(lo - 1, 22):
            want = KeyGroupRange(lo, hi)
            assert list(iter_chunk_entries(PATH, data, want)) == filtered(sections, want), want


def test_iteration_checks_header_and_footer_at_once(sample: bytes) -> None:
    with pytest.raises(CorruptChunkError) as exc_info:
        iter_chunk_entries(PATH, flip(sample, len(sample) - CHUNK_TRAILER.size - 3), SAMPLE_RANGE)
    assert "footer" in assert_corrupt(exc_info)


def test_iteration_checks_every_checksum_at_once(sample: bytes) -> None:
    timers = chunk_info(PATH, sample).sections[2]
    damaged = flip(sample, timers.offset + timers.length - 1)
    # key group 9 only appears in "counts", but the damaged "timers" section is still noticed
    with pytest.raises(CorruptChunkError) as exc_info:
        iter_chunk_entries(PATH, damaged, KeyGroupRange(9, 9))
    assert "'timers' checksum mismatch" in assert_corrupt(exc_info)


def test_iteration_decompresses_only_the_sections_it_reads(sample: bytes) -> None:
    # a checksummed but undecompressable "timers" section: only noticed by reads that need it
    footer, blobs = split_chunk(sample)
    blobs[2] = b"not zstd"
    data = assemble(footer, blobs)
    assert list(iter_chunk_entries(PATH, data, KeyGroupRange(9, 9))) == [("counts", key(9, b"zz"), b"v" * 40)]
    entries = iter_chunk_entries(PATH, data, KeyGroupRange(3, 4))
    with pytest.raises(CorruptChunkError) as exc_info:
        list(entries)
    assert "'timers' is not a zstd frame" in assert_corrupt(exc_info)


# -- invalid input to the encoder -----------------------------------------------------------


@pytest.mark.parametrize(
    ("key_groups", "entries", "problem"),
    [
        ((3, 9), [(key(4, b"b"), b""), (key(4, b"a"), b"")], "not strictly increasing at entry 1"),
        ((3, 9), [(key(4, b"a"), b"1"), (key(4, b"a"), b"2")], "not strictly increasing at entry 1"),
        ((3, 9), [(key(4), b""), (key(6), b""), (key(5), b"")], "not strictly increasing at entry 2"),
        ((3, 9), [(key(2, b"x"), b"")], "key group 2, outside the chunk's range [3, 9]"),
        ((3, 9), [(key(4), b""), (key(10), b"")], "key group 10, outside the chunk's range [3, 9]"),
        ((3, 9), [(b"\x00", b"")], "key 0 (b'\\x00') is shorter than its key-group prefix"),
        ((3, 9), [(b"", b"")], "shorter than its key-group prefix"),
        # a key too short to hold a key group, in the middle of sorted keys
        ((0, 300), [(b"\x00\x03\xff", b""), (b"\x01", b""), (b"\x01\x00\x00", b"")], "key 1 (b'\\x01') is shorter"),
    ],
)
def test_encoder_rejects_unsorted_or_out_of_range_keys(
    key_groups: tuple[int, int], entries: Entries, problem: str
) -> None:
    with pytest.raises(ValueError, match="section 'bad'") as exc_info:
        encode_chunk(KeyGroupRange(*key_groups), 1, {"ok": [], "bad": entries})
    assert problem in str(exc_info.value)


def test_encoder_rejects_entries_in_an_empty_range() -> None:
    with pytest.raises(ValueError, match="outside the chunk's range"):
        encode_chunk(KeyGroupRange.empty(), 1, {"s": [(key(0), b"")]})


@pytest.mark.parametrize("sqn", [-1, True, 1.5])
def test_encoder_rejects_bad_sqn(sqn: Any) -> None:
    with pytest.raises(ValueError, match="sqn"):
        encode_chunk(SAMPLE_RANGE, sqn, {})


def test_encoder_rejects_non_string_names() -> None:
    with pytest.raises(ValueError, match="names must be str"):
        encode_chunk(SAMPLE_RANGE, 1, {b"s": []})  # type: ignore[dict-item]


# -- damaged bytes --------------------------------------------------------------------------


def test_error_type_and_message() -> None:
    error = CorruptChunkError(PATH, "something")
    assert isinstance(error, ChangelogError)
    assert str(error) == f"corrupt materialized chunk {PATH}: something"
    assert (error.path, error.problem) == (PATH, "something")


@pytest.mark.parametrize("mask", [0x01, 0x80, 0xFF])
def test_every_flipped_byte_is_detected(sample: bytes, mask: int) -> None:
    for index in range(len(sample)):
        with pytest.raises(CorruptChunkError) as exc_info:
            decode_chunk(PATH, flip(sample, index, mask))
        assert_corrupt(exc_info)
        with pytest.raises(CorruptChunkError):
            list(iter_chunk_entries(PATH, flip(sample, index, mask), SAMPLE_RANGE))


def test_every_flipped_bit_of_header_footer_and_trailer_is_caught_by_chunk_info(sample: bytes) -> None:
    info = chunk_info(PATH, sample)
    body_end = info.sections[-1].offset + info.sections[-1].length
    for index in [*range(CHUNK_HEADER.size), *range(body_end, len(sample))]:
        for bit in range(8):
            with pytest.raises(CorruptChunkError) as exc_info:
                chunk_info(PATH, flip(sample, index, 1 << bit))
            assert_corrupt(exc_info)


def test_truncated_at_every_length(sample: bytes) -> None:
    for cut in range(len(sample)):
        with pytest.raises(CorruptChunkError) as exc_info:
            decode_chunk(PATH, sample[:cut])
        assert_corrupt(exc_info)


@pytest.mark.parametrize("damage", [lambda d: d + b"\x00", lambda d: b"\x00" + d, lambda d: d + d, lambda d: d[1:]])
def test_extra_or_missing_bytes_at_either_end(sample: bytes, damage: Callable[[bytes], bytes]) -> None:
    with pytest.raises(CorruptChunkError) as exc_info:
        decode_chunk(PATH, damage(sample))
    assert_corrupt(exc_info)


def test_file_of_a_future_version_is_named(sample: bytes) -> None:
    future = 3
    footer, blobs = split_chunk(sample)
    footer["version"] = future
    data = assemble(footer, blobs, version=future)
    for read in (decode_chunk, chunk_info):
        with pytest.raises(CorruptChunkError) as exc_info:
            read(PATH, data)
        message = assert_corrupt(exc_info)
        assert f"unsupported chunk format version {future}" in message
        assert "this reader knows 1 and 2" in message


def test_unknown_header_flags(sample: bytes) -> None:
    footer, blobs = split_chunk(sample)
    with pytest.raises(CorruptChunkError) as exc_info:
        decode_chunk(PATH, assemble(footer, blobs, flags=0x0001))
    assert "flags 0x0001" in assert_corrupt(exc_info)


def test_changelog_file_is_not_a_chunk() -> None:
    data, _ = encode_file([])
    with pytest.raises(CorruptChunkError) as exc_info:
        decode_chunk(PATH, data)
    assert "not a materialized chunk (magic b'DSTL')" in assert_corrupt(exc_info)


@given(st.binary(max_size=200))
def test_garbage_is_not_a_chunk(garbage: bytes) -> None:
    for data in (garbage, CHUNK_MAGIC + garbage, CHUNK_HEADER.pack(CHUNK_MAGIC, 1, 0) + garbage):
        with pytest.raises(CorruptChunkError) as exc_info:
            decode_chunk(PATH, data)
        assert_corrupt(exc_info)


# -- checksummed but inconsistent (a buggy or hostile writer) -------------------------------


def split_chunk(data: bytes) -> tuple[dict[str, Any], list[bytes]]:
    footer_len = struct.unpack_from("<I", data, len(data) - CHUNK_TRAILER.size)[0]
    footer_end = len(data) - CHUNK_TRAILER.size
    footer: dict[str, Any] = json.loads(data[footer_end - footer_len : footer_end])
    return footer, [data[s["offset"] : s["offset"] + s["length"]] for s in footer["sections"]]


def assemble(footer: Any, blobs: list[bytes], *, version: int = V1, flags: int = 0) -> bytes:
    """A chunk with valid checksums: the sections' offsets, lengths and crcs are recomputed for ``blobs``."""
    if isinstance(footer, dict):
        offset = CHUNK_HEADER.size
        for section, blob in zip(footer["sections"], blobs, strict=True):
            section.update(offset=offset, length=len(blob), crc32=zlib.crc32(blob))
            offset += len(blob)
    text = footer if isinstance(footer, bytes) else json.dumps(footer, separators=(",", ":")).encode()
    return b"".join(
        (
            CHUNK_HEADER.pack(CHUNK_MAGIC, version, flags),
            *blobs,
            text,
            CHUNK_TRAILER.pack(len(text), zlib.crc32(text), version, CHUNK_TRAILER_MAGIC),
        )
    )


def columns(keys: list[bytes], values: list[bytes], count: int | None = None) -> bytes:
    n = len(keys) if count is None else count
    lengths = [len(k) for k in keys] + [len(v) for v in values]
    return struct.pack(f"<I{len(lengths)}I", n, *lengths) + b"".join(keys) + b"".join(values)


def with_section(sample: bytes, raw: bytes, *, frame: bytes | None = None, **fields: Any) -> bytes:
    """The sample with section "counts" replaced by ``raw`` (compressed unless ``frame`` is given)."""
    footer, blobs = split_chunk(sample)
    blobs[0] = zstandard.ZstdCompressor().compress(raw) if frame is None else frame
    footer["sections"][0]["raw_length"] = len(raw)
    footer["sections"][0].update(fields)
    return assemble(footer, blobs)


COUNTS_KEYS = [k for k, _ in SAMPLE["counts"]]
COUNTS_VALUES = [v for _, v in SAMPLE["counts"]]
#: keys and values of one length each: a block of them is read by multiplication, not by summing lengths
FIXED_KEYS = [key(3, b"a"), key(3, b"b"), key(7, b"c"), key(9, b"z")]
FIXED_VALUES = [b"12345678"] * 4


def test_reassembled_sample_still_decodes(sample: bytes) -> None:
    footer, blobs = split_chunk(sample)
    assert assemble(copy.deepcopy(footer), blobs) == sample
    assert decode_chunk(PATH, with_section(sample, columns(COUNTS_KEYS, COUNTS_VALUES))).sections == SAMPLE


@pytest.mark.parametrize(
    ("build", "problem"),
    [
        (lambda: columns(COUNTS_KEYS, COUNTS_VALUES, count=5), "holds 5 entries, the footer says 4"),
        (lambda: columns(COUNTS_KEYS, COUNTS_VALUES) + b"x", "entry lengths do not add up"),
        (lambda: columns(COUNTS_KEYS, COUNTS_VALUES)[:-1], "entry lengths do not add up"),
        (lambda: columns(COUNTS_KEYS[::-1], COUNTS_VALUES), "keys not strictly increasing"),
        (lambda: columns([*COUNTS_KEYS[:3], COUNTS_KEYS[2]], COUNTS_VALUES), "keys not strictly increasing"),
        (lambda: columns([b"\x00", *COUNTS_KEYS[1:]], COUNTS_VALUES), "shorter than its key-group prefix"),
        (
            lambda: columns([key(4, b"a"), key(4, b"b"), *COUNTS_KEYS[2:]], COUNTS_VALUES),
            "key groups differ from the footer's bounds",
        ),
        (lambda: columns([*COUNTS_KEYS[:3], key(8)], COUNTS_VALUES), "key groups differ from the footer's bounds"),
        (lambda: columns(FIXED_KEYS, FIXED_VALUES) + b"x", "entry lengths do not add up"),
        (lambda: columns(FIXED_KEYS, FIXED_VALUES)[:-1], "entry lengths do not add up"),
        (lambda: columns(FIXED_KEYS, FIXED_VALUES, count=3), "holds 3 entries, the footer says 4"),
        (lambda: columns(FIXED_KEYS[::-1], FIXED_VALUES), "keys not strictly increasing"),
        (lambda: columns([b"\x01", b"\x02", b"\x03", b"\x04"], FIXED_VALUES), "shorter than its key-group prefix"),
    ],
)
def test_checksummed_but_inconsistent_columns(sample: bytes, build: Callable[[], bytes], problem: str) -> None:
    data = with_section(sample, build())
    with pytest.raises(CorruptChunkError) as exc_info:
        decode_chunk(PATH, data)
    assert problem in assert_corrupt(exc_info)
    for want in (SAMPLE_RANGE, KeyGroupRange(3, 3), KeyGroupRange(7, 7), KeyGroupRange(9, 9)):
        with pytest.raises(CorruptChunkError) as exc_info:
            list(iter_chunk_entries(PATH, data, want))
        assert_corrupt(exc_info)
    index = chunk_info(PATH, data)
    section = index.table("counts")
    assert section is not None
    (block,) = section.blocks
    for keys in (FIXED_KEYS, COUNTS_KEYS):  # point reads: keys of one length (or not) found by their bytes
        with pytest.raises(CorruptChunkError) as exc_info:
            index.point_entries([block], [data[block.offset : block.offset + block.length]], keys)
        message = assert_corrupt(exc_info)  # keys out of order are seen at the block's ends here
        assert problem in message or (problem == "keys not strictly increasing" and "key groups differ" in message)


def test_checksummed_but_unsorted_keys_near_a_cut_are_caught_by_sub_range_reads(sample: bytes) -> None:
    swapped = [COUNTS_KEYS[0], COUNTS_KEYS[2], COUNTS_KEYS[1], COUNTS_KEYS[3]]
    data = with_section(sample, columns(swapped, COUNTS_VALUES))
    with pytest.raises(CorruptChunkError, match="not strictly increasing"):
        list(iter_chunk_entries(PATH, data, KeyGroupRange(3, 3)))


def test_frame_stating_another_size_is_rejected_before_decompressing(sample: bytes) -> None:
    raw = columns(COUNTS_KEYS, COUNTS_VALUES)
    for raw_length in (len(raw) - 1, len(raw) + 1, 2**40):
        with pytest.raises(CorruptChunkError) as exc_info:
            decode_chunk(PATH, with_section(sample, raw, raw_length=raw_length))
        assert "frame states" in assert_corrupt(exc_info)


@pytest.mark.parametrize(
    ("frame", "problem"),
    [
        (b"definitely not zstd", "not a zstd frame"),
        (zstandard.ZstdCompressor(write_content_size=False).compress(b"x" * 40), "frame states -1 bytes"),
        (zstandard.ZstdCompressor().compress(b"x" * 40) + b"extra", "does not decompress"),
        (zstandard.ZstdCompressor().compress(b"x" * 40)[:-3], "does not decompress"),
    ],
)
def test_checksummed_section_that_is_not_one_whole_frame(sample: bytes, frame: bytes, problem: str) -> None:
    with pytest.raises(CorruptChunkError) as exc_info:
        decode_chunk(PATH, with_section(sample, b"x" * 40, frame=frame, count=0, key_groups=[0, -1]))
    assert problem in assert_corrupt(exc_info)


def _footer_cases() -> list[tuple[Callable[[dict[str, Any]], Any], str]]:
    def set_(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], Any]:
        def change(footer: dict[str, Any]) -> Any:
            target: Any = footer
            for part in path[:-1]:
                target = target[part]
            target[path[-1]] = value
            return footer

        return change

    def delete(name: str) -> Callable[[dict[str, Any]], Any]:
        return lambda footer: {k: v for k, v in footer.items() if k != name}

    def sections(change: Callable[[list[Any]], Any]) -> Callable[[dict[str, Any]], Any]:
        return lambda footer: {**footer, "sections": change(footer["sections"])}

    return [
        (lambda f: b"not json", "malformed footer"),
        (lambda f: b"\xff\xfe", "malformed footer"),
        (lambda f: b"[" * 100_000 + b"]" * 100_000, "malformed footer"),
        (lambda f: [], "footer is not an object"),
        (delete("version"), "'version'"),
        (delete("key_groups"), "'key_groups'"),
        (delete("sqn"), "'sqn'"),
        (delete("sections"), "'sections'"),
        (set_(("version",), 2), "footer version 2 differs"),
        (set_(("version",), True), "footer version True differs"),
        (set_(("sqn",), -1), "sqn must be an int"),
        (set_(("sqn",), "17"), "sqn must be an int"),
        (set_(("key_groups",), [3]), "not a key group range"),
        (set_(("key_groups",), [3, 2**15]), "outside"),
        (set_(("key_groups",), [4, 9]), "key groups [3, 9] outside the chunk's range"),
        (set_(("key_groups",), [3, 8]), "key groups [3, 9] outside the chunk's range"),
        (set_(("sections",), {}), "sections is not a list"),
        (set_(("sections", 0), "counts"), "section 0 is not an object"),
        (set_(("sections", 0, "name"), 7), "section 0 name is not a string"),
        (set_(("sections", 2, "name"), "counts"), "section 'counts' appears twice"),
        (set_(("sections", 0, "count"), -1), "count must be an int"),
        (set_(("sections", 0, "count"), 2**32), "count must be an int"),
        (set_(("sections", 0, "count"), 10**6), "raw_length must be an int"),
        (set_(("sections", 0, "crc32"), 2**32), "crc32 must be an int"),
        (set_(("sections", 0, "key_groups"), [2, 9]), "outside the chunk's range"),
        (set_(("sections", 0, "key_groups"), [9, 3]), "outside the chunk's range"),
        (set_(("sections", 0, "key_groups"), None), "not a key group range"),
        (set_(("sections", 1, "key_groups"), [3, 3]), "empty section 'empty' has key groups [3, 3]"),
        (sections(lambda s: s[:2]), "sections end at byte"),
        (sections(lambda s: [s[1], s[0], s[2]]), "at offset"),
        (sections(lambda s: []), "sections end at byte 8"),
    ]


@pytest.mark.parametrize(("change", "problem"), _footer_cases())
def test_checksummed_but_malformed_footer(sample: bytes, change: Callable[[dict[str, Any]], Any], problem: str) -> None:
    footer, blobs = split_chunk(sample)
    text = change(footer)
    data = assemble(text if isinstance(text, bytes) else json.dumps(text).encode(), blobs)
    for read in (chunk_info, decode_chunk):
        with pytest.raises(CorruptChunkError) as exc_info:
            read(PATH, data)
        message = assert_corrupt(exc_info)
        assert "malformed footer" in message
        assert problem in message


@pytest.mark.parametrize(("field", "value"), [("offset", 9), ("length", 1), ("length", 0), ("offset", "8")])
def test_sections_must_tile_the_body(sample: bytes, field: str, value: Any) -> None:
    footer, blobs = split_chunk(sample)
    footer["sections"][0][field] = value
    text = json.dumps(footer).encode()
    data = assemble(text, blobs)
    with pytest.raises(CorruptChunkError) as exc_info:
        chunk_info(PATH, data)
    assert "malformed footer" in assert_corrupt(exc_info)


def test_footer_length_pointing_before_the_header(sample: bytes) -> None:
    patched = bytearray(sample)
    struct.pack_into("<I", patched, len(sample) - CHUNK_TRAILER.size, len(sample))
    with pytest.raises(CorruptChunkError) as exc_info:
        chunk_info(PATH, bytes(patched))
    assert "points outside the file" in assert_corrupt(exc_info)
