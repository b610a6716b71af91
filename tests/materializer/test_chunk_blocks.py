"""Chunks of version 2: blocks and their index, whole reads, point reads from the tail, and damage.

A point read (what the lazy restore does) reads a chunk's tail (``read_chunk_index``), looks a key
prefix up (``blocks_for``), reads those blocks with one ranged read and decodes them
(``decode_block``); it must find exactly what a filter of the whole chunk finds, and refuse any
damaged byte it reads with ``CorruptChunkError`` naming the file.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from dstl.types import MAX_KEY_GROUP, KeyGroupRange
from materializer.blocks import prefix_end, span
from materializer.chunks import (
    BLOCK_SIZE,
    CHUNK_HEADER,
    CHUNK_MAGIC,
    CHUNK_TRAILER,
    CHUNK_TRAILER_MAGIC,
    TAIL_READ_BYTES,
    Chunk,
    ChunkIndex,
    CorruptChunkError,
    chunk_info,
    decode_chunk,
    encode_chunk,
    iter_chunk_entries,
    read_chunk_index,
)
from tests.materializer.chunk_v1 import encode_chunk_v1

PATH = "shared/pack-7.chunks#chunk-0003-0009"
Entries = list[tuple[bytes, bytes]]
FIXTURES = Path(__file__).parents[1] / "fixtures"


def key(key_group: int, rest: bytes = b"") -> bytes:
    return key_group.to_bytes(2, "big") + rest


def key_group_of(k: bytes) -> int:
    return int.from_bytes(k[:2], "big")


RANGE = KeyGroupRange(3, 9)


def map_like(key_group: int, user_key: bytes, entries: int, value_size: int = 20) -> Entries:
    """The entries of one map state's key: composite key = key group | key | user key."""
    return [(key(key_group, b"\x00\x05" + user_key + i.to_bytes(4, "big")), b"v" * value_size) for i in range(entries)]


SECTIONS: dict[str, Entries] = {
    "counts": [(key(kg, i.to_bytes(3, "big")), i.to_bytes(8, "little")) for kg in (3, 4, 7, 9) for i in range(300)],
    "empty": [],
    "huge": [(key(5, b"a"), b"small"), (key(5, b"b"), bytes(range(256)) * 40), (key(6), b"")],
    "map": sorted(map_like(4, b"alice", 400) + map_like(4, b"bob", 3) + map_like(8, b"carol", 250)),
    "timers": [(key(4, b"\x00\xff"), b"t1"), (key(8, b"\x00"), b"t2")],
}
SMALL = 1024  # block size of the sample: many blocks per section


@pytest.fixture(scope="module")
def sample() -> bytes:
    return encode_chunk(RANGE, 17, SECTIONS, block_size=SMALL)


def reader(data: bytes, reads: list[tuple[int, int]] | None = None) -> Callable[[int, int], bytes]:
    def read(offset: int, length: int) -> bytes:
        assert offset >= 0 and offset + length <= len(data)
        if reads is not None:
            reads.append((offset, length))
        return data[offset : offset + length]

    return read


def point_read(data: bytes, index: ChunkIndex, table: str, prefix: bytes) -> Entries:
    """What a lazy restore does for one key: its blocks with one ranged read, decoded, filtered."""
    section = index.table(table)
    assert section is not None
    blocks = section.blocks_for(prefix)
    if not blocks:
        return []
    offset, length = span(blocks)
    fetched = memoryview(data)[offset : offset + length]
    entries, matching = [], []
    for block in blocks:
        data = fetched[block.offset - offset : block.offset - offset + block.length]
        entries += index.decode_block(data, block)
        matching += index.decode_block(data, block, prefix)  # slices out only the key's entries
    wanted = [(k, v) for k, v in entries if k.startswith(prefix)]
    assert matching == wanted
    return wanted


def flip(data: bytes, index: int, mask: int = 0x01) -> bytes:
    out = bytearray(data)
    out[index] ^= mask
    return bytes(out)


def assert_corrupt(exc_info: pytest.ExceptionInfo[CorruptChunkError]) -> str:
    assert exc_info.value.path == PATH
    assert PATH in str(exc_info.value)
    return exc_info.value.problem


# -- the layout -----------------------------------------------------------------------------


def test_sections_are_cut_into_blocks_of_at_most_the_block_size(sample: bytes) -> None:
    index = chunk_info(PATH, sample)
    assert index.version == 2 and index.key_groups == RANGE and index.sqn == 17
    assert index.counts == {name: len(entries) for name, entries in SECTIONS.items()}
    by_name = {s.name: s for s in index.sections}
    assert by_name["counts"].block_count > 10 and by_name["map"].block_count > 10
    assert by_name["empty"].block_count == 0 and by_name["empty"].blocks_for(key(5)) == []
    for section in index.sections:
        blocks = section.blocks
        assert sum(b.count for b in blocks) == section.count
        assert sum(b.length for b in blocks) == section.length
        for block in blocks:
            assert block.raw_length <= SMALL or block.count == 1
        entries = SECTIONS[section.name]
        starts = [sum(b.count for b in blocks[:i]) for i in range(len(blocks))]
        assert [b.first_key for b in blocks] == [entries[i][0] for i in starts]
        offsets = [b.offset for b in blocks]
        assert offsets == sorted(offsets) and (not blocks or offsets[0] == section.offset)
    huge = by_name["huge"].blocks
    assert [b.count for b in huge] == [1, 1, 1]  # the value larger than a block has a block of its own


def test_the_default_block_size_is_what_the_writer_uses() -> None:
    entries = [(key(0, i.to_bytes(4, "big")), b"x" * 100) for i in range(3 * BLOCK_SIZE // 100)]
    index = chunk_info(PATH, encode_chunk(KeyGroupRange(0, 0), 1, {"s": entries}))
    blocks = index.sections[0].blocks
    assert len(blocks) > 1 and all(b.raw_length <= BLOCK_SIZE for b in blocks)
    assert blocks[0].raw_length > BLOCK_SIZE * 0.9  # filled to near the size


def test_whole_reads_equal_what_was_written(sample: bytes) -> None:
    assert decode_chunk(PATH, sample) == Chunk(RANGE, 17, SECTIONS)
    index = chunk_info(PATH, sample)
    for section in index.sections:
        offset, length = section.byte_range
        assert index.decode_section(sample[offset : offset + length], section.name) == SECTIONS[section.name]
    assert index.decode_section(b"", "no such state") == []


@st.composite
def chunks(draw: st.DrawFn) -> tuple[KeyGroupRange, dict[str, Entries], int]:
    start = draw(st.integers(0, MAX_KEY_GROUP))
    end = draw(st.integers(start - 1, min(MAX_KEY_GROUP, start + 20)))
    key_groups = KeyGroupRange(start, end)
    sections: dict[str, Entries] = {}
    for name in draw(st.lists(st.text(max_size=5), max_size=3, unique=True)):
        keys: set[bytes] = set()
        fixed = draw(st.booleans())  # keys (and values) of one length: a point read finds them by multiplication
        if len(key_groups):
            rest = (
                st.binary(min_size=4, max_size=4)
                if fixed
                else st.binary(max_size=5)
                | st.builds(lambda b, n: b * n, st.binary(min_size=1, max_size=2), st.integers(1, 60))
            )
            keys = draw(st.sets(st.builds(key, st.integers(start, end), rest), max_size=60))
        values = (
            st.binary(min_size=8, max_size=8) | st.binary(max_size=30)
            if fixed
            else st.binary(max_size=30) | st.binary(min_size=300, max_size=700)
        )
        if fixed and draw(st.booleans()):
            values = st.just(draw(st.binary(max_size=9)))
        sections[name] = [(k, draw(values)) for k in sorted(keys)]
    return key_groups, sections, draw(st.sampled_from([1, 20, 64, 256, 1000, BLOCK_SIZE]))


@given(chunks(), st.data())
@settings(max_examples=150)
def test_any_chunk_round_trips_and_every_point_read_equals_a_filter(
    chunk: tuple[KeyGroupRange, dict[str, Entries], int], data: st.DataObject
) -> None:
    key_groups, sections, block_size = chunk
    encoded = encode_chunk(key_groups, 5, sections, block_size=block_size)
    assert decode_chunk(PATH, encoded) == Chunk(key_groups, 5, sections)
    index = read_chunk_index(
        PATH, len(encoded), reader(encoded), tail_bytes=data.draw(st.sampled_from([1, 100, 10**6]))
    )
    assert index == chunk_info(PATH, encoded)
    every = [k for entries in sections.values() for k, _ in entries]
    for name, entries in sections.items():
        prefixes = [b"", key(key_groups.start), key(max(key_groups.end, 0)), b"\xff\xff\xff"]
        if every:  # cut from keys of any state: a prefix of this one's, or another state's key
            for k in data.draw(st.lists(st.sampled_from(every), max_size=8)):
                prefixes.append(k[: data.draw(st.integers(0, len(k)))])
        prefixes += data.draw(st.lists(st.binary(max_size=5), max_size=3))
        for prefix in prefixes:
            assert point_read(encoded, index, name, prefix) == [(k, v) for k, v in entries if k.startswith(prefix)]
        chosen = {k for k, _ in entries if data.draw(st.booleans())}  # a batch's keys, read at once: as
        keys = sorted(k for k in chosen if not any(o != k and o.startswith(k) for o in chosen))  # ckeys, none a prefix
        section = index.table(name)
        if keys and section is not None:
            found = []
            for block in section.blocks:
                found += index.point_entries([block], [encoded[block.offset : block.offset + block.length]], keys)
            assert found == [(k, v) for k, v in entries if any(k.startswith(p) for p in keys)]


def test_a_key_whose_bytes_straddle_two_keys_of_one_length_is_not_found_there() -> None:
    """A point read of a whole key in a block of keys of one length searches the keys' bytes: the
    end of one key and the start of the next may spell the key wanted, which is not there."""
    before, wanted, after = key(3, b"\x00\x00\x00\x03"), key(3, b"\x00\x03\x11\x22"), key(3, b"\x11\x22\x33\x44")
    assert (before + after)[4:10] == wanted  # the two keys' bytes spell it, across their boundary
    for keys in ([before, after], [before, wanted, after]):
        entries = [(k, bytes([i]) * 8) for i, k in enumerate(keys)]
        encoded = encode_chunk(RANGE, 5, {"values": entries})
        index = chunk_info(PATH, encoded)
        expected = [(k, v) for k, v in entries if k == wanted]
        assert point_read(encoded, index, "values", wanted) == expected
        section = index.table("values")
        assert section is not None
        (block,) = section.blocks
        data = encoded[block.offset : block.offset + block.length]
        assert index.point_entries([block], [data], [wanted, after]) == [*expected, entries[-1]]


def test_a_map_keys_entries_spanning_blocks_are_all_found(sample: bytes) -> None:
    index = chunk_info(PATH, sample)
    section = index.table("map")
    assert section is not None
    alice = key(4, b"\x00\x05alice")
    blocks = section.blocks_for(alice)
    assert len(blocks) > 5
    assert [b.number for b in blocks] == list(range(blocks[0].number, blocks[-1].number + 1))
    assert all(b.first_key is not None and b.first_key.startswith(alice) for b in blocks[1:])  # no block to spare
    assert point_read(sample, index, "map", alice) == [e for e in SECTIONS["map"] if e[0].startswith(alice)]
    bob = key(4, b"\x00\x05bob")
    assert point_read(sample, index, "map", bob) == map_like(4, b"bob", 3)
    assert len(section.blocks_for(key(4, b"\x00\x05bob\x00\x00\x00\x01"))) == 1


def test_a_missing_key_costs_at_most_one_block(sample: bytes) -> None:
    index = chunk_info(PATH, sample)
    section = index.table("counts")
    assert section is not None
    assert len(section.blocks_for(key(5))) == 1  # the block whose range holds where the key would be
    assert section.blocks_for(key(2)) == [] and section.blocks_for(key(10)) == []  # outside the key groups
    assert len(section.blocks_for(key(3, b"\x00\x00\x05\x00"))) == 1
    assert point_read(sample, index, "counts", key(3, b"\x00\x00\x05\x00")) == []


@pytest.mark.parametrize(
    ("prefix", "end"),
    [(b"", None), (b"\xff", None), (b"a", b"b"), (b"a\xff\xff", b"b"), (b"\x00\x01\xff", b"\x00\x02")],
)
def test_prefix_end(prefix: bytes, end: bytes | None) -> None:
    assert prefix_end(prefix) == end


@given(chunks(), st.integers(0, MAX_KEY_GROUP), st.integers(-3, 25))
@settings(max_examples=100)
def test_sub_range_reads_decompress_only_wanted_blocks_and_equal_a_filter(
    chunk: tuple[KeyGroupRange, dict[str, Entries], int], start: int, width: int
) -> None:
    key_groups, sections, block_size = chunk
    encoded = encode_chunk(key_groups, 5, sections, block_size=block_size)
    if key_groups.start <= MAX_KEY_GROUP and start % 3:
        start = min(MAX_KEY_GROUP, key_groups.start + start % 20)
    want = KeyGroupRange(start, max(start - 1, min(MAX_KEY_GROUP, start + width)))
    expected = [(n, k, v) for n in sorted(sections) for k, v in sections[n] if key_group_of(k) in want]
    assert list(iter_chunk_entries(PATH, encoded, want)) == expected


def test_a_partly_owned_chunk_decompresses_only_the_blocks_it_needs(sample: bytes) -> None:
    parts = split(sample)
    counts = parts.footer["sections"][0]
    assert counts["name"] == "counts"
    last = len(parts.blocks[0]) - 1  # a block of key group 9 only
    parts.blocks[0][last] = b"checksummed, but no zstd frame"
    damaged = assemble(parts)
    wanted = list(iter_chunk_entries(PATH, damaged, KeyGroupRange(3, 4)))
    assert wanted == [(n, k, v) for n in sorted(SECTIONS) for k, v in SECTIONS[n] if key_group_of(k) in (3, 4)]
    with pytest.raises(CorruptChunkError) as exc_info:
        list(iter_chunk_entries(PATH, damaged, KeyGroupRange(9, 9)))
    assert f"section 'counts' block {last} is not a zstd frame" in assert_corrupt(exc_info)


# -- reading the tail -----------------------------------------------------------------------


def test_the_tail_is_one_read_or_two(sample: bytes) -> None:
    reads: list[tuple[int, int]] = []
    index = read_chunk_index(PATH, len(sample), reader(sample, reads))
    first = min(len(sample), TAIL_READ_BYTES)
    assert reads == [(len(sample) - first, first)]
    assert index == chunk_info(PATH, sample)
    reads.clear()
    assert read_chunk_index(PATH, len(sample), reader(sample, reads), tail_bytes=64) == index
    (a, n), (b, m) = reads
    assert (a, n) == (len(sample) - 64, 64) and b + m == a  # the second read is exactly the rest of the tail
    section = index.sections[-1]
    assert b == section.offset + section.length  # the tail starts right after the last block


def test_the_first_read_holds_the_tail_of_a_chunk_of_thousands_of_blocks() -> None:
    entries = [(key(0, i.to_bytes(6, "big")), i.to_bytes(8, "little")) for i in range(300_000)]
    data = encode_chunk(KeyGroupRange(0, 0), 1, {"a": entries, "b": entries[::3]}, block_size=1024)
    index = chunk_info(PATH, data)
    tail = len(data) - (index.sections[-1].offset + index.sections[-1].length)
    blocks = sum(s.block_count for s in index.sections)
    assert blocks > 5000
    assert tail / blocks < TAIL_READ_BYTES / 4096, tail  # the first read holds the tail of 4,096 blocks


def test_version_1_chunks_read_as_one_block_per_section() -> None:
    data = encode_chunk_v1(RANGE, 17, SECTIONS)
    reads: list[tuple[int, int]] = []
    index = read_chunk_index(PATH, len(data), reader(data, reads), tail_bytes=40)
    assert index.version == 1 and index == chunk_info(PATH, data) and len(reads) == 2
    for section in index.sections:
        assert section.block_count == 1 and section.blocks[0].first_key is None
        assert section.blocks_for(key(2)) == [] and section.blocks_for(key(10)) == []
    for name, entries in SECTIONS.items():
        for prefix in (b"", key(4), key(4, b"\x00\x05alice"), key(8, b"\x00"), key(5, b"b")):
            assert point_read(data, index, name, prefix) == [(k, v) for k, v in entries if k.startswith(prefix)]
        table = index.table(name)
        assert table is not None
        offset, length = table.byte_range
        assert index.decode_section(data[offset : offset + length], name) == entries


def test_the_chunks_of_old_fixtures_read_from_their_tails() -> None:
    files = sorted(FIXTURES.glob("e01875d/**/*.chunk"))
    assert files
    for file in files:
        data = file.read_bytes()
        index = read_chunk_index(str(file), len(data), reader(data), tail_bytes=32)
        assert index == chunk_info(str(file), data) and index.version == 1
        whole = decode_chunk(str(file), data).sections
        for name, entries in whole.items():
            for k, _ in entries:
                assert point_read(data, index, name, k) == [(k2, v) for k2, v in entries if k2.startswith(k)]


# -- damage ---------------------------------------------------------------------------------


@dataclass
class Parts:
    footer: dict[str, Any]
    blocks: list[list[bytes]]  # per section
    rows: list[list[list[Any]]]  # per section, per block: [raw_length, count, first_key]


def split(data: bytes) -> Parts:
    index_len, footer_len = struct.unpack_from("<II", data, len(data) - CHUNK_TRAILER.size)
    end = len(data) - CHUNK_TRAILER.size
    footer = json.loads(data[end - footer_len : end])
    raw = zstandard.ZstdDecompressor().decompress(data[end - footer_len - index_len : end - footer_len])
    n = struct.unpack_from("<I", raw)[0]
    cols = [struct.unpack_from(f"<{n}I", raw, 4 + 4 * n * i) for i in range(5)]
    at, rows = 4 + 20 * n, list[list[Any]]()
    for length in cols[4]:
        rows.append([cols[1][len(rows)], cols[2][len(rows)], raw[at : at + length]])
        at += length
    blocks, section_rows, i, offset = [], [], 0, CHUNK_HEADER.size
    for section in footer["sections"]:
        frames = []
        for length in cols[0][i : i + section["blocks"]]:
            frames.append(data[offset : offset + length])
            offset += length
        blocks.append(frames)
        section_rows.append(rows[i : i + section["blocks"]])
        i += section["blocks"]
    return Parts(footer, blocks, section_rows)


def assemble(parts: Parts, *, raw_index: bytes | None = None, version: int = 2) -> bytes:
    """A chunk whose offsets, lengths and checksums are recomputed from ``parts`` (counts are not)."""
    offset = CHUNK_HEADER.size
    for section, frames in zip(parts.footer["sections"], parts.blocks, strict=True):
        section.update(offset=offset, length=sum(map(len, frames)))
        offset += section["length"]
    frames = [f for section in parts.blocks for f in section]
    rows = [r for section in parts.rows for r in section]
    if raw_index is None:
        columns = [[len(f) for f in frames], [r[0] for r in rows], [r[1] for r in rows]]
        columns += [[zlib.crc32(f) for f in frames], [len(r[2]) for r in rows]]
        raw_index = struct.pack(f"<I{5 * len(rows)}I", len(rows), *(x for c in columns for x in c))
        raw_index += b"".join(r[2] for r in rows)
    index = zstandard.ZstdCompressor(level=1).compress(raw_index)
    parts.footer["index"] = {
        "offset": offset,
        "length": len(index),
        "raw_length": len(raw_index),
        "crc32": zlib.crc32(index),
    }
    text = json.dumps(parts.footer, separators=(",", ":")).encode()
    trailer = CHUNK_TRAILER.pack(len(index), len(text), zlib.crc32(text), version, CHUNK_TRAILER_MAGIC)
    return CHUNK_HEADER.pack(CHUNK_MAGIC, version, 0) + b"".join(frames) + index + text + trailer


@pytest.fixture(scope="module")
def small() -> bytes:
    sections = {"a": [(key(3, bytes([i])), bytes([i]) * (i % 7)) for i in range(12)], "b": [], "c": [(key(9), b"x")]}
    return encode_chunk(RANGE, 2, sections, block_size=40)


def test_reassembling_a_chunk_gives_its_bytes(sample: bytes, small: bytes) -> None:
    assert assemble(split(sample)) == sample and assemble(split(small)) == small
    assert chunk_info(PATH, small).sections[0].block_count > 2


def test_every_flipped_byte_is_refused(small: bytes) -> None:
    tail_start = chunk_info(PATH, small).sections[-1].offset + chunk_info(PATH, small).sections[-1].length
    for i in range(len(small)):
        damaged = flip(small, i, 1 << (i % 8))
        with pytest.raises(CorruptChunkError) as exc_info:
            decode_chunk(PATH, damaged)
        assert_corrupt(exc_info)
        with pytest.raises(CorruptChunkError):
            list(iter_chunk_entries(PATH, damaged, RANGE))
        if i >= tail_start:  # a point read reads the tail: index, footer and trailer
            with pytest.raises(CorruptChunkError) as exc_info:
                read_chunk_index(PATH, len(damaged), reader(damaged), tail_bytes=7)
            assert_corrupt(exc_info)


def test_a_flipped_byte_in_a_block_is_refused_by_its_point_read(sample: bytes) -> None:
    index = chunk_info(PATH, sample)
    section = index.table("map")
    assert section is not None
    for block in section.blocks_for(key(4, b"\x00\x05alice"))[:3]:
        data = sample[block.offset : block.offset + block.length]
        assert index.decode_block(data, block)
        for i in range(0, block.length, 7):
            for prefix in (None, key(4, b"\x00\x05alice")):
                with pytest.raises(CorruptChunkError) as exc_info:
                    index.decode_block(flip(data, i), block, prefix)
                assert f"section 'map' block {block.number} checksum mismatch" in assert_corrupt(exc_info)
        with pytest.raises(CorruptChunkError) as exc_info:
            index.decode_block(data[:-1], block)
        assert "bytes given" in assert_corrupt(exc_info)
    with pytest.raises(CorruptChunkError):
        index.decode_section(sample[: section.length - 1], "map")


def test_a_truncated_chunk_or_tail_is_refused(small: bytes) -> None:
    for cut in range(len(small)):
        with pytest.raises(CorruptChunkError) as exc_info:
            decode_chunk(PATH, small[:cut])
        assert_corrupt(exc_info)
        with pytest.raises(CorruptChunkError) as exc_info:
            read_chunk_index(PATH, cut, reader(small[:cut]))
        assert_corrupt(exc_info)


def test_a_short_read_is_refused(sample: bytes) -> None:
    with pytest.raises(CorruptChunkError) as exc_info:
        read_chunk_index(PATH, len(sample) + 10, lambda offset, length: sample[offset : offset + length])
    assert "gave" in assert_corrupt(exc_info)
    with pytest.raises(CorruptChunkError) as exc_info:
        read_chunk_index(PATH, len(sample), lambda offset, length: sample[offset : offset + length - 1])
    assert "gave" in assert_corrupt(exc_info)


@pytest.mark.parametrize(("header", "trailer", "problem"), [
    (3, 3, "unsupported chunk format version 3 (this reader knows 1 and 2)"),
    (2, 3, "trailer damaged"),
    (1, 2, "trailer damaged"),
    (2, 1, "trailer damaged"),
])  # fmt: skip
def test_a_wrong_version_is_refused(small: bytes, header: int, trailer: int, problem: str) -> None:
    data = bytearray(small)
    struct.pack_into("<H", data, 4, header)
    struct.pack_into("<H", data, len(data) - 6, trailer)
    with pytest.raises(CorruptChunkError) as exc_info:
        chunk_info(PATH, bytes(data))
    assert problem in assert_corrupt(exc_info)
    if trailer == 3:  # a point read reads no header: the trailer's version is all it knows
        with pytest.raises(CorruptChunkError) as exc_info:
            read_chunk_index(PATH, len(data), reader(bytes(data)))
        assert "unsupported chunk format version 3 (this reader knows 1 and 2)" in assert_corrupt(exc_info)


@given(st.binary(max_size=100))
def test_garbage_tails_are_refused(garbage: bytes) -> None:
    for data in (garbage, garbage + struct.pack("<H4s", 2, CHUNK_TRAILER_MAGIC)):
        for tail_bytes in (1, 30, 1000):
            with pytest.raises(CorruptChunkError) as exc_info:
                read_chunk_index(PATH, len(data), reader(data), tail_bytes=tail_bytes)
            assert_corrupt(exc_info)


def _set_row(section: int, block: int, column: int, value: Any) -> Callable[[Parts], None]:
    def change(parts: Parts) -> None:
        parts.rows[section][block][column] = value

    return change


def _add_to_row(section: int, block: int, column: int, value: int) -> Callable[[Parts], None]:
    def change(parts: Parts) -> None:
        parts.rows[section][block][column] += value

    return change


def _footer(section: int, field: str, value: Any) -> Callable[[Parts], None]:
    def change(parts: Parts) -> None:
        parts.footer["sections"][section][field] = value

    return change


def _swap_blocks(parts: Parts) -> None:
    """Blocks 0 and 1 of "a" change places, and so do their index rows, all but the first keys."""
    blocks, rows = parts.blocks[0], parts.rows[0]
    blocks[0], blocks[1] = blocks[1], blocks[0]
    rows[0][:2], rows[1][:2] = rows[1][:2], rows[0][:2]


def _empty_block(parts: Parts) -> None:
    rows = parts.rows[0]
    rows[1][1] += rows[0][1]
    rows[0][1] = 0


def _larger_raw_length(parts: Parts) -> None:
    parts.rows[0][0][0] += 1  # the index and footer agree, the frame does not
    parts.footer["sections"][0]["raw_length"] += 1


def _later_first_key(parts: Parts) -> None:
    parts.rows[0][1][2] += b"\x00"  # still below block 2's first key


def _earlier_first_key(parts: Parts) -> None:
    rows = parts.rows[0]
    assert rows[0][1] >= 2
    rows[1][2] = key(3, bytes([rows[0][1] - 1]))  # block 0's last key (the keys of "a" are key(3, i))


INDEX_CASES: list[tuple[str, Callable[[Parts], None], str, bool]] = [
    # (what, change, problem, caught by reading the tail alone)
    ("first keys out of order", _set_row(0, 1, 2, key(3, b"\x00")), "first keys not strictly increasing", True),
    (
        "first key below the key groups",
        _set_row(0, 0, 2, key(2, b"\xff")),
        "first keys outside the section's key groups",
        True,
    ),
    ("first key above the key groups", _set_row(0, -1, 2, key(4)), "first keys outside the section's key groups", True),
    ("first key too short", _set_row(0, 0, 2, b"\x00"), "shorter than its key-group prefix", True),
    ("entries do not add up", _add_to_row(0, 0, 1, 1), "do not add up to the section's", True),
    ("raw lengths do not add up", _add_to_row(0, 0, 0, 1), "do not add up to the section's", True),
    ("a block without entries", _empty_block, "do not add up to the section's", True),
    ("more blocks than listed", _footer(0, "blocks", 99), "malformed footer", True),
    ("blocks of an empty section", _footer(1, "blocks", 1), "malformed footer", True),
    ("blocks in another order", _swap_blocks, "keys not strictly increasing", False),
    ("a frame of another size", _larger_raw_length, "section 'a' block 0 frame states", False),
    ("a first key not the block's", _later_first_key, "first key differs from the index's", False),
    ("a block reaching the next", _earlier_first_key, "keys reach the next block's first key", False),
]


@pytest.mark.parametrize(
    ("change", "problem", "in_tail"), [c[1:] for c in INDEX_CASES], ids=[c[0] for c in INDEX_CASES]
)
def test_checksummed_but_inconsistent_index(
    small: bytes, change: Callable[[Parts], None], problem: str, in_tail: bool
) -> None:
    parts = split(small)
    change(parts)
    data = assemble(parts)
    with pytest.raises(CorruptChunkError) as exc_info:
        decode_chunk(PATH, data)
    assert problem in assert_corrupt(exc_info)
    if in_tail:
        with pytest.raises(CorruptChunkError) as exc_info:
            read_chunk_index(PATH, len(data), reader(data))
        assert problem in assert_corrupt(exc_info)


def test_a_last_block_must_end_in_the_sections_last_key_group(small: bytes) -> None:
    parts = split(small)
    parts.footer["sections"][0]["key_groups"] = [3, 4]  # the last key of "a" is in key group 3
    data = assemble(parts)
    index = read_chunk_index(PATH, len(data), reader(data))
    section = index.table("a")
    assert section is not None
    last = section.blocks[-1]
    with pytest.raises(CorruptChunkError) as exc_info:
        index.decode_block(data[last.offset : last.offset + last.length], last)
    assert "key groups differ from the footer's bounds" in assert_corrupt(exc_info)


@pytest.mark.parametrize(
    ("raw_index", "problem"),
    [
        (b"", "index raw_length must be"),
        (struct.pack("<I", 99) + b"\x00" * 1000, "does not hold the"),
        (None, "first key lengths do not add up"),
    ],
)
def test_checksummed_but_malformed_index_columns(small: bytes, raw_index: bytes | None, problem: str) -> None:
    parts = split(small)
    if raw_index is None:  # one byte more after the first keys
        assemble(parts)
        frame_start = parts.footer["index"]["offset"]
        frame = small[frame_start : frame_start + parts.footer["index"]["length"]]
        raw_index = zstandard.ZstdDecompressor().decompress(frame) + b"\x00"
    data = assemble(parts, raw_index=raw_index)
    with pytest.raises(CorruptChunkError) as exc_info:
        read_chunk_index(PATH, len(data), reader(data))
    assert problem in assert_corrupt(exc_info)


def test_an_index_frame_stating_another_size_is_refused_before_decompressing(small: bytes) -> None:
    parts = split(small)
    data = assemble(parts)
    for raw_length in (parts.footer["index"]["raw_length"] + 1, 2**33):
        parts.footer["index"]["raw_length"] = raw_length
        text = json.dumps(parts.footer).encode()
        end = len(data) - CHUNK_TRAILER.size
        index_len, footer_len = struct.unpack_from("<II", data, end)
        damaged = (
            data[: end - footer_len]
            + text
            + CHUNK_TRAILER.pack(index_len, len(text), zlib.crc32(text), 2, CHUNK_TRAILER_MAGIC)
        )
        with pytest.raises(CorruptChunkError) as exc_info:
            read_chunk_index(PATH, len(damaged), reader(damaged))
        assert "block index frame states" in assert_corrupt(exc_info)


def _fixed_width() -> bytes:
    """``small`` with every value of one length: its point reads take the path for keys and values
    of one length (``block_ranges._point_entries``)."""
    sections = {"a": [(key(3, bytes([i])), bytes([i]) * 4) for i in range(12)], "b": [], "c": [(key(9), b"x")]}
    return encode_chunk(RANGE, 2, sections, block_size=40)


@pytest.mark.parametrize("widths", ["values of one length", "values of several lengths"])
@pytest.mark.parametrize(
    ("change", "problem"), [c[1:3] for c in INDEX_CASES if not c[3]], ids=[c[0] for c in INDEX_CASES if not c[3]]
)
def test_checksummed_but_inconsistent_blocks_are_refused_by_point_reads(
    small: bytes, widths: str, change: Callable[[Parts], None], problem: str
) -> None:
    """What a whole decode refuses in a block, a point read of its keys refuses too, whichever path
    it takes (keys and values of one length, or not). Blocks swapped are seen by the first block
    read: its first key is not the index's."""
    chunk = _fixed_width() if widths == "values of one length" else small
    parts = split(chunk)
    change(parts)
    data = assemble(parts)
    index = read_chunk_index(PATH, len(data), reader(data))
    section = index.table("a")
    assert section is not None
    keys = [key(3, bytes([i])) for i in range(12)]
    with pytest.raises(CorruptChunkError) as exc_info:
        for block in section.blocks:
            index.point_entries([block], [data[block.offset : block.offset + block.length]], keys)
    swapped = problem == "keys not strictly increasing"
    assert ("first key differs from the index's" if swapped else problem) in assert_corrupt(exc_info)
