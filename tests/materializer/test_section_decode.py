"""A whole section decoded at once (``materializer.sections``) gives what its blocks give one by one,
and refuses what a one-block read refuses, with the same error; an eager restore and a lazy
restore's hydration leave the keys' order to LMDB's append and still refuse a chunk whose keys are
out of order.

The damaged chunks are well formed but for one block whose columns a buggy writer got wrong: its
checksum, its index row and the footer agree with it, so only the checks of the columns can tell.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import lmdb
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.core.entries import _FIELDS, Entries
from backend.core.handles import KeyedStateHandle, chunk_digest
from backend.core.serializers import serialize_key
from backend.core.tablekeys import ckey
from backend.state.restore import bulk_put
from dstl import CorruptDataError, KeyGroupRange
from materializer.blocks import decode_block, decode_blocks
from materializer.chunks import chunk_info, chunk_sections, decode_chunk, encode_chunk
from materializer.errors import CorruptChunkError
from materializer.periodic import restore
from tests.materializer.test_chunk_binding import COUNT, World, materialized_handle
from tests.materializer.test_chunk_blocks import Parts, assemble, assert_corrupt, key, split

PATH = "shared/pack-7.chunks#chunk-0003-0009"
RANGE = KeyGroupRange(3, 9)
VARIABLE = [(key(3 + i % 5, i.to_bytes(2, "big") + b"k" * (i % 4)), b"v" * (i % 9)) for i in range(60)]
FIXED = [(key(3 + i % 5, i.to_bytes(4, "big")), i.to_bytes(8, "little")) for i in range(60)]
SECTIONS = {"fixed": sorted(FIXED), "variable": sorted(VARIABLE)}
BLOCK_SIZE = 200  # some ten entries per block
#: a zstd skippable frame (magic, length, bytes): a decoder of frames passes over it
SKIPPABLE = struct.pack("<II", 0x184D2A50, 3) + b"abc"


def blockwise(data: bytes, name: str) -> list[tuple[bytes, bytes]]:
    """The entries of a section, each of its blocks decoded on its own."""
    section = chunk_info(PATH, data).table(name)
    assert section is not None
    found: list[tuple[bytes, bytes]] = []
    for block in section.blocks:
        keys, values = decode_block(PATH, data[block.offset : block.offset + block.length], block)
        found += zip(keys, values, strict=True)
    return found


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(3, 9), st.binary(max_size=6), st.binary(max_size=12)), max_size=80),
    st.integers(1, 4),
    st.integers(16, 300),
)
def test_a_section_decodes_as_its_blocks_do(rows: list[tuple[int, bytes, bytes]], width: int, block_size: int) -> None:
    variable = dict((key(g, k), v) for g, k, v in rows)
    fixed = {key(g, k.ljust(width, b"\x00")[:width]): v.ljust(8, b"\x00")[:8] for g, k, v in rows}
    sections = {"variable": sorted(variable.items()), "fixed": sorted(fixed.items())}
    data = encode_chunk(RANGE, 5, sections, block_size=block_size)
    decoded = decode_chunk(PATH, data).sections
    assert decoded == sections
    for check_order in (True, False):
        whole = chunk_sections(PATH, data, RANGE, check_order=check_order)
        assert {name: list(e) for name, e in whole.items()} == {n: e for n, e in sections.items() if e}
    assert all(blockwise(data, name) == entries for name, entries in sections.items())


def test_more_entries_of_one_width_than_one_struct_call_cuts() -> None:
    entries = [
        (key(3 + i // 5000, i.to_bytes(4, "big")), i.to_bytes(8, "little"))
        for i in range(3 * _FIELDS[0] + 2 * _FIELDS[1] + 7)
    ]
    data = encode_chunk(RANGE, 1, {"big": entries}, block_size=8 << 10)
    assert decode_chunk(PATH, data).sections == {"big": entries}


def columns(keys: list[bytes], values: list[bytes], count: int | None = None) -> bytes:
    lengths = [len(k) for k in keys] + [len(v) for v in values]
    return struct.pack(f"<I{len(lengths)}I", len(keys) if count is None else count, *lengths) + b"".join(keys + values)


def block_columns(parts: Parts, section: int, block: int) -> tuple[list[bytes], list[bytes]]:
    """The keys and values of one block, decompressed from ``parts``."""
    raw = zstandard.ZstdDecompressor().decompress(parts.blocks[section][block])
    (count,) = struct.unpack_from("<I", raw)
    lengths = struct.unpack_from(f"<{2 * count}I", raw, 4)
    at, pieces = 4 + 8 * count, []
    for n in lengths:
        pieces.append(raw[at : at + n])
        at += n
    return pieces[:count], pieces[count:]


def with_block(parts: Parts, section: int, block: int, raw: bytes, *, frame: bytes | None = None) -> bytes:
    """The chunk of ``parts`` with one block's columns replaced by ``raw``: its frame, index row and
    the footer's raw length agree with them (the entry count stays the index's)."""
    row = parts.rows[section][block]
    parts.footer["sections"][section]["raw_length"] += len(raw) - row[0]
    row[0] = len(raw)
    parts.blocks[section][block] = zstandard.ZstdCompressor().compress(raw) if frame is None else frame
    return assemble(parts)


def swapped(keys: list[bytes], i: int, j: int) -> list[bytes]:
    out = list(keys)
    out[i], out[j] = out[j], out[i]
    return out


CASES: list[tuple[str, Any, str]] = [
    ("a count other than the index's", lambda k, v: columns(k, v, count=len(k) + 1), "entries, the index says"),
    ("a byte more", lambda k, v: columns(k, v) + b"x", "entry lengths do not add up"),
    ("a byte less", lambda k, v: columns(k, v)[:-1], "entry lengths do not add up"),
    ("two keys swapped", lambda k, v: columns(swapped(k, 2, 3), v), "keys not strictly increasing"),
    ("a key repeated", lambda k, v: columns([*k[:3], k[2], *k[4:]], v), "keys not strictly increasing"),
    ("a short key", lambda k, v: columns([k[0], b"\x00", *k[2:]], v), "shorter than its key-group prefix"),
]


@pytest.mark.parametrize("section", [0, 1], ids=["fixed", "variable"])
@pytest.mark.parametrize(("build", "problem"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_checksummed_block_with_wrong_columns_is_refused_as_its_own_read_refuses_it(
    section: int, build: Any, problem: str
) -> None:
    parts = split(encode_chunk(RANGE, 2, SECTIONS, block_size=BLOCK_SIZE))
    assert len(parts.blocks[section]) > 3 and parts.rows[section][1][1] >= 5
    keys, values = block_columns(parts, section, 1)
    data = with_block(parts, section, 1, build(keys, values))
    blocks = chunk_info(PATH, data).sections[section].blocks
    with pytest.raises(CorruptChunkError) as one_by_one:
        decode_blocks(PATH, memoryview(data), blocks)
    with pytest.raises(CorruptChunkError) as whole:
        decode_chunk(PATH, data)
    assert problem in assert_corrupt(whole) and assert_corrupt(whole) == assert_corrupt(one_by_one)


@pytest.mark.parametrize(
    ("frame", "problem"),
    [
        (zstandard.ZstdCompressor(write_content_size=False).compress(b"x" * 40), "frame states -1 bytes"),
        (zstandard.ZstdCompressor().compress(b"x" * 40) + b"extra", "does not decompress"),
        (zstandard.ZstdCompressor().compress(b"x" * 40) + SKIPPABLE, "does not decompress"),
        (zstandard.ZstdCompressor().compress(b"x" * 40) * 2, "does not decompress"),
        (b"not zstd at all" * 3, "is not a zstd frame"),
    ],
)
def test_a_checksummed_block_that_is_not_one_whole_frame_is_refused(frame: bytes, problem: str) -> None:
    parts = split(encode_chunk(RANGE, 2, SECTIONS, block_size=BLOCK_SIZE))
    with pytest.raises(CorruptChunkError) as whole:
        decode_chunk(PATH, with_block(parts, 0, 2, b"x" * 40, frame=frame))
    assert f"section 'fixed' block 2 {problem}" in assert_corrupt(whole)


def test_frames_with_checksums_or_of_several_zstd_blocks_decode_as_their_blocks_do() -> None:
    parts = split(encode_chunk(RANGE, 2, SECTIONS, block_size=BLOCK_SIZE))
    for section in (0, 1):
        for block in (0, 2):
            raw = zstandard.ZstdDecompressor().decompress(parts.blocks[section][block])
            with_block(parts, section, block, raw, frame=zstandard.ZstdCompressor(write_checksum=True).compress(raw))
    data = assemble(parts)
    assert decode_chunk(PATH, data).sections == SECTIONS
    huge = {"huge": [(key(3, b"a"), b"small"), (key(4), bytes(range(256)) * 1200), (key(5), b"")]}  # 300 KiB
    assert decode_chunk(PATH, encode_chunk(RANGE, 2, huge, block_size=BLOCK_SIZE)).sections == huge


def unsorted_chunk() -> bytes:
    """A chunk whose block 1 of "fixed" has two keys swapped, everything else consistent with it."""
    parts = split(encode_chunk(RANGE, 2, SECTIONS, block_size=BLOCK_SIZE))
    keys, values = block_columns(parts, 0, 1)
    return with_block(parts, 0, 1, columns(swapped(keys, 2, 3), values))


def test_a_bulk_load_proves_the_order_it_was_left_or_has_it_checked(tmp_path: Path) -> None:
    data, bad = encode_chunk(RANGE, 2, SECTIONS, block_size=BLOCK_SIZE), unsorted_chunk()
    env = lmdb.open(str(tmp_path), max_dbs=4, map_size=1 << 24)
    try:
        fresh, behind = env.open_db(b"fresh"), env.open_db(b"behind")
        with env.begin(write=True) as txn:
            sound = chunk_sections(PATH, data, RANGE, check_order=False)["fixed"]
            assert isinstance(sound, Entries) and sound.unproven_order is not None
            bulk_put(txn, fresh, sound)  # all appended: the order is proven by LMDB
            txn.put(b"\xff\xff", b"past every key", db=behind)  # no append: checked, then put
            bulk_put(txn, behind, chunk_sections(PATH, data, RANGE, check_order=False)["fixed"])
            assert [k for k, _ in txn.cursor(db=behind)] == [k for k, _ in SECTIONS["fixed"]] + [b"\xff\xff"]
        for db in (fresh, behind):
            with env.begin(write=True) as txn, pytest.raises(CorruptChunkError) as refused:
                bulk_put(txn, db, chunk_sections(PATH, bad, RANGE, check_order=False)["fixed"])
            assert assert_corrupt(refused) == "section 'fixed': keys not strictly increasing"
    finally:
        env.close()
    with pytest.raises(CorruptChunkError, match="section 'fixed': keys not strictly increasing"):
        chunk_sections(PATH, bad, RANGE)  # checked at once by default


def unsorted_handle(world: World) -> tuple[KeyedStateHandle, str, list[bytes]]:
    """A checkpoint whose chunk of key group 1 has keys 2 and 3 of its first "count" block swapped;
    the chunk's hash and size in the handle are its own: only the order of its keys is wrong. Also
    that chunk's path and the block's keys (ckeys) as they were."""
    _, handle = materialized_handle(world, {k: k for k in range(400)})
    value = handle.to_json()
    entry = next(c for c in value["materialized"] if c["key_groups"] == [1, 1])
    path = world.dfs / str(entry["path"])
    parts = split(path.read_bytes())
    (section,) = [i for i, s in enumerate(parts.footer["sections"]) if s["name"] == "count"]
    keys, values = block_columns(parts, section, 0)
    assert len(keys) > 4
    path.write_bytes(with_block(parts, section, 0, columns(swapped(keys, 2, 3), values)))
    entry.update(size=path.stat().st_size, sha256=chunk_digest(path.read_bytes()))
    return KeyedStateHandle.from_json(value), str(entry["path"]), keys


def test_an_eager_restore_refuses_a_chunk_whose_keys_are_out_of_order(tmp_path: Path) -> None:
    world = World(tmp_path)
    try:
        handle, path, _ = unsorted_handle(world)
        with pytest.raises(CorruptDataError) as refused:
            world.restored(handle)
        assert path in str(refused.value)
        assert "section 'count': keys not strictly increasing" in str(refused.value)
    finally:
        world.close()


@pytest.mark.parametrize("loaded_first", [False, True], ids=["nothing-local", "a-key-of-the-block-local"])
def test_a_hydration_refuses_a_chunk_whose_keys_are_out_of_order(tmp_path: Path, loaded_first: bool) -> None:
    """The hydration appends a chunk's entries, leaving out the keys loaded on access before: either
    way the swapped keys are refused, naming the chunk, and nothing of the key group is hydrated."""
    world = World(tmp_path)
    try:
        handle, path, keys = unsorted_handle(world)
        b = world.backend()
        restore(b, [handle], mode="lazy")
        if loaded_first:  # the block's first key, whose neighbour is in order: its point read passes
            first = next(k for k in range(400) if ckey(1, serialize_key(k)) == keys[0])
            b.set_current_key(first)
            assert b.get_state(COUNT).value() == first
        with pytest.raises(CorruptDataError) as refused:
            b.hydrate()
        assert path in str(refused.value) and "key groups [1, 1]" in str(refused.value)
        assert "section 'count': keys not strictly increasing" in str(refused.value)
        assert b._lazy is not None and b._lazy.local.cold[1]  # key group 1 not hydrated
    finally:
        world.close()
