"""The file format of a materialized *chunk*: one key-group range of every table, as of one SQN.

A materialization splits the snapshot of the LMDB tables into chunks. A chunk holds all table
entries of ONE contiguous key-group range, across every state (LMDB database), as of one SQN.
Version 2 (written since issue 28) cuts each state's section into blocks, each a zstd frame of at
most ``BLOCK_SIZE`` raw bytes with its first key in a block index (``materializer.blocks``), so one
key's entries can be read without the rest of the chunk::

    chunk    := HEADER section* index footer TRAILER
    HEADER   := b"DMAT" version:u16 flags:u16                                        (8 bytes)
    section  := block*                                  a state's entries in key order, cut in blocks
    block    := zstd(columns)
    columns  := count:u32 key_len:u32[count] value_len:u32[count] keys values
    index    := zstd(block index columns, see materializer.blocks)        every block of every section
    footer   := JSON {"version", "key_groups": [start, end], "sqn",
                      "sections": [{"name", "offset", "length", "count", "raw_length", "blocks",
                                    "key_groups": [min, max]}],
                      "index": {"offset", "length", "raw_length", "crc32"}}
    TRAILER  := index_len:u32 footer_len:u32 footer_crc:u32 version:u16 b"TAMD"     (18 bytes)

Version 1 (still read, no longer written) has one frame per section and no index::

    chunk    := HEADER section* footer TRAILER
    section  := zstd(columns)
    footer   := JSON {"version", "key_groups", "sqn",
                      "sections": [{"name", "offset", "length", "count", "raw_length", "crc32", "key_groups"}]}
    TRAILER  := footer_len:u32 footer_crc:u32 version:u16 b"TAMD"                   (14 bytes)

The trailer's last six bytes (version and magic) are at the same place in both, so a reader
finds out which trailer it has from them. All integers are little endian; keys keep the backend's
order (they start with their key group as two *big*-endian bytes, so byte order is key-group
order). Why one chunk per key-group range:

- **Incremental materialization re-references chunks.** A chunk whose key groups did not change
  since the last materialization is referenced again instead of uploaded again, so a chunk must be
  self-describing (its range, SQN and contents are in the file) and checkable on its own, without
  the handle that first named it.
- **Rescaling reads only owned chunks.** A subtask restoring key groups ``[a, b]`` fetches only the
  chunks whose range intersects ``[a, b]``; for a chunk it owns only partly,
  ``iter_chunk_entries`` checks every checksum but decompresses only the blocks holding wanted key
  groups, and slices out just the wanted entries (a binary search over the sorted keys).
- **Restore is a bulk load.** Entries are stored sorted by key per state, which is exactly what
  LMDB's ``putmulti(append=True)`` wants: pages are filled left to right with no B-tree searches.
- **A point read reads the tail, then blocks.** Everything a lookup needs (trailer, footer and
  block index) is at the end of the chunk: ``read_chunk_index`` reads its last ``TAIL_READ_BYTES``
  (one ranged read), and the rest of the tail in a second read if the trailer says that the index
  and footer are longer. ``ChunkIndex.table(name).blocks_for(prefix)`` then names the consecutive
  blocks that may hold a key's entries (one more ranged read), and ``ChunkIndex.decode_block``
  checks and decodes one. A version-1 chunk reads the same way, as one block per section (the
  whole section), bounded by its key groups only.

Why columnar: the lengths are two ``u32`` columns, built and parsed with C-level ``array`` calls
and cut with ``map(BytesIO.read, lengths)``, instead of packing or unpacking each entry in Python;
keys of one range share their key-group prefix and mostly their serializer prefixes, so keys next
to keys (and values next to values) compress much better than interleaved records.

Every byte is checked: the header's magic, version and flags (which must be 0) are compared to
constants, the crc32 of each block's (version 1: section's) compressed bytes, of the index and of
the footer are stored, the trailer repeats the version, and the footer's sections, the index and
the footer tile the file exactly. The index is checked against the footer (block counts, lengths,
entries and raw lengths add up to the section's; first keys strictly increasing and inside the
section's key groups) and decoded blocks against the index (``materializer.blocks``). Any failure
raises ``CorruptChunkError`` naming the file. Nothing is unpickled; the only structured metadata
is JSON, validated field by field, and the index's ``u32`` columns. A point read checks what it
reads (trailer, footer, index, its blocks), not the header, which a whole read checks.

These checks say that a file is a well-formed chunk, not that it is the one a handle names:
``materializer.binding`` compares it with the handle's entry before a restore uses it.

Decompression is bounded by the recorded raw length: the frame's stated content size must equal
it *before* anything is decompressed, because python-zstandard ignores ``max_output_size`` when a
frame states its content size (it allocates what the frame says). ``max_output_size`` is passed as
well, and extra bytes after the frame are rejected.
"""

from __future__ import annotations

import json
import struct
import zlib
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate, pairwise
from typing import Any

import zstandard

from backend.core.tablekeys import KEY_GROUP_PREFIX_BYTES, key_group_prefix
from backend.core.tablekeys import key_group_of as _key_group
from dstl.types import KeyGroupRange
from materializer.blocks import (
    BLOCK_SIZE,
    MAX_U32,
    BlockInfo,
    SectionInfo,
    block_entries,
    checked_payload,
    decode_block,
    decompress,
    encode_index,
    encode_section,
    parse_index,
)
from materializer.errors import CorruptChunkError

__all__ = [
    "BLOCK_SIZE",
    "CHUNK_FORMAT_VERSION",
    "TAIL_READ_BYTES",
    "BlockInfo",
    "Chunk",
    "ChunkIndex",
    "CorruptChunkError",
    "SectionInfo",
    "chunk_info",
    "chunk_sections",
    "decode_chunk",
    "encode_chunk",
    "iter_chunk_entries",
    "read_chunk_index",
]

CHUNK_FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
CHUNK_MAGIC = b"DMAT"
CHUNK_TRAILER_MAGIC = b"TAMD"

CHUNK_HEADER = struct.Struct("<4sHH")
CHUNK_TRAILER = struct.Struct("<IIIH4s")  # version 2
CHUNK_TRAILER_V1 = struct.Struct("<IIH4s")
_TRAILER_END = struct.Struct("<H4s")  # the last bytes of either trailer: version, magic
#: what ``read_chunk_index`` reads first: the whole tail of a chunk of some 2,000 blocks
TAIL_READ_BYTES = 64 << 10
#: a version-1 section's columns: the count, two u32 columns and at most 2**32 - 1 bytes each of keys and values
_MAX_RAW_LENGTH = 4 + 8 * MAX_U32 + 2 * MAX_U32 * MAX_U32


@dataclass(frozen=True, slots=True)
class ChunkIndex:
    """A chunk's footer and block index, read without decompressing any block (``chunk_info``,
    ``read_chunk_index``): what a whole read checks first and what a point read looks keys up in."""

    path: str
    version: int
    key_groups: KeyGroupRange
    sqn: int
    sections: tuple[SectionInfo, ...]

    @property
    def counts(self) -> dict[str, int]:
        """Entries per state."""
        return {s.name: s.count for s in self.sections}

    @property
    def entries(self) -> int:
        return sum(s.count for s in self.sections)

    @property
    def raw_size(self) -> int:
        """Decompressed bytes of all sections."""
        return sum(s.raw_length for s in self.sections)

    @property
    def compressed_size(self) -> int:
        return sum(s.length for s in self.sections)

    def table(self, name: str) -> SectionInfo | None:
        """The section of state ``name`` (None: the chunk holds no entry of that state)."""
        return next((s for s in self.sections if s.name == name), None)

    def decode_block(self, data: bytes | memoryview, block: BlockInfo) -> list[tuple[bytes, bytes]]:
        """The entries of ``block``, given its bytes (``block.length`` of them), checked (crc, bounds)."""
        keys, values = decode_block(self.path, data, block)
        return list(zip(keys, values, strict=True))

    def decode_section(self, data: bytes | memoryview, name: str) -> list[tuple[bytes, bytes]]:
        """Every entry of state ``name``, given the bytes of its whole section (``byte_range``)."""
        section = self.table(name)
        if section is None:
            return []
        if len(data) != section.length:
            raise CorruptChunkError(self.path, f"section {name!r}: {len(data)} bytes given, it has {section.length}")
        return _section_entries(self.path, memoryview(data), section, -section.offset)


@dataclass(frozen=True, slots=True)
class Chunk:
    """A decoded chunk: per state, its (key, value) entries sorted by key."""

    key_groups: KeyGroupRange
    sqn: int
    sections: dict[str, list[tuple[bytes, bytes]]]


# --------------------------------------------------------------------------------------------- encode


def encode_chunk(
    key_groups: KeyGroupRange,
    sqn: int,
    sections: Mapping[str, Sequence[tuple[bytes, bytes]]],
    level: int = 1,
    block_size: int = BLOCK_SIZE,
) -> bytes:
    """Encode the entries of every state in ``key_groups`` as of ``sqn`` into one chunk file (version 2).

    ``sections`` maps a state (LMDB database) name to its entries, sorted by key; every key starts
    with its key group (2 bytes, big endian) inside ``key_groups``. Unsorted or duplicate keys, keys
    outside the range and a negative SQN raise ``ValueError``. Sections are written in name order,
    so equal contents give equal bytes; an empty section is kept (and decodes as an empty list).
    """
    if not isinstance(sqn, int) or isinstance(sqn, bool) or sqn < 0:
        raise ValueError(f"sqn must be a non-negative int, got {sqn!r}")
    if type(block_size) is not int or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    for name in sections:
        if not isinstance(name, str):
            raise ValueError(f"section names must be str, got {name!r}")
    compressor = zstandard.ZstdCompressor(level=level)
    parts = [CHUNK_HEADER.pack(CHUNK_MAGIC, CHUNK_FORMAT_VERSION, 0)]
    offset = CHUNK_HEADER.size
    encoded, meta = [], []
    for name in sorted(sections):
        section = encode_section(name, sections[name], key_groups, compressor, block_size)
        encoded.append(section)
        parts.extend(section.frames)
        meta.append(
            {
                "name": name,
                "offset": offset,
                "length": section.length,
                "count": section.count,
                "raw_length": section.raw_length,
                "blocks": len(section.frames),
                "key_groups": [section.min_key_group, section.max_key_group],
            }
        )
        offset += section.length
    raw_index = encode_index(encoded)
    index = compressor.compress(raw_index)
    footer = json.dumps(
        {
            "version": CHUNK_FORMAT_VERSION,
            "key_groups": key_groups.to_json(),
            "sqn": int(sqn),
            "sections": meta,
            "index": {"offset": offset, "length": len(index), "raw_length": len(raw_index), "crc32": zlib.crc32(index)},
        },
        separators=(",", ":"),
    ).encode()
    parts += [index, footer]
    parts.append(
        CHUNK_TRAILER.pack(len(index), len(footer), zlib.crc32(footer), CHUNK_FORMAT_VERSION, CHUNK_TRAILER_MAGIC)
    )
    return b"".join(parts)


# --------------------------------------------------------------------------------------------- the tail


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


class _ShortTail(Exception):
    """The tail given does not reach back to the start of the index: the last ``needed`` bytes do."""

    def __init__(self, needed: int) -> None:
        super().__init__(needed)
        self.needed = needed


def _malformed(path: str, exc: Exception) -> CorruptChunkError:
    return CorruptChunkError(path, f"malformed footer: {exc}")


_FOOTER_ERRORS = (ValueError, KeyError, TypeError, IndexError, RecursionError)


def _parse_tail(path: str, size: int, tail: bytes | memoryview, expect: int | None = None) -> ChunkIndex:
    """The index of a chunk of ``size`` bytes, from its last ``len(tail)`` bytes (all of it: a whole chunk).

    Raises ``_ShortTail`` if the trailer says that the index and footer start before ``tail``.
    """
    base = size - len(tail)
    if size < CHUNK_HEADER.size + CHUNK_TRAILER_V1.size or len(tail) < _TRAILER_END.size:
        raise CorruptChunkError(path, f"file truncated ({size} bytes)")
    version, magic = _TRAILER_END.unpack_from(tail, len(tail) - _TRAILER_END.size)
    if magic != CHUNK_TRAILER_MAGIC or (expect is not None and version != expect):
        raise CorruptChunkError(path, "file truncated or trailer damaged")
    if version not in READABLE_VERSIONS:
        raise CorruptChunkError(path, f"unsupported chunk format version {version} (this reader knows 1 and 2)")
    trailer = CHUNK_TRAILER_V1 if version == 1 else CHUNK_TRAILER
    if size < CHUNK_HEADER.size + trailer.size:
        raise CorruptChunkError(path, f"file truncated ({size} bytes)")
    if len(tail) < trailer.size:
        raise _ShortTail(trailer.size)
    fields = trailer.unpack_from(tail, len(tail) - trailer.size)
    index_len, footer_len, footer_crc = (0, *fields[:2]) if version == 1 else fields[:3]
    footer_end = size - trailer.size
    footer_start = footer_end - footer_len
    if footer_start - index_len < CHUNK_HEADER.size:
        raise CorruptChunkError(path, f"footer length {footer_len} points outside the file")
    if footer_start - index_len < base:
        raise _ShortTail(size - footer_start + index_len)
    footer = bytes(tail[footer_start - base : footer_end - base])
    if zlib.crc32(footer) != footer_crc:
        raise CorruptChunkError(path, "footer checksum mismatch")
    if version == 1:
        try:
            _, key_groups, sqn, raw_sections = _footer_head(footer, 1)
            sections: list[SectionInfo] = []
            offset = CHUNK_HEADER.size
            for i, raw in enumerate(raw_sections):
                sections.append(_v1_section(raw, i, offset, key_groups))
                offset += sections[-1].length
            if offset != footer_start:
                raise ValueError(f"sections end at byte {offset}, the footer starts at {footer_start}")
        except _FOOTER_ERRORS as exc:
            raise _malformed(path, exc) from None
    else:
        try:
            head, key_groups, sqn, raw_sections = _footer_head(footer, 2)
            records = []
            offset = CHUNK_HEADER.size
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
        except _FOOTER_ERRORS as exc:
            raise _malformed(path, exc) from None
        frame = tail[offset - base : footer_start - base]
        if zlib.crc32(frame) != crc:
            raise CorruptChunkError(path, "block index checksum mismatch")
        index = decompress(path, "block index", frame, raw_length, zstandard.ZstdDecompressor())
        columns = parse_index(path, index, blocks)
        sections, a = [], 0
        for name, raw in records:
            sections.append(_with_blocks(path, name, raw, columns, index, a, a + raw["blocks"]))
            a += raw["blocks"]
    names = [s.name for s in sections]
    if len(set(names)) != len(names):
        twice = next(n for i, n in enumerate(names) if n in names[:i])
        raise _malformed(path, ValueError(f"section {twice!r} appears twice"))
    return ChunkIndex(path, version, key_groups, sqn, tuple(sections))


def chunk_info(path: str, data: bytes | memoryview) -> ChunkIndex:
    """Check a whole chunk's framing, header, trailer, footer and block index; decompresses no block."""
    size = len(data)
    if size < CHUNK_HEADER.size + CHUNK_TRAILER_V1.size:
        raise CorruptChunkError(path, f"file truncated ({size} bytes)")
    magic, version, flags = CHUNK_HEADER.unpack_from(data)
    if magic != CHUNK_MAGIC:
        raise CorruptChunkError(path, f"not a materialized chunk (magic {bytes(magic)!r})")
    if version not in READABLE_VERSIONS:
        raise CorruptChunkError(path, f"unsupported chunk format version {version} (this reader knows 1 and 2)")
    if flags != 0:  # reserved; no checksum covers the header, so be strict
        raise CorruptChunkError(path, f"unknown chunk header flags {flags:#06x}")
    return _parse_tail(path, size, data, expect=version)


def read_chunk_index(
    path: str, size: int, read: Callable[[int, int], bytes], tail_bytes: int = TAIL_READ_BYTES
) -> ChunkIndex:
    """The index of a chunk of ``size`` bytes, read from its tail: ``read(offset, length)`` returns the
    chunk's bytes ``[offset, offset + length)`` (one ranged read of the pack holding it).

    One read of the last ``tail_bytes`` (at most the chunk) when they hold the index and footer; a
    second of exactly the rest of them when the trailer says they are longer.
    """
    first = min(size, max(tail_bytes, CHUNK_TRAILER.size))
    tail = _read_exactly(path, read, size - first, first)
    try:
        return _parse_tail(path, size, tail)
    except _ShortTail as short:
        rest = _read_exactly(path, read, size - short.needed, short.needed - first)
    try:
        return _parse_tail(path, size, rest + tail)
    except _ShortTail:  # the trailer's lengths held once and cannot grow: a reader's mistake
        raise CorruptChunkError(path, "its tail changed between two reads") from None


def _read_exactly(path: str, read: Callable[[int, int], bytes], offset: int, length: int) -> bytes:
    data = read(offset, length)
    if len(data) != length:
        raise CorruptChunkError(path, f"reading bytes [{offset}, {offset + length}) gave {len(data)} bytes")
    return data


# --------------------------------------------------------------------------------------------- whole chunks


def _section_entries(path: str, data: memoryview, section: SectionInfo, shift: int = 0) -> list[tuple[bytes, bytes]]:
    """Every entry of a section whose blocks are at ``block.offset + shift`` in ``data``."""
    decompressor = zstandard.ZstdDecompressor()
    keys: list[bytes] = []
    values: list[bytes] = []
    for block in section.blocks:
        start = block.offset + shift
        k, v = decode_block(path, data[start : start + block.length], block, decompressor)
        keys += k
        values += v
    return list(zip(keys, values, strict=True))


def decode_chunk(path: str, data: bytes) -> Chunk:
    """Check and decode a whole chunk read from ``path``."""
    info = chunk_info(path, data)
    view = memoryview(data)
    sections = {section.name: _section_entries(path, view, section) for section in info.sections}
    return Chunk(info.key_groups, info.sqn, sections)


def chunk_sections(path: str, data: bytes, key_groups: KeyGroupRange) -> dict[str, list[tuple[bytes, bytes]]]:
    """The entries of each state whose key group is in ``key_groups``, as lists in key order.

    What a restore bulk-loads: a whole owned chunk decodes with C-level splits (no per-entry
    Python step); a partly owned one (after rescaling) goes through ``iter_chunk_entries``.
    """
    info = chunk_info(path, data)
    if key_groups.start <= info.key_groups.start and info.key_groups.end <= key_groups.end:
        return {name: entries for name, entries in decode_chunk(path, data).sections.items() if entries}
    sections: dict[str, list[tuple[bytes, bytes]]] = {}
    for name, key, value in iter_chunk_entries(path, data, key_groups):
        sections.setdefault(name, []).append((key, value))
    return sections


def iter_chunk_entries(path: str, data: bytes, key_groups: KeyGroupRange) -> Iterator[tuple[str, bytes, bytes]]:
    """The (state name, key, value) entries of the chunk whose key group is in ``key_groups``.

    States come in name order, keys in key order within a state. The header, the footer, the index
    and the checksum of every block are checked at once (a damaged chunk raises here, not at the
    first ``next``; a crc32 costs about a millisecond per MB). A block is decompressed and its
    columns checked only if it may hold wanted key groups, and only the wanted entries (plus one
    neighbour on each side, to check the order across the cut) are sliced out.
    """
    info = chunk_info(path, data)
    view = memoryview(data)
    payloads = {
        (block.table, block.number): checked_payload(path, view[block.offset : block.offset + block.length], block)
        for section in info.sections
        for block in section.blocks
    }
    return _iter_entries(path, info, payloads, key_groups)


def _wanted_blocks(section: SectionInfo, want: KeyGroupRange) -> range:
    """The numbers of the blocks of ``section`` that may hold key groups of ``want``."""
    if not section.count or not want.intersects(section.min_key_group, section.max_key_group):
        return range(0)
    keys = section.first_keys
    if keys is None:
        return range(1)
    lo = max(bisect_right(keys, key_group_prefix(want.start)) - 1, 0)
    return range(lo, bisect_left(keys, key_group_prefix(want.end + 1), lo))


def _iter_entries(
    path: str, info: ChunkIndex, payloads: dict[tuple[str, int], bytes | memoryview], want: KeyGroupRange
) -> Iterator[tuple[str, bytes, bytes]]:
    decompressor = zstandard.ZstdDecompressor()
    for section in info.sections:
        for number in _wanted_blocks(section, want):
            block = section.block(number)
            for key, value in block_entries(path, payloads[section.name, number], block, want, decompressor):
                yield section.name, key, value
