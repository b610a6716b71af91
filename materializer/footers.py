"""The JSON footers of chunk format versions 1 and 2, checked field by field, and a version-2 chunk's
block index checked against its footer (the format is ``materializer.chunks``).

Why a module of its own: the footer is the one structured metadata of a chunk, and every field of
it is checked before any offset or length in it is used (bounds, tiling, sums); the two versions'
checks share most of their code, and ``materializer.chunks`` keeps the framing and the readers.
A malformed field raises ``ValueError`` (or ``KeyError``, ``TypeError``, ...: ``FOOTER_ERRORS``),
which the caller reports as a malformed footer naming the file; an index that decodes but
disagrees with its footer raises ``CorruptChunkError`` here.
"""

from __future__ import annotations

import json
import zlib
from array import array
from itertools import accumulate, pairwise
from typing import Any

import zstandard

from backend.core.tablekeys import KEY_GROUP_PREFIX_BYTES
from backend.core.tablekeys import key_group_of as _key_group
from dstl.types import KeyGroupRange
from materializer.blocks import MAX_U32, SectionInfo, decompress, parse_index
from materializer.errors import CorruptChunkError

__all__ = ["FOOTER_ERRORS", "HEADER_SIZE", "parse_v1_footer", "parse_v2_footer"]

#: what a malformed footer raises while it is parsed
FOOTER_ERRORS = (ValueError, KeyError, TypeError, IndexError, RecursionError)
#: where the first section starts: after the chunk's header
HEADER_SIZE = 8  # materializer.chunks.CHUNK_HEADER.size
#: a version-1 section's columns: the count, two u32 columns and at most 2**32 - 1 bytes each of keys and values
_MAX_RAW_LENGTH = 4 + 8 * MAX_U32 + 2 * MAX_U32 * MAX_U32

Footer = tuple[KeyGroupRange, int, list[SectionInfo]]


def _int(value: Any, what: str, low: int = 0, high: int | None = None) -> int:
    if type(value) is not int or value < low or (high is not None and value > high):
        bounds = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{what} must be an int {bounds}, got {value!r}")
    return value


def _section_bounds(raw: dict[str, Any], name: str, count: int, chunk_range: KeyGroupRange) -> KeyGroupRange:
    bounds = KeyGroupRange.from_json(raw["key_groups"])
    if count == 0:
        if bounds != KeyGroupRange.empty():
            raise ValueError(f"empty section {name!r} has key groups {bounds.to_json()}")
    elif not (chunk_range.start <= bounds.start <= bounds.end <= chunk_range.end):
        raise ValueError(f"section {name!r} key groups {bounds.to_json()} outside the chunk's range")
    return bounds


def _section_head(raw: Any, i: int, offset: int) -> tuple[str, dict[str, Any]]:
    if not isinstance(raw, dict):
        raise ValueError(f"section {i} is not an object")
    name = raw["name"]
    if not isinstance(name, str):
        raise ValueError(f"section {i} name is not a string")
    if raw["offset"] != offset or type(raw["offset"]) is not int:
        raise ValueError(f"section {name!r} at offset {raw['offset']!r}, the previous section ends at {offset}")
    return name, raw


def _v1_section(raw: Any, i: int, offset: int, chunk_range: KeyGroupRange) -> SectionInfo:
    name, raw = _section_head(raw, i, offset)
    count = _int(raw["count"], f"section {name!r} count", 0, MAX_U32)
    bounds = _section_bounds(raw, name, count, chunk_range)
    length = _int(raw["length"], f"section {name!r} length", 1)
    raw_length = _int(raw["raw_length"], f"section {name!r} raw_length", 4 + 8 * count, _MAX_RAW_LENGTH)
    crc = _int(raw["crc32"], f"section {name!r} crc32", 0, MAX_U32)
    return SectionInfo(
        name=name,
        offset=offset,
        length=length,
        count=count,
        raw_length=raw_length,
        min_key_group=bounds.start,
        max_key_group=bounds.end,
        block_offsets=array("Q", [offset]),
        block_lengths=array("Q", [length]),
        block_raw_lengths=array("Q", [raw_length]),
        block_counts=array("Q", [count]),
        block_crcs=array("Q", [crc]),
        first_keys=None,
    )


def _v2_section(raw: Any, i: int, offset: int, chunk_range: KeyGroupRange) -> tuple[str, dict[str, Any]]:
    """A version-2 section's footer record, checked as far as it can be without the index."""
    name, raw = _section_head(raw, i, offset)
    blocks = _int(raw["blocks"], f"section {name!r} blocks", 0, MAX_U32)
    count = _int(raw["count"], f"section {name!r} count", blocks, blocks * MAX_U32)
    _section_bounds(raw, name, count, chunk_range)
    _int(raw["length"], f"section {name!r} length", blocks, blocks * MAX_U32)
    _int(raw["raw_length"], f"section {name!r} raw_length", 4 * blocks + 8 * count, blocks * MAX_U32)
    return name, raw


def _with_blocks(
    path: str, name: str, raw: dict[str, Any], columns: tuple[array[int], ...], index: bytes, a: int, b: int
) -> SectionInfo:
    """A version-2 section with its blocks ``[a, b)`` of the index, checked against its footer record."""
    lengths, raw_lengths, counts, crcs = (column[a:b] for column in columns[:4])
    key_offsets = columns[5][a : b + 1]
    offset, bounds = raw["offset"], KeyGroupRange.from_json(raw["key_groups"])
    what = f"block index of section {name!r}"
    if sum(lengths) != raw["length"] or (b > a and min(lengths) < 1):
        raise CorruptChunkError(path, f"{what}: block lengths do not add up to the section's")
    if sum(raw_lengths) != raw["raw_length"] or sum(counts) != raw["count"] or (b > a and min(counts) < 1):
        raise CorruptChunkError(path, f"{what}: entries or raw lengths do not add up to the section's")
    first_keys = tuple(index[key_offsets[i] : key_offsets[i + 1]] for i in range(b - a))
    if first_keys:
        if min(map(len, first_keys)) < KEY_GROUP_PREFIX_BYTES:
            raise CorruptChunkError(path, f"{what}: a first key is shorter than its key-group prefix")
        if any(not x < y for x, y in pairwise(first_keys)):
            raise CorruptChunkError(path, f"{what}: first keys not strictly increasing")
        if _key_group(first_keys[0]) != bounds.start or _key_group(first_keys[-1]) > bounds.end:
            raise CorruptChunkError(path, f"{what}: first keys outside the section's key groups")
    return SectionInfo(
        name=name,
        offset=offset,
        length=raw["length"],
        count=raw["count"],
        raw_length=raw["raw_length"],
        min_key_group=bounds.start,
        max_key_group=bounds.end,
        block_offsets=array("Q", accumulate(lengths[:-1], initial=offset)) if first_keys else array("Q"),
        block_lengths=lengths,
        block_raw_lengths=raw_lengths,
        block_counts=counts,
        block_crcs=crcs,
        first_keys=first_keys,
    )


def _footer_head(footer: bytes, version: int) -> tuple[dict[str, Any], KeyGroupRange, int, list[Any]]:
    index = json.loads(footer)
    if not isinstance(index, dict):
        raise ValueError("footer is not an object")
    if index["version"] != version or type(index["version"]) is not int:
        raise ValueError(f"footer version {index['version']!r} differs from the header's {version}")
    key_groups = KeyGroupRange.from_json(index["key_groups"])
    sqn = _int(index["sqn"], "sqn")  # any size: only compared with the handle's (bounded) sqn
    sections = index["sections"]
    if not isinstance(sections, list):
        raise ValueError("sections is not a list")
    return index, key_groups, sqn, sections


def _unique(sections: list[SectionInfo]) -> list[SectionInfo]:
    names = [s.name for s in sections]
    if len(set(names)) != len(names):
        twice = next(n for i, n in enumerate(names) if n in names[:i])
        raise ValueError(f"section {twice!r} appears twice")
    return sections


def parse_v1_footer(path: str, footer: bytes, footer_start: int) -> Footer:
    """A version-1 footer: its sections tile the file from the header to the footer."""
    _, key_groups, sqn, raw_sections = _footer_head(footer, 1)
    sections: list[SectionInfo] = []
    offset = HEADER_SIZE
    for i, raw in enumerate(raw_sections):
        sections.append(_v1_section(raw, i, offset, key_groups))
        offset += sections[-1].length
    if offset != footer_start:
        raise ValueError(f"sections end at byte {offset}, the footer starts at {footer_start}")
    return key_groups, sqn, _unique(sections)


def parse_v2_footer(
    path: str, footer: bytes, footer_start: int, index_len: int, tail: bytes | memoryview, base: int
) -> Footer:
    """A version-2 footer and the block index it names (in ``tail``, the chunk's bytes from ``base``):
    sections, then the index of ``index_len`` bytes, tile the file from the header to the footer."""
    head, key_groups, sqn, raw_sections = _footer_head(footer, 2)
    records = []
    offset = HEADER_SIZE
    for i, raw in enumerate(raw_sections):
        records.append(_v2_section(raw, i, offset, key_groups))
        offset += records[-1][1]["length"]
    blocks = sum(r["blocks"] for _, r in records)
    info = head["index"]
    if not isinstance(info, dict):
        raise ValueError("index is not an object")
    if info["offset"] != offset or type(info["offset"]) is not int:
        raise ValueError(f"index at offset {info['offset']!r}, the sections end at {offset}")
    length = _int(info["length"], "index length", 1, MAX_U32)
    if length != index_len or offset + length != footer_start:
        raise ValueError(f"index of {length} bytes from {offset}, the footer starts at {footer_start}")
    bounds = (4 + 22 * blocks, 4 + 20 * blocks + blocks * MAX_U32)  # first keys of 2 to 2**32 - 1 bytes
    raw_length = _int(info["raw_length"], "index raw_length", *bounds)
    crc = _int(info["crc32"], "index crc32", 0, MAX_U32)
    frame = tail[offset - base : footer_start - base]
    if zlib.crc32(frame) != crc:
        raise CorruptChunkError(path, "block index checksum mismatch")
    index = decompress(path, "block index", frame, raw_length, zstandard.ZstdDecompressor())
    columns = parse_index(path, index, blocks)
    sections, a = [], 0
    for name, raw in records:
        sections.append(_with_blocks(path, name, raw, columns, index, a, a + raw["blocks"]))
        a += raw["blocks"]
    return key_groups, sqn, _unique(sections)
