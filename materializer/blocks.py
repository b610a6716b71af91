"""Blocks: the unit of a point read in a chunk of format version 2 (the chunk is ``materializer.chunks``).

Why blocks: the lazy restore (docs/architecture.md, "Lazy restore") loads one *key* when it is
first needed, not a whole key group, so it must fetch a key's entries without the rest of its
chunk. A version-2 section (one state's entries in a chunk) is therefore a run of blocks::

    block    := zstd(columns)              one frame, stating its content size
    columns  := count:u32 key_len:u32[count] value_len:u32[count] keys values
    index    := zstd(n:u32 length:u32[n] raw_length:u32[n] entries:u32[n] crc32:u32[n]
                     first_key_len:u32[n] first_keys)           one frame for the chunk's n blocks

A block holds whole entries, consecutive in key order, of at most ``BLOCK_SIZE`` raw bytes of
columns (an entry larger than that gets a block of its own; no entry spans blocks, but the
entries of one map state's key may span several). Each block is checksummed (crc32 of its
compressed bytes) and its first key is in the index, so a key's entries are found by a binary
search over the first keys and read with one ranged read of consecutive blocks. A block's offset
is not stored: the blocks of a section tile it in order, so it is the section's offset plus the
lengths before it. The index frame lists the blocks of every section in section order (the chunk's
footer says how many each section has); it sits right before the footer, so the tail of a chunk
(``materializer.chunks.read_chunk_index``) holds everything a point read needs.

A decoded block is checked like a version-1 section: the frame states the raw length the index
records before anything is decompressed (python-zstandard would allocate what a frame states),
lengths add up, keys are strictly increasing, its first key is the index's, its last key is below
the next block's first key (or, in the section's last block, in the section's last key group).
A point read of one key (``decode_block`` with a prefix) slices out only that key's entries, as a
sub-range read of a chunk does: the crc of the whole block, its first and last keys, and the order
of the keys it slices out with one neighbour on each side are checked. Version-1 sections read
through the same code as one block each, bounded by the key groups only. Any failure raises
``CorruptChunkError`` naming the file.

``BLOCK_SIZE`` trades a point read's cost against compression: see docs/benchmarks.md ("chunk
blocks") for the measurements behind it.
"""

from __future__ import annotations

import io
import operator
import struct
import threading
import zlib
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, islice
from operator import itemgetter

import zstandard

from backend.core.tablekeys import KEY_GROUP_PREFIX_BYTES
from backend.core.tablekeys import key_group_of as _key_group
from dstl.format import array_from_le, le_bytes
from dstl.types import KeyGroupRange
from materializer.errors import CorruptChunkError

#: the largest raw size (bytes of columns) of a block holding more than one entry
BLOCK_SIZE = 4 << 10

_U32 = struct.Struct("<I")
_first = itemgetter(0)
_second = itemgetter(1)
MAX_U32 = (1 << 32) - 1
#: index columns per block besides the first key: length, raw length, entries, crc32, first key length
_INDEX_COLUMNS = 5


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """One block of a section: where it is in the chunk and what bounds its keys."""

    table: str
    number: int  # its position in the section
    offset: int  # of its frame, from the start of the chunk
    length: int  # compressed bytes
    raw_length: int
    count: int
    crc32: int  # of the compressed bytes
    first_key: bytes | None  # its exact first key; None in a version-1 chunk (bounded by key groups only)
    next_key: bytes | None  # the next block's first key: every key of this block is below it (None: last block)
    min_key_group: int  # the section's bounds
    max_key_group: int

    @property
    def what(self) -> str:
        """How error messages name it."""
        return f"section {self.table!r}" if self.first_key is None else f"section {self.table!r} block {self.number}"


@dataclass(frozen=True, slots=True, eq=False)
class SectionInfo:
    """Where one state's entries are in a chunk: the footer's record and the section's blocks."""

    name: str
    offset: int
    length: int  # compressed bytes of its blocks
    count: int
    raw_length: int  # decompressed bytes of its blocks' columns
    min_key_group: int  # 0 and -1 for an empty section
    max_key_group: int
    block_offsets: array[int]  # from the start of the chunk
    block_lengths: array[int]
    block_raw_lengths: array[int]
    block_counts: array[int]
    block_crcs: array[int]
    first_keys: tuple[bytes, ...] | None  # None: a version-1 section, one block

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SectionInfo):
            return NotImplemented
        return all(getattr(self, f) == getattr(other, f) for f in self.__slots__)

    __hash__ = None  # type: ignore[assignment]

    @property
    def byte_range(self) -> tuple[int, int]:
        """(offset, length) of the whole section in the chunk: one ranged read of all its blocks."""
        return self.offset, self.length

    @property
    def block_count(self) -> int:
        return len(self.block_lengths)

    def block(self, number: int) -> BlockInfo:
        keys = self.first_keys
        return BlockInfo(
            table=self.name,
            number=number,
            offset=self.block_offsets[number],
            length=self.block_lengths[number],
            raw_length=self.block_raw_lengths[number],
            count=self.block_counts[number],
            crc32=self.block_crcs[number],
            first_key=None if keys is None else keys[number],
            next_key=None if keys is None or number + 1 == len(keys) else keys[number + 1],
            min_key_group=self.min_key_group,
            max_key_group=self.max_key_group,
        )

    @property
    def blocks(self) -> list[BlockInfo]:
        """Every block, in key order."""
        return [self.block(i) for i in range(self.block_count)]

    def blocks_for(self, prefix: bytes) -> list[BlockInfo]:
        """The consecutive blocks that may hold entries whose key starts with ``prefix``.

        A key's entries (or a map state key's entries, by the prefix of their composite keys) lie
        in the blocks from the last one starting at or before ``prefix`` to the last one starting
        below the first key past every key starting with ``prefix``. Empty if the section holds no
        such key group; in a version-1 section, the whole section if it holds the key group.
        """
        if not self.count:
            return []
        if len(prefix) >= KEY_GROUP_PREFIX_BYTES:
            key_group = _key_group(prefix)
            if not self.min_key_group <= key_group <= self.max_key_group:
                return []
        keys = self.first_keys
        if keys is None:
            return [self.block(0)]
        lo = max(bisect_right(keys, prefix) - 1, 0)
        past = prefix_end(prefix)
        hi = len(keys) if past is None else bisect_left(keys, past, lo)
        return [self.block(i) for i in range(lo, hi)]


def prefix_end(prefix: bytes) -> bytes | None:
    """The least byte string above every string starting with ``prefix`` (None: there is none)."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return None
    return stripped[:-1] + bytes([stripped[-1] + 1])


def span(blocks: Sequence[BlockInfo]) -> tuple[int, int]:
    """(offset, length) of consecutive blocks (what ``blocks_for`` returns): one ranged read."""
    if not blocks:
        raise ValueError("no blocks")
    return blocks[0].offset, blocks[-1].offset + blocks[-1].length - blocks[0].offset


# --------------------------------------------------------------------------------------------- encode


@dataclass(slots=True)
class EncodedSection:
    """A section cut into blocks, ready to be written: frames plus their index rows."""

    frames: list[bytes]
    first_keys: list[bytes]
    raw_lengths: list[int]
    counts: list[int]
    count: int
    min_key_group: int
    max_key_group: int

    @property
    def raw_length(self) -> int:
        return sum(self.raw_lengths)

    @property
    def length(self) -> int:
        return sum(map(len, self.frames))


def _first_unsorted(keys: Sequence[bytes]) -> int:
    """The index of the first key not greater than its predecessor (only called when there is one)."""
    return next(i for i in range(1, len(keys)) if not keys[i - 1] < keys[i])


def _cuts(key_lens: array[int], value_lens: array[int], block_size: int) -> list[int]:
    """Where blocks start: each holds at least one entry, and at most ``block_size`` raw bytes if it
    holds more. Sized by the average entry of the block before (a few C-level sums of the length
    columns per block, not a Python step per entry), so a block is filled to near the size."""
    count, cuts, start, guess = len(key_lens), [], 0, 64
    while start < count:
        cuts.append(start)
        end = start + 1
        for _ in range(4):  # a proportional guess, then corrections; sizes vary little between neighbours
            stop = min(start + max(guess, 1), count)
            size = 4 + 8 * (stop - start) + sum(key_lens[start:stop]) + sum(value_lens[start:stop])
            if size <= block_size:
                end = max(end, stop)
                if stop == count or size * 20 >= block_size * 19:  # filled to 95%: close enough
                    break
            guess = (stop - start) * block_size // size  # the entries that fit at this average size
            if guess == stop - start:
                break
        start = end
    return cuts


def encode_section(
    name: str,
    entries: Sequence[tuple[bytes, bytes]],
    key_groups: KeyGroupRange,
    compressor: zstandard.ZstdCompressor,
    block_size: int,
) -> EncodedSection:
    """Check a state's entries (sorted, unique, inside ``key_groups``) and cut them into blocks."""
    count = len(entries)
    keys = list(map(_first, entries))
    values = list(map(_second, entries))
    try:
        key_lens = array("I", map(len, keys))
        value_lens = array("I", map(len, values))
    except OverflowError:
        raise ValueError(f"section {name!r}: a key or value is larger than {MAX_U32} bytes") from None
    section = EncodedSection([], [], [], [], count, 0, -1)
    if not count:
        return section
    if min(key_lens) < KEY_GROUP_PREFIX_BYTES:
        i = next(i for i, n in enumerate(key_lens) if n < KEY_GROUP_PREFIX_BYTES)
        raise ValueError(f"section {name!r}: key {i} ({keys[i]!r}) is shorter than its key-group prefix")
    if not all(map(operator.lt, keys, islice(keys, 1, None))):
        i = _first_unsorted(keys)
        raise ValueError(
            f"section {name!r}: keys not strictly increasing at entry {i} ({keys[i - 1]!r} >= {keys[i]!r})"
        )
    lo, hi = _key_group(keys[0]), _key_group(keys[-1])
    if lo < key_groups.start or hi > key_groups.end:
        bad = keys[0] if lo < key_groups.start else keys[-1]
        raise ValueError(
            f"section {name!r}: key {bad!r} is in key group {_key_group(bad)}, "
            f"outside the chunk's range [{key_groups.start}, {key_groups.end}]"
        )
    section.min_key_group, section.max_key_group = lo, hi
    cuts = _cuts(key_lens, value_lens, block_size)
    for a, b in zip(cuts, [*cuts[1:], count], strict=True):
        columns = (_U32.pack(b - a), le_bytes(key_lens[a:b]), le_bytes(value_lens[a:b]))
        raw = b"".join((*columns, b"".join(keys[a:b]), b"".join(values[a:b])))
        if len(raw) > MAX_U32:
            raise ValueError(f"section {name!r}: entry {a} takes {len(raw)} bytes, more than a block can hold")
        section.frames.append(compressor.compress(raw))
        section.first_keys.append(keys[a])
        section.raw_lengths.append(len(raw))
        section.counts.append(b - a)
    return section


def encode_index(sections: Sequence[EncodedSection]) -> bytes:
    """The raw index columns of every block of ``sections``, in order (compressed by the caller)."""
    firsts = [k for s in sections for k in s.first_keys]
    columns = (
        array("I", [len(f) for s in sections for f in s.frames]),
        array("I", [n for s in sections for n in s.raw_lengths]),
        array("I", [n for s in sections for n in s.counts]),
        array("I", [zlib.crc32(f) for s in sections for f in s.frames]),
        array("I", map(len, firsts)),
    )
    return b"".join((_U32.pack(len(firsts)), *map(le_bytes, columns), *firsts))


# --------------------------------------------------------------------------------------------- decode


_local = threading.local()


def thread_decompressor() -> zstandard.ZstdDecompressor:
    """This thread's decompressor: making one allocates a zstd context, which costs about half of
    decompressing a block; one may not be used by two threads at once."""
    decompressor: zstandard.ZstdDecompressor | None = getattr(_local, "decompressor", None)
    if decompressor is None:
        decompressor = _local.decompressor = zstandard.ZstdDecompressor()
    return decompressor


def decompress(
    path: str,
    what: str,
    payload: bytes | memoryview,
    raw_length: int,
    decompressor: zstandard.ZstdDecompressor,
    source: str = "footer",
) -> bytes:
    """One whole zstd frame stating ``raw_length`` bytes (checked before decompressing), decompressed;
    ``source`` is what recorded the length, for the messages."""
    try:
        stated = zstandard.frame_content_size(payload)
    except zstandard.ZstdError as exc:
        raise CorruptChunkError(path, f"{what} is not a zstd frame: {exc}") from None
    if stated != raw_length:  # python-zstandard would allocate what the frame states
        raise CorruptChunkError(path, f"{what} frame states {stated} bytes, the {source} {raw_length}")
    try:
        raw = decompressor.decompress(payload, max_output_size=raw_length, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise CorruptChunkError(path, f"{what} does not decompress: {exc}") from None
    except MemoryError:  # one buffer of the stated size could not be had: the size is damage
        raise CorruptChunkError(path, f"{what} states {raw_length} bytes, too many") from None
    if len(raw) != raw_length:
        raise CorruptChunkError(path, f"{what} has {len(raw)} bytes, the {source} says {raw_length}")
    return raw


def parse_index(path: str, raw: bytes, blocks: int) -> tuple[array[int], ...]:
    """Split the index columns of ``blocks`` blocks: (lengths, raw lengths, counts, crcs, first key lengths, ...).

    The sixth item is the offsets of the first keys in ``raw`` (``blocks + 1`` of them); lengths are
    checked to add up, the rest is the caller's (it knows the sections).
    """
    head = 4 + 4 * _INDEX_COLUMNS * blocks
    if len(raw) < head or _U32.unpack_from(raw)[0] != blocks:
        raise CorruptChunkError(path, f"block index does not hold the {blocks} blocks the footer lists")
    view = memoryview(raw)
    columns = [array_from_le("I", view[4 + 4 * blocks * i : 4 + 4 * blocks * (i + 1)]) for i in range(_INDEX_COLUMNS)]
    key_offsets = array("Q", accumulate(columns[-1], initial=head))
    if key_offsets[-1] != len(raw):
        raise CorruptChunkError(path, "block index: first key lengths do not add up")
    return (*columns, key_offsets)


@dataclass(frozen=True, slots=True)
class _Columns:
    """A checked, decompressed block whose entries are not sliced out yet."""

    raw: bytes
    key_lens: array[int]
    value_lens: array[int]
    keys_start: int
    values_start: int
    key_width: int  # every key's length when they are all alike (int keys, say), else 0
    value_width: int  # the same for the values


def checked_payload(path: str, payload: bytes | memoryview, block: BlockInfo) -> bytes | memoryview:
    if len(payload) != block.length:
        raise CorruptChunkError(path, f"{block.what}: {len(payload)} bytes given, it has {block.length}")
    if zlib.crc32(payload) != block.crc32:
        raise CorruptChunkError(path, f"{block.what} checksum mismatch")
    return payload


def decompress_block(
    path: str, payload: bytes | memoryview, block: BlockInfo, decompressor: zstandard.ZstdDecompressor
) -> bytes:
    """Decompress a block whose checksum was checked: its raw columns, their entry count checked."""
    source = "footer" if block.first_key is None else "index"
    raw = decompress(path, block.what, payload, block.raw_length, decompressor, source)
    count = block.count
    if len(raw) < 4 + 8 * count:
        raise CorruptChunkError(path, f"{block.what}: {len(raw)} bytes cannot hold {count} entries")
    (stored,) = _U32.unpack_from(raw)
    if stored != count:
        raise CorruptChunkError(path, f"{block.what} holds {stored} entries, the {source} says {count}")
    return raw


def columns(path: str, raw: bytes, block: BlockInfo) -> _Columns:
    """Check the columns of a decompressed block (``decompress_block``).

    A length column whose lengths are all alike is recognised by comparing its bytes with its first
    length repeated (one ``memcmp``): its sum and minimum are then a product and that length, and a
    point read finds its keys by multiplication (``block_ranges``), with no Python-level step per
    entry.
    """
    count = block.count
    keys_start = 4 + 8 * count
    view = memoryview(raw)
    key_lens = array_from_le("I", view[4 : 4 + 4 * count])
    value_lens = array_from_le("I", view[4 + 4 * count : keys_start])
    key_width = _width(raw, 4, count)
    value_width = _width(raw, 4 + 4 * count, count)
    values_start = keys_start + (key_width * count if key_width else sum(key_lens))
    values_end = values_start + (value_width * count if value_width else sum(value_lens))
    if values_end != len(raw):
        raise CorruptChunkError(path, f"{block.what}: entry lengths do not add up")
    if count and (key_width or min(key_lens)) < KEY_GROUP_PREFIX_BYTES:
        raise CorruptChunkError(path, f"{block.what}: a key is shorter than its key-group prefix")
    return _Columns(raw, key_lens, value_lens, keys_start, values_start, key_width, value_width)


def _columns(
    path: str, payload: bytes | memoryview, block: BlockInfo, decompressor: zstandard.ZstdDecompressor
) -> _Columns:
    return columns(path, decompress_block(path, payload, block, decompressor), block)


def _width(raw: bytes, start: int, count: int) -> int:
    """The length every entry of the little-endian u32 length column at ``start`` has, or 0 (they
    differ, or there are none). Compared as bytes: a memoryview compares element by element."""
    if not count:
        return 0
    first = raw[start : start + 4]
    return _U32.unpack(first)[0] if raw[start : start + 4 * count] == first * count else 0


def split(raw: bytes, start: int, lengths: array[int]) -> list[bytes]:
    """Cut ``raw[start:]`` into consecutive pieces of the given lengths (which the caller checked).

    ``map(BytesIO.read, lengths)`` runs entirely in C, twice as fast as a comprehension of slices;
    ``BytesIO`` shares ``raw`` instead of copying it.
    """
    buffer = io.BytesIO(raw)
    buffer.seek(start)
    return list(map(buffer.read, lengths))


def check_ends(path: str, block: BlockInfo, first: bytes, last: bytes) -> None:
    """The block's first and last keys inside what the index (or a version-1 footer) says bounds them."""
    if block.first_key is None:
        if _key_group(first) != block.min_key_group:
            raise CorruptChunkError(path, f"{block.what}: key groups differ from the footer's bounds")
    elif first != block.first_key:
        raise CorruptChunkError(path, f"{block.what}: its first key differs from the index's")
    if block.next_key is not None:
        if not last < block.next_key:
            raise CorruptChunkError(path, f"{block.what}: its keys reach the next block's first key")
    elif _key_group(last) != block.max_key_group:
        raise CorruptChunkError(path, f"{block.what}: key groups differ from the footer's bounds")


def increasing(keys: Sequence[bytes]) -> bool:
    return all(map(operator.lt, keys, islice(keys, 1, None)))


def check_order(path: str, table: str, keys: Sequence[bytes]) -> None:
    """Raise ``CorruptChunkError`` unless ``keys`` (of section ``table``) are strictly increasing."""
    if not increasing(keys):
        raise CorruptChunkError(path, f"section {table!r}: keys not strictly increasing")


def decode_block(
    path: str,
    payload: bytes | memoryview,
    block: BlockInfo,
    decompressor: zstandard.ZstdDecompressor | None = None,
    *,
    checked: bool = False,
) -> tuple[list[bytes], list[bytes]]:
    """The keys and values of a block, every check done (the checksum too unless ``checked``).
    Part of a block (a key's entries, a key group's): ``materializer.block_ranges``."""
    if not checked:
        checked_payload(path, payload, block)
    decompressor = decompressor or thread_decompressor()
    cols = _columns(path, payload, block, decompressor)
    keys = split(cols.raw, cols.keys_start, cols.key_lens)
    if keys:
        check_order(path, block.table, keys)
        check_ends(path, block, keys[0], keys[-1])
    return keys, split(cols.raw, cols.values_start, cols.value_lens)


def decode_blocks(
    path: str,
    data: memoryview,
    blocks: Sequence[BlockInfo],
    shift: int = 0,
    decompressor: zstandard.ZstdDecompressor | None = None,
) -> tuple[list[bytes], list[bytes]]:
    """The keys and values of consecutive blocks of one section, each at ``block.offset + shift`` in
    ``data``: the checks of ``decode_block`` on each, but one split and one order check for all of
    them (a whole read costs no more than one frame per section did)."""
    decompressor = decompressor or thread_decompressor()
    key_parts, value_parts, starts = [], [], []
    key_lens, value_lens = array("I"), array("I")
    for block in blocks:
        start = block.offset + shift
        payload = checked_payload(path, data[start : start + block.length], block)
        cols = _columns(path, payload, block, decompressor)
        starts.append(len(key_lens))
        key_lens += cols.key_lens
        value_lens += cols.value_lens
        key_parts.append(cols.raw[cols.keys_start : cols.values_start])
        value_parts.append(cols.raw[cols.values_start :])
    keys = split(b"".join(key_parts), 0, key_lens)
    if keys:
        check_order(path, blocks[0].table, keys)
        for block, start in zip(blocks, starts, strict=True):
            if block.count:  # with the order checked, the ends bound every key of every block
                check_ends(path, block, keys[start], keys[start + block.count - 1])
    return keys, split(b"".join(value_parts), 0, value_lens)
