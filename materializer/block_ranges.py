"""Part of a block: the entries of some key ranges, as safe to use as a whole decoded block.

A point read of the lazy restore (``materializer.point_reads``) needs one key's entries out of a
block of hundreds, and a sub-range read of a chunk (``chunks.read_chunk_range``) a key group's out
of the blocks at its ends. Slicing out only those entries costs a fraction of splitting the whole
block, and the checks keep it as safe: the crc of the whole block, its first and last keys against
the index (or a version-1 footer), the column lengths adding up, and the order of the keys sliced
out with one neighbour on each side (``blocks`` says why each matters).

Keys and values of one length (int keys, fixed-size values: recognised in C by counting the first
length in its column) take ``_point_entries``: a key is found by ``bytes.find`` and its value by
multiplication, with no list of offsets, no column arrays and a few Python steps per key, because
a lazy first batch decodes one block per key once the state is large.
"""

from __future__ import annotations

import struct
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from itertools import accumulate

import zstandard

from backend.core.tablekeys import KEY_GROUP_PREFIX_BYTES, key_group_prefix
from dstl.types import KeyGroupRange
from materializer.blocks import (
    BlockInfo,
    check_ends,
    check_order,
    checked_payload,
    columns,
    decompress_block,
    prefix_end,
    split,
)
from materializer.errors import CorruptChunkError

_U32 = struct.Struct("<I")

__all__ = ["block_entries", "entries_between", "entries_in_ranges", "point_entries"]


def point_entries(
    path: str,
    blocks: Sequence[BlockInfo],
    payloads: Sequence[bytes | memoryview],
    keys: Sequence[bytes],
    decompressor: zstandard.ZstdDecompressor,
) -> list[tuple[bytes, bytes]]:
    """The entries of ``blocks`` (given their bytes, checksums checked here) whose keys start with
    one of ``keys`` (sorted, none a prefix of another), in key order: per block ``_point_entries``
    when its keys and values have one length each and every key in ``keys`` has it, else
    ``entries_in_ranges`` of their prefix ranges. One call for all the blocks of a lookup, as the
    lazy restore makes one per key (or keys sharing blocks) once the state is large."""
    found: list[tuple[bytes, bytes]] = []
    for block, payload in zip(blocks, payloads, strict=True):
        raw = decompress_block(path, checked_payload(path, payload, block), block, decompressor)
        entries = _point_entries(path, raw, block, keys)
        if entries is None:
            entries = entries_in_ranges(path, raw, block, [(k, prefix_end(k)) for k in keys], prefixes=True)
        found += zip(*entries, strict=True)  # (keys, values)
    return found


def _point_entries(
    path: str, raw: bytes, block: BlockInfo, keys: Sequence[bytes]
) -> tuple[list[bytes], list[bytes]] | None:
    """``point_entries`` of a decompressed block of keys and values of one length each, every key
    of ``keys`` of that length; None if they are not (the general path takes it)."""
    count = block.count
    keys_start = 4 + 8 * count  # ``decompress_block`` checked that ``raw`` holds the length columns
    if not count:
        return None
    key_len, value_len = raw[4:8], raw[4 + 4 * count : 8 + 4 * count]
    # count non-overlapping matches: ``count`` of them in ``4 * count`` bytes tile the column, so
    # every length is the first one
    if raw.count(key_len, 4, 4 + 4 * count) != count or raw.count(value_len, 4 + 4 * count, keys_start) != count:
        return None
    (width,) = _U32.unpack(key_len)
    if len(keys[0]) != width or (len(keys) > 1 and any(len(k) != width for k in keys)):
        return None
    (value_width,) = _U32.unpack(value_len)
    values_start = keys_start + width * count
    if values_start + value_width * count != len(raw):
        raise CorruptChunkError(path, f"{block.what}: entry lengths do not add up")
    if width < KEY_GROUP_PREFIX_BYTES:
        raise CorruptChunkError(path, f"{block.what}: a key is shorter than its key-group prefix")
    check_ends(path, block, raw[keys_start : keys_start + width], raw[values_start - width : values_start])
    keys_out: list[bytes] = []
    values_out: list[bytes] = []
    find = raw.find
    at = keys_start
    for key in keys:
        found = find(key, at, values_start)
        while found != -1 and (found - keys_start) % width:  # a match across two keys
            found = find(key, found + 1, values_start)
        if found == -1:
            continue
        after = found + width  # the order across the cut: one neighbour each side
        if (found > keys_start and not raw[found - width : found] < key) or (
            after < values_start and not key < raw[after : after + width]
        ):  # ``blocks.check_order``'s refusal, by two comparisons: this runs once per key of a batch
            raise CorruptChunkError(path, f"section {block.table!r}: keys not strictly increasing")
        keys_out.append(key)
        value_at = values_start + (found - keys_start) // width * value_width
        values_out.append(raw[value_at : value_at + value_width])
        at = after
    return keys_out, values_out


def entries_between(
    path: str,
    payload: bytes | memoryview,
    block: BlockInfo,
    low: bytes,
    high: bytes | None,
    decompressor: zstandard.ZstdDecompressor,
    prefixes: bool = False,
) -> tuple[list[bytes], list[bytes]]:
    """The keys and values of a block (checksum checked) with ``low <= key < high`` (None: no bound).

    Only those entries, plus one neighbour on each side to check the order across the cut, are
    sliced out (a binary search over the keys); the block's first and last keys are checked
    against the index (or a version-1 footer) as a whole decode checks them.
    """
    raw = decompress_block(path, payload, block, decompressor)
    return entries_in_ranges(path, raw, block, [(low, high)], prefixes)


def entries_in_ranges(
    path: str,
    raw: bytes,
    block: BlockInfo,
    ranges: Sequence[tuple[bytes, bytes | None]],
    prefixes: bool = False,
) -> tuple[list[bytes], list[bytes]]:
    """``entries_between`` for several ``(low, high)`` ranges (sorted, not overlapping) at once: the
    block (``raw``: ``decompress_block``) has its columns checked once, each range found by its own binary search
    (a batch's keys that share a block cost one decode, not one each). ``prefixes``: each range is
    the keys starting with ``low`` (``high`` is ``prefix_end(low)``), so a ``low`` as long as every
    key of the block is one key, found by a search of the keys' bytes."""
    cols = columns(path, raw, block)
    count, width = block.count, cols.key_width
    if not count:
        return [], []
    if width:  # keys of one length: the i-th starts at keys_start + i * width
        key_starts: Sequence[int] = range(cols.keys_start, cols.values_start + 1, width)
    else:
        key_starts = list(accumulate(cols.key_lens, initial=cols.keys_start))
    check_ends(path, block, raw[key_starts[0] : key_starts[1]], raw[key_starts[-2] : key_starts[-1]])

    def key_at(i: int) -> bytes:
        return raw[key_starts[i] : key_starts[i + 1]]

    value_ends = None
    if not cols.value_width and len(ranges) > 1:  # several ranges: one pass, not a sum per range
        value_ends = list(accumulate(cols.value_lens, initial=cols.values_start))

    def value_start(i: int) -> int:
        if cols.value_width:
            return cols.values_start + i * cols.value_width
        return value_ends[i] if value_ends is not None else cols.values_start + sum(cols.value_lens[:i])

    keys_out: list[bytes] = []
    values_out: list[bytes] = []
    at = 0
    for low, high in ranges:
        if prefixes and width and len(low) == width:  # one whole key of keys of one length: found in C
            lo = _find_key(raw, low, cols.keys_start, at, width, count)
            lo, hi = (lo, lo + 1) if lo >= 0 else (at, at)  # not there: the next range searches from here
        else:
            lo = bisect_left(range(count), low, at, key=key_at)
            hi = count if high is None else bisect_left(range(count), high, lo, key=key_at)
        at = hi
        if lo >= hi:
            continue
        a, b = max(lo - 1, 0), min(hi + 1, count)  # one neighbour each side: the order across the cut
        keys = split(raw, key_starts[a], cols.key_lens[a:b])
        check_order(path, block.table, keys)
        keys_out += keys[lo - a : hi - a]
        values_out += split(raw, value_start(lo), cols.value_lens[lo:hi])
    return keys_out, values_out


def _find_key(raw: bytes, key: bytes, keys_start: int, at: int, width: int, count: int) -> int:
    """The index (``at`` or after) of ``key`` among the ``count`` keys of ``width`` bytes from
    ``keys_start`` in ``raw``, or -1: ``bytes.find`` (in C), skipping a match across two keys."""
    end = keys_start + count * width
    found = raw.find(key, keys_start + at * width, end)
    while found != -1 and (found - keys_start) % width:
        found = raw.find(key, found + 1, end)
    return -1 if found == -1 else (found - keys_start) // width


def block_entries(
    path: str,
    payload: bytes | memoryview,
    block: BlockInfo,
    want: KeyGroupRange,
    decompressor: zstandard.ZstdDecompressor,
) -> Iterator[tuple[bytes, bytes]]:
    """The entries of a block (checksum checked) whose key group is in ``want``, in key order."""
    high = key_group_prefix(want.end + 1)  # want.end + 1 fits in the prefix
    keys, values = entries_between(path, payload, block, key_group_prefix(want.start), high, decompressor)
    return zip(keys, values, strict=True)
