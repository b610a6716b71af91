"""A whole section's blocks decoded at once: what an eager restore and a hydration read.

A section of a version-2 chunk (``materializer.chunks``) is a run of blocks (``materializer.blocks``),
about 8 KiB of entries each: a restore of millions of entries decodes thousands of them. Decoding
them one at a time costs a dozen Python-level steps per block (a ``BlockInfo``, the checksum, the
frame's stated size, the decompression, the count, two length columns, their widths and sums, the
slices of keys and values, the first and last keys), as much CPU as the zstd decompression itself.
``decode_section`` does each of those steps once for all the blocks of the section, as C-level
passes (``map`` over the blocks' payloads, slices and columns, comparisons of whole columns), and
decompresses every frame of the section in one call (``multi_decompress_to_buffer``, the output
sizes the index's) that holds no GIL throughout; keys and values are cut from the joined columns
(``backend.core.entries.cut``).

Every check of ``blocks.decode_blocks`` is made, over columns instead of per block: each block's
crc32, the frame's stated content size against the index's raw length (before decompressing), the
frame with no bytes after it (that call ignores them, so each frame's length is compared with what
its header, its one block's header and its checksum flag add up to; a frame of several zstd blocks
goes the slow way), the decompressed length, the entry count a block stores, that its length
columns and key and value bytes fill it exactly, no key shorter than its key-group prefix, the
first key of each block equal to the index's, keys strictly increasing through the section (the
index's first keys then bound every block's last key; ``check_order=False`` leaves this one to a
bulk load, ``backend.core.entries``) and the last key in the section's last key group. Where any of
them fails, the section is decoded again block by block (``decode_blocks``), which raises the
``CorruptChunkError`` naming the file, the section and the block that a one-block read would
raise; so the fast path needs no error messages of its own, and sound data never pays for them.
"""

from __future__ import annotations

import operator
import zlib
from array import array
from collections.abc import Callable, Iterable
from functools import partial
from itertools import accumulate, islice, repeat
from typing import cast

import zstandard

from backend.core.entries import cut
from backend.core.tablekeys import KEY_GROUP_PREFIX_BYTES
from backend.core.tablekeys import key_group_of as _key_group
from dstl.format import array_from_le, le_bytes
from materializer.blocks import SectionInfo, decode_blocks, increasing, thread_decompressor

__all__ = ["decode_section"]

#: the first four bytes of a decompressed block: its entry count
_COUNT = operator.itemgetter(slice(0, 4))
_cut = cast("Callable[[memoryview, slice], memoryview]", operator.getitem)
_view = cast("Callable[[bytes], memoryview]", memoryview)
#: a zstd block header: three little-endian bytes
_u24 = partial(int.from_bytes, byteorder="little")


def decode_section(
    path: str,
    data: memoryview,
    section: SectionInfo,
    shift: int = 0,
    decompressor: zstandard.ZstdDecompressor | None = None,
    check_order: bool = True,
) -> tuple[list[bytes], list[bytes]]:
    """The keys and values of every block of ``section``, each block at ``offset + shift`` in ``data``,
    every check of ``decode_blocks`` made (module doc); a failed check raises its ``CorruptChunkError``.

    ``check_order=False``: the keys are not compared with each other (the caller has ``check_order``
    run where a bulk load does not prove them strictly increasing: ``backend.core.entries``).
    """
    decompressor = decompressor or thread_decompressor()
    if section.first_keys is not None and section.block_count:
        decoded = _decode_columns(data, section, shift, decompressor, check_order)
        if decoded is not None:
            return decoded
    return decode_blocks(path, data, section.blocks, shift, decompressor)


def _decode_columns(
    data: memoryview, section: SectionInfo, shift: int, decompressor: zstandard.ZstdDecompressor, check_order: bool
) -> tuple[list[bytes], list[bytes]] | None:
    """``decode_section`` of a version-2 section as C-level passes over its blocks, or None if any
    check fails (the caller then finds which, block by block)."""
    n, counts = section.block_count, section.block_counts
    starts = list(map(operator.add, section.block_offsets, repeat(shift, n)))
    ends = list(map(operator.add, starts, section.block_lengths))
    payloads = list(map(data.__getitem__, map(slice, starts, ends)))
    if array("I", map(zlib.crc32, payloads)) != section.block_crcs:
        return None
    raws = _decompressed(data, payloads, starts, section, decompressor)
    if raws is None:
        return None
    if array("I", map(len, raws)) != section.block_raw_lengths or b"".join(map(_COUNT, raws)) != le_bytes(counts):
        return None
    # per block: count:u32 key_len:u32[count] value_len:u32[count] keys values
    lens_end = list(map(operator.add, map(operator.mul, counts, repeat(4, n)), repeat(4, n)))
    keys_start = list(map(operator.add, lens_end, map(operator.mul, counts, repeat(4, n))))
    key_column = _joined(raws, repeat(4, n), lens_end)
    value_column = _joined(raws, lens_end, keys_start)
    total = section.count
    if len(key_column) != 4 * total or len(value_column) != 4 * total:
        return None  # a block shorter than its length columns
    key_lens, key_width = _column(key_column, total)
    value_lens, value_width = _column(value_column, total)
    block_starts = list(accumulate(counts, initial=0))
    key_bytes = _block_sums(key_lens, key_width, counts, block_starts)
    value_bytes = _block_sums(value_lens, value_width, counts, block_starts)
    values_start = list(map(operator.add, keys_start, key_bytes))
    if list(map(operator.add, values_start, value_bytes)) != section.block_raw_lengths.tolist():
        return None  # the lengths do not fill a block exactly
    if (key_width or min(key_lens)) < KEY_GROUP_PREFIX_BYTES:
        return None
    keys = cut(_joined(raws, keys_start, values_start), total, key_width, key_lens)
    if tuple(map(keys.__getitem__, islice(block_starts, n))) != section.first_keys:
        return None
    if (check_order and not increasing(keys)) or _key_group(keys[-1]) != section.max_key_group:
        return None
    values = cut(_joined(raws, values_start, repeat(None, n)), total, value_width, value_lens)
    return keys, values


def _decompressed(
    data: memoryview,
    payloads: list[memoryview],
    starts: list[int],
    section: SectionInfo,
    decompressor: zstandard.ZstdDecompressor,
) -> list[memoryview] | None:
    """Every block's frame decompressed, in one call that holds no GIL (``multi_decompress_to_buffer``,
    the output sizes the index's), or None if a frame is not one whole frame stating its raw length.

    That call ignores bytes after a frame, which ``decompress(allow_extra_data=False)`` refuses, so
    a frame is first checked to be exactly as long as its parts say: header, one block (the last),
    and its checksum if it has one. A frame of several zstd blocks (an entry larger than a block)
    is left to the block-by-block decode.
    """
    n, lengths = len(payloads), section.block_lengths
    try:
        if list(map(zstandard.frame_content_size, payloads)) != section.block_raw_lengths.tolist():
            return None  # checked before decompressing: python-zstandard allocates what a frame states
        heads = list(map(zstandard.frame_header_size, payloads))
    except zstandard.ZstdError:
        return None
    if min(map(operator.sub, lengths, heads)) < 3:
        return None
    ends = map(operator.add, heads, repeat(3, n))
    blocks = list(map(_u24, map(_cut, payloads, map(slice, heads, ends))))
    if set(map(operator.and_, blocks, repeat(3, n))) != {1}:  # the last block, raw or compressed
        return None
    checksums = map(operator.and_, map(operator.getitem, payloads, repeat(4, n)), repeat(4, n))  # 4 bytes or none
    sizes = map(operator.add, map(operator.add, heads, repeat(3, n)), map(operator.rshift, blocks, repeat(3, n)))
    if list(map(operator.add, sizes, checksums)) != lengths.tolist():
        return None
    segments = array("Q", bytes(16 * n))
    segments[0::2] = array("Q", starts)
    segments[1::2] = array("Q", lengths)
    try:
        out = decompressor.multi_decompress_to_buffer(
            zstandard.BufferWithSegments(data, segments.tobytes()),
            decompressed_sizes=array("Q", section.block_raw_lengths).tobytes(),
            threads=1,
        )
    except (zstandard.ZstdError, ValueError, MemoryError):
        return None
    return list(map(_view, cast("Iterable[bytes]", out)))  # a sequence of buffers


def _joined(raws: list[memoryview], starts: Iterable[int], ends: Iterable[int | None]) -> bytes:
    """``raws[i][starts[i]:ends[i]]`` for every block ``i``, joined."""
    return b"".join(map(_cut, raws, map(slice, starts, ends)))


def _column(column: bytes, count: int) -> tuple[array[int], int]:
    """A little-endian u32 length column of ``count`` entries, and the length all of them have (0: they differ)."""
    first = column[:4]
    width = int.from_bytes(first, "little") if column == first * count else 0
    return array_from_le("I", column), width


def _block_sums(lengths: array[int], width: int, counts: array[int], block_starts: list[int]) -> list[int]:
    """The bytes of each block's keys (or values): its entries' lengths added up."""
    if width:
        return list(map(operator.mul, counts, repeat(width, len(counts))))
    return list(map(sum, map(lengths.__getitem__, map(slice, block_starts, islice(block_starts, 1, None)))))
