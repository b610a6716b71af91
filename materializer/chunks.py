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
    index    := zstd(n:u32 length:u32[n] raw_length:u32[n] entries:u32[n] crc32:u32[n]
                     first_key_len:u32[n] first_keys)       the n blocks of every section, in order
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
section's key groups: ``materializer.footers``) and decoded blocks against the index
(``materializer.blocks``). Any failure
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
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

import zstandard

from backend.core.entries import Entries
from backend.core.tablekeys import key_group_prefix
from dstl.types import KeyGroupRange
from materializer.block_ranges import block_entries, entries_between, point_entries
from materializer.blocks import (
    BLOCK_SIZE,
    BlockInfo,
    SectionInfo,
    check_order,
    checked_payload,
    decode_block,
    encode_index,
    encode_section,
    prefix_end,
    thread_decompressor,
)
from materializer.errors import CorruptChunkError
from materializer.footers import FOOTER_ERRORS, parse_v1_footer, parse_v2_footer
from materializer.sections import decode_section

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
#: what ``read_chunk_index`` reads first: the whole tail of a chunk of some 4,000 blocks (16 MiB of raw entries)
TAIL_READ_BYTES = 128 << 10


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

    def decode_block(
        self, data: bytes | memoryview, block: BlockInfo, prefix: bytes | None = None
    ) -> list[tuple[bytes, bytes]]:
        """The entries of ``block``, given its bytes (``block.length`` of them), checked (crc, bounds);
        with a ``prefix``, only those whose key starts with it (cheaper than all of them)."""
        if prefix is None:
            keys, values = decode_block(self.path, data, block)
        else:
            payload = checked_payload(self.path, data, block)
            end = prefix_end(prefix)
            keys, values = entries_between(self.path, payload, block, prefix, end, thread_decompressor(), prefixes=True)
        return list(zip(keys, values, strict=True))

    def point_entries(
        self, blocks: Sequence[BlockInfo], datas: Sequence[bytes | memoryview], prefixes: Sequence[bytes]
    ) -> list[tuple[bytes, bytes]]:
        """``decode_block`` of each of ``blocks`` (given their bytes) with each of ``prefixes``
        (sorted, none a prefix of another) at once: the entries whose key starts with one of them,
        in key order; each block decoded once (``block_ranges.point_entries``)."""
        return point_entries(self.path, blocks, datas, prefixes, thread_decompressor())

    def decode_section(self, data: bytes | memoryview, name: str) -> Sequence[tuple[bytes, bytes]]:
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


class _ShortTail(Exception):
    """The tail given does not reach back to the start of the index: the last ``needed`` bytes do."""

    def __init__(self, needed: int) -> None:
        super().__init__(needed)
        self.needed = needed


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
    try:
        if version == 1:
            key_groups, sqn, sections = parse_v1_footer(path, footer, footer_start)
        else:
            key_groups, sqn, sections = parse_v2_footer(path, footer, footer_start, index_len, tail, base)
    except FOOTER_ERRORS as exc:
        raise CorruptChunkError(path, f"malformed footer: {exc}") from None
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


def _section_entries(path: str, data: memoryview, section: SectionInfo, shift: int = 0, check: bool = True) -> Entries:
    """Every entry of a section whose blocks are at ``block.offset + shift`` in ``data``; ``check=False``:
    their order left to a bulk load (``Entries.unproven_order``)."""
    keys, values = decode_section(path, data, section, shift, check_order=check)
    return Entries(keys, values, None if check else partial(check_order, path, section.name))


def _decode(path: str, data: bytes, info: ChunkIndex, check_order: bool = True) -> dict[str, Entries]:
    view = memoryview(data)
    return {section.name: _section_entries(path, view, section, 0, check_order) for section in info.sections}


def decode_chunk(path: str, data: bytes) -> Chunk:
    """Check and decode a whole chunk read from ``path``."""
    info = chunk_info(path, data)
    return Chunk(info.key_groups, info.sqn, {name: list(e) for name, e in _decode(path, data, info).items()})


def chunk_sections(
    path: str, data: bytes, key_groups: KeyGroupRange, info: ChunkIndex | None = None, check_order: bool = True
) -> dict[str, Sequence[tuple[bytes, bytes]]]:
    """The entries of each state whose key group is in ``key_groups``, as lists in key order.

    What a restore bulk-loads: a whole owned chunk decodes with C-level splits (no per-entry
    Python step); a partly owned one (after rescaling) goes through ``iter_chunk_entries``.
    ``info`` is the chunk's ``chunk_info`` if the caller has it already. ``check_order=False``: a
    whole owned chunk's keys are not compared with each other, for a bulk load to prove their
    order (``Entries.unproven_order``).
    """
    info = info or chunk_info(path, data)
    if key_groups.start <= info.key_groups.start and info.key_groups.end <= key_groups.end:
        return {name: entries for name, entries in _decode(path, data, info, check_order).items() if entries}
    sections: dict[str, list[tuple[bytes, bytes]]] = {}
    for name, key, value in _iter_entries(path, info, _checked_payloads(path, data, info), key_groups):
        sections.setdefault(name, []).append((key, value))
    return {name: entries for name, entries in sections.items()}


def iter_chunk_entries(path: str, data: bytes, key_groups: KeyGroupRange) -> Iterator[tuple[str, bytes, bytes]]:
    """The (state name, key, value) entries of the chunk whose key group is in ``key_groups``.

    States come in name order, keys in key order within a state. The header, the footer, the index
    and the checksum of every block are checked at once (a damaged chunk raises here, not at the
    first ``next``; a crc32 costs about a millisecond per MB). A block is decompressed and its
    columns checked only if it may hold wanted key groups, and only the wanted entries (plus one
    neighbour on each side, to check the order across the cut) are sliced out.
    """
    info = chunk_info(path, data)
    return _iter_entries(path, info, _checked_payloads(path, data, info), key_groups)


def _checked_payloads(path: str, data: bytes, info: ChunkIndex) -> dict[tuple[str, int], bytes | memoryview]:
    """Every block's bytes, by (state, block number), checksum checked."""
    view = memoryview(data)
    return {
        (block.table, block.number): checked_payload(path, view[block.offset : block.offset + block.length], block)
        for section in info.sections
        for block in section.blocks
    }


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
    decompressor = thread_decompressor()
    for section in info.sections:
        for number in _wanted_blocks(section, want):
            block = section.block(number)
            for key, value in block_entries(path, payloads[section.name, number], block, want, decompressor):
                yield section.name, key, value
