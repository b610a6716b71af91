"""The changelog file format (version 1): segments that can be read on their own, plus a footer.

One file holds the changesets of many writers (one flush of the batching scheduler)::

    file    := HEADER [notes] segment* footer TRAILER
    HEADER  := b"DSTL" version:u16 flags:u16                                   (8 bytes)
    notes   := notes_len:u32 notes_crc:u32 JSON [note, ...]       (only with flag NOTES)
    segment := SEG_HEADER zstd(columns)
    SEG_HEADER := b"DSEG" version:u16 0:u16 sqn:u64 log_crc:u32 raw_len:u32
                  comp_len:u32 payload_crc:u32 header_crc:u32                  (36 bytes)
    columns := count:u32 key_groups:u16[count] lengths:u32[count] payloads
    footer  := JSON {"version", "segments": [{"log_id", "sqn", "offset", "length", ...}]}
    TRAILER := footer_len:u32 footer_crc:u32 version:u16 b"LTSD"               (14 bytes)

All integers are little endian. Why this shape:

- A handle carries the byte range of each of its segments, so a reader fetches exactly the
  segments it needs with one ranged read each and decompresses only those (Flink must decompress
  a file from its start). The segment header repeats the version, the SQN and a checksum of the
  log id, so a read of a single range is still fully checked: a wrong version, a handle pointing
  at the wrong segment, a flipped byte or a truncated file each raise ``CorruptChangelogError``.
- Records keep their append order inside a segment (reads return changes in order). Key groups
  and lengths are stored as columns, which the encoder builds with C-level ``array`` calls instead
  of a Python loop per record, and which zstd compresses to almost nothing. The design sketch
  suggested per-key-group offsets inside a segment; that would cost the global order, and since a
  zstd frame has to be decompressed up to an offset anyway it would save no decompression. The
  segment's key-group bounds (in the handle and footer) let a rescaled reader skip whole segments.
- The footer makes a file self-describing for ``verify``-style tools and orphan analysis; the
  read path does not need it.
- Notes (flag ``NOTES``) ride in the file a flush writes: a persist may carry one (``Note``), and
  the note says which persist it belongs to (log id, SQN range, the segments of that persist in
  earlier files and in this one), so a reader rebuilds the persist's handle from the note alone.
  They sit right after the header, so one ranged read of the file's start finds them; their
  segments' offsets count from the end of the notes (they are written before the segments'
  final offsets are known). This is how a Spark task's pending record becomes durable with its
  changes, in the same file and request.
- Encoding a flush waits for the GIL as seldom as it can. The encoder runs in a thread of its
  own while the operator's thread runs Python, and every call that releases the GIL (zstd,
  ``zlib.crc32`` of more than 5 KiB) waits up to the interpreter's switch interval (5 ms) to get
  it back from a busy operator thread: a flush of four segments, each compressed and checksummed
  by its own calls, waited longer than it compressed. So ``encode_file`` builds the columns of
  all segments first, compresses them with one call (python-zstandard's
  ``multi_compress_to_buffer``, in groups of ``COMPRESS_GROUP_BYTES`` raw bytes, the memory a
  group holds at once), and checksums in slices short enough that zlib keeps the GIL (crc32 runs
  at several GB/s: the slices cost less than one wait). What the writer's cut computed already
  (the key groups as an array, their bounds, the payloads' lengths, and the segment's columns,
  joined on the thread that holds the GIL anyway) rides in the ``ChangeSet``: the encoder's own
  Python work is the framing of each file.
- Nothing is unpickled: the only structured metadata is JSON, validated field by field.
- Every size is bounded before it is used: a segment's frame must state the header's raw length
  before it is decompressed (python-zstandard allocates what a frame states), and JSON nested past
  the parser's stack is corruption like any other, named by its file.
"""

from __future__ import annotations

import json
import struct
import sys
import zlib
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import zstandard

from dstl.errors import CorruptChangelogError
from dstl.types import HANDLE_FORMAT_VERSION, MAX_SQN, ChangelogHandle, KeyGroupRange, NotedHandle, SegmentRef

FORMAT_VERSION = 1
FILE_MAGIC = b"DSTL"
TRAILER_MAGIC = b"LTSD"
SEGMENT_MAGIC = b"DSEG"

FILE_HEADER = struct.Struct("<4sHH")
NOTES_HEADER = struct.Struct("<II")
#: file header flag: a notes section follows the header
FLAG_NOTES = 0x1
#: bytes a reader fetches first to find a file's notes (more if they are longer)
NOTES_PROBE_BYTES = 64 * 1024
SEGMENT_HEADER = struct.Struct("<4sHHQIIIII")
TRAILER = struct.Struct("<IIH4s")
_SEG_HEADER_CRC_SPAN = SEGMENT_HEADER.size - 4

#: A single record may not exceed this (lengths are stored in 32 bits).
MAX_RECORD_BYTES = (1 << 32) - 1
#: raw (uncompressed) bytes of the segments compressed by one call (module doc)
COMPRESS_GROUP_BYTES = 16 << 20
#: the longest slice ``zlib.crc32`` checksums without releasing the GIL (CPython releases it above)
_CRC_SLICE = 5 * 1024

_BIG_ENDIAN_HOST = sys.byteorder == "big"


def log_crc(log_id: str) -> int:
    return zlib.crc32(log_id.encode())


@dataclass(frozen=True, slots=True)
class ChangeSet:
    """The closed changes of one writer with one SQN, in append order. ``lengths`` (the payloads'
    lengths, ``array('I')``) and ``bounds`` (the smallest and largest key group) are what the
    writer's cut computed; the encoder computes them when they are None. ``columns``: the
    segment's uncompressed columns, joined by the writer's cut (``payloads`` is then empty)."""

    log_id: str
    sqn: int
    key_groups: array[int]  # array('H')
    payloads: Sequence[bytes]
    size: int  # payload bytes
    lengths: array[int] | None = None
    bounds: tuple[int, int] | None = None
    columns: bytes | None = None

    @property
    def records(self) -> int:
        return len(self.key_groups)

    def key_group_bounds(self) -> tuple[int, int]:
        """The smallest and largest key group; ``(0, -1)`` without records."""
        if self.bounds is not None:
            return self.bounds
        kgs = self.key_groups
        return (min(kgs), max(kgs)) if kgs else (0, -1)


@dataclass(frozen=True, slots=True)
class EncodedSegment:
    log_id: str
    sqn: int
    offset: int
    length: int
    records: int
    min_key_group: int
    max_key_group: int


def le_bytes(values: array[int]) -> bytes:
    if _BIG_ENDIAN_HOST:  # pragma: no cover - no big-endian CI
        values = array(values.typecode, values)
        values.byteswap()
    return values.tobytes()


def array_from_le(typecode: str, data: bytes | memoryview) -> array[int]:
    values = array(typecode)
    values.frombytes(data)
    if _BIG_ENDIAN_HOST:  # pragma: no cover
        values.byteswap()
    return values


def columns_head(key_groups: array[int], lengths: array[int]) -> bytes:
    """The columns of a segment before its payloads: ``count:u32 key_groups:u16[count]
    lengths:u32[count]``; the payloads follow back to back (``columns := head payloads``)."""
    return b"".join((struct.pack("<I", len(key_groups)), le_bytes(key_groups), le_bytes(lengths)))


def _columns(changeset: ChangeSet) -> bytes:
    """The segment's uncompressed columns (module doc)."""
    if changeset.columns is not None:
        return changeset.columns
    lengths = changeset.lengths
    if lengths is None:
        lengths = array("I", map(len, changeset.payloads))
    return b"".join([columns_head(changeset.key_groups, lengths), *changeset.payloads])


def _segment(changeset: ChangeSet, raw_len: int, payload: Any) -> tuple[bytes, Any]:
    """A segment as its header (checksums included) and its compressed ``payload`` (any buffer)."""
    head = SEGMENT_HEADER.pack(
        SEGMENT_MAGIC,
        FORMAT_VERSION,
        0,
        changeset.sqn,
        log_crc(changeset.log_id),
        raw_len,
        len(payload),
        _crc32_holding_gil(payload),
        0,
    )[:_SEG_HEADER_CRC_SPAN]
    return head + struct.pack("<I", zlib.crc32(head)), payload


def _crc32_holding_gil(data: Any) -> int:
    """``zlib.crc32(data)``, in slices zlib checksums without releasing the GIL (module doc)."""
    if len(data) <= _CRC_SLICE:
        return zlib.crc32(data)
    view = memoryview(data)
    crc = 0
    for start in range(0, len(view), _CRC_SLICE):
        crc = zlib.crc32(view[start : start + _CRC_SLICE], crc)
    return crc


def _encode_segments(changesets: Sequence[ChangeSet], compressor: zstandard.ZstdCompressor) -> list[tuple[bytes, Any]]:
    """Every changeset's segment as (header, compressed payload): the columns of up to
    ``COMPRESS_GROUP_BYTES`` compressed by one call that releases the GIL once (module doc)."""
    segments: list[tuple[bytes, Any]] = []
    group: list[bytes | bytearray | memoryview] = []
    size = 0

    def compress_group() -> None:
        done = len(segments)
        for changeset, raw, payload in zip(
            changesets[done : done + len(group)], group, _compress(compressor, group), strict=True
        ):
            segments.append(_segment(changeset, len(raw), payload))

    for changeset in changesets:
        raw = _columns(changeset)
        if group and size + len(raw) > COMPRESS_GROUP_BYTES:
            compress_group()
            group, size = [], 0
        group.append(raw)
        size += len(raw)
    if group:
        compress_group()
    return segments


def _compress(compressor: zstandard.ZstdCompressor, raws: list[bytes | bytearray | memoryview]) -> list[Any]:
    """Each of ``raws`` as a zstd frame of its own (any buffer), by one call where
    python-zstandard has one."""
    try:
        frames = compressor.multi_compress_to_buffer(raws)
    except NotImplementedError:  # pragma: no cover - python-zstandard's CFFI backend
        return [compressor.compress(raw) for raw in raws]
    return [frames[i] for i in range(len(frames))]


@dataclass(frozen=True, slots=True)
class NoteSpec:
    """A note to write into a file: the persist it belongs to (the writer's log, SQNs ``after <
    sqn <= upto``, its segments in earlier files) and the caller's payload (a JSON object)."""

    log_id: str
    key_group_range: KeyGroupRange
    after: int
    upto: int
    earlier: tuple[SegmentRef, ...]
    payload: dict[str, Any]


def encode_file(
    changesets: Sequence[ChangeSet], compression_level: int = 1, notes: Sequence[NoteSpec] = ()
) -> tuple[bytes, list[EncodedSegment]]:
    """Encode one flush; returns the file bytes and where each changeset's segment went."""
    return encode_files([(changesets, notes)], compression_level)[0]


def encode_files(
    files: Sequence[tuple[Sequence[ChangeSet], Sequence[NoteSpec]]], compression_level: int = 1
) -> list[tuple[bytes, list[EncodedSegment]]]:
    """Encode several flushes (their changesets and notes) at once, their segments compressed
    together (module doc); returns ``encode_file``'s result for each."""
    compressor = zstandard.ZstdCompressor(level=compression_level)
    encoded = _encode_segments([cs for changesets, _ in files for cs in changesets], compressor)
    results = []
    start = 0
    for changesets, notes in files:
        results.append(_file(changesets, encoded[start : start + len(changesets)], notes))
        start += len(changesets)
    return results


def _file(
    changesets: Sequence[ChangeSet], encoded: list[tuple[bytes, Any]], notes: Sequence[NoteSpec]
) -> tuple[bytes, list[EncodedSegment]]:
    """One file of encoded segments (``encoded``: a header and a compressed payload each)."""
    sizes = [len(head) + len(payload) for head, payload in encoded]
    relative = [0, *accumulate(sizes)]  # offsets after the header (and notes)
    notes_part = b""
    if notes:
        notes_json = json.dumps([_note_json(n, changesets, sizes, relative) for n in notes], separators=(",", ":"))
        notes_blob = notes_json.encode()
        notes_part = NOTES_HEADER.pack(len(notes_blob), zlib.crc32(notes_blob)) + notes_blob
    body = FILE_HEADER.size + len(notes_part)
    parts: list[Any] = [FILE_HEADER.pack(FILE_MAGIC, FORMAT_VERSION, FLAG_NOTES if notes else 0), notes_part]
    for head, payload in encoded:
        parts += (head, payload)
    segments = []
    for cs, size, offset in zip(changesets, sizes, relative, strict=False):
        lo, hi = cs.key_group_bounds()
        segments.append(
            EncodedSegment(
                log_id=cs.log_id,
                sqn=cs.sqn,
                offset=body + offset,
                length=size,
                records=cs.records,
                min_key_group=lo,
                max_key_group=hi,
            )
        )
    footer = json.dumps(
        {
            "version": FORMAT_VERSION,
            "segments": [
                {
                    "log_id": s.log_id,
                    "sqn": s.sqn,
                    "offset": s.offset,
                    "length": s.length,
                    "records": s.records,
                    "key_groups": [s.min_key_group, s.max_key_group],
                }
                for s in segments
            ],
        },
        separators=(",", ":"),
    ).encode()
    parts.append(footer)
    parts.append(TRAILER.pack(len(footer), zlib.crc32(footer), FORMAT_VERSION, TRAILER_MAGIC))
    return b"".join(parts), segments


def _note_json(
    note: NoteSpec, changesets: Sequence[ChangeSet], sizes: list[int], relative: list[int]
) -> dict[str, Any]:
    here = [
        {
            "offset": offset,
            "length": size,
            "sqn": cs.sqn,
            "records": cs.records,
            "key_groups": list(cs.key_group_bounds()),
        }
        for cs, size, offset in zip(changesets, sizes, relative, strict=False)
        if cs.log_id == note.log_id and note.after < cs.sqn <= note.upto
    ]
    return {
        "log_id": note.log_id,
        "key_group_range": note.key_group_range.to_json(),
        "after": note.after,
        "upto": note.upto,
        "earlier": [ref.to_json() for ref in note.earlier],
        "here": here,
        "payload": note.payload,
    }


def parse_notes(path: str, prefix: bytes) -> list[NotedHandle] | int:
    """The notes of the file at ``path`` from its first bytes ``prefix`` (at most the whole file),
    each with the handle of its persist; or, if ``prefix`` is too short, how many bytes to read."""
    if len(prefix) < FILE_HEADER.size:
        raise CorruptChangelogError(path, f"file truncated ({len(prefix)} bytes)")
    flags = _file_flags(path, prefix)
    if not flags & FLAG_NOTES:
        return []
    start = FILE_HEADER.size + NOTES_HEADER.size
    if len(prefix) < start:
        return start
    length, crc = NOTES_HEADER.unpack_from(prefix, FILE_HEADER.size)
    length = int(length)
    if len(prefix) < start + length:
        return start + length
    blob = prefix[start : start + length]
    if zlib.crc32(blob) != crc:
        raise CorruptChangelogError(path, "notes checksum mismatch")
    try:
        notes = json.loads(blob)
        if not isinstance(notes, list):
            raise ValueError("notes are not a list")
        return [_noted(path, note, start + length) for note in notes]
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise CorruptChangelogError(path, f"malformed notes: {exc!r}") from None


def _file_flags(path: str, data: bytes) -> int:
    """The flags of a file header that is a changelog file's of this version (else corrupt)."""
    magic, version, flags = FILE_HEADER.unpack_from(data)
    if magic != FILE_MAGIC:
        raise CorruptChangelogError(path, f"not a changelog file (magic {magic!r})")
    if version != FORMAT_VERSION:
        raise CorruptChangelogError(path, f"unsupported format version {version} (this reader knows {FORMAT_VERSION})")
    if flags & ~FLAG_NOTES:  # no checksum covers the file header: unknown flags are damage
        raise CorruptChangelogError(path, f"unknown file header flags {flags:#06x}")
    return int(flags)


def _noted(path: str, note: Any, body: int) -> NotedHandle:
    if not isinstance(note, dict) or not isinstance(note.get("payload"), dict):
        raise ValueError("a note is not an object with an object payload")
    here = note["here"]
    if not isinstance(here, list) or not isinstance(note["earlier"], list):
        raise ValueError("a note's segments are not lists")
    for seg in here:
        if not isinstance(seg, dict) or type(seg.get("offset")) is not int or seg["offset"] < 0:
            raise ValueError("a note's segment has no offset")
    segments = [*note["earlier"], *({**seg, "path": path, "offset": body + seg["offset"]} for seg in here)]
    fields = {k: note[k] for k in ("log_id", "key_group_range", "after", "upto")}
    try:
        handle = ChangelogHandle.from_json({"version": HANDLE_FORMAT_VERSION, **fields, "segments": segments})
    except CorruptChangelogError as exc:
        raise ValueError(exc.problem) from None
    return NotedHandle(note["payload"], handle)


def decode_segment(
    path: str, blob: bytes, *, log_id: str, sqn: int, expected_records: int | None = None
) -> tuple[array[int], list[bytes]]:
    """Check and decode one segment read from ``path``; returns (key groups, payloads)."""
    if len(blob) < SEGMENT_HEADER.size:
        raise CorruptChangelogError(path, f"segment of sqn {sqn} truncated ({len(blob)} bytes)")
    magic, version, _flags, seg_sqn, seg_log_crc, raw_len, comp_len, payload_crc, head_crc = SEGMENT_HEADER.unpack_from(
        blob
    )
    if magic != SEGMENT_MAGIC:
        raise CorruptChangelogError(path, f"no segment at the referenced offset (magic {magic!r})")
    if zlib.crc32(blob[:_SEG_HEADER_CRC_SPAN]) != head_crc:
        raise CorruptChangelogError(path, f"segment header checksum mismatch (sqn {sqn})")
    if version != FORMAT_VERSION:
        raise CorruptChangelogError(path, f"unsupported format version {version} (this reader knows {FORMAT_VERSION})")
    if seg_sqn != sqn or seg_log_crc != log_crc(log_id):
        raise CorruptChangelogError(
            path, f"segment holds sqn {seg_sqn} of another log, the handle expected sqn {sqn} of {log_id}"
        )
    payload = memoryview(blob)[SEGMENT_HEADER.size :]
    if len(payload) != comp_len:
        raise CorruptChangelogError(path, f"segment of sqn {sqn} truncated: {len(payload)} of {comp_len} bytes")
    if zlib.crc32(payload) != payload_crc:
        raise CorruptChangelogError(path, f"segment checksum mismatch (sqn {sqn})")
    try:
        stated = zstandard.frame_content_size(payload)
        if stated not in (raw_len, -1):  # -1: not stated; then max_output_size bounds the output
            raise CorruptChangelogError(path, f"segment of sqn {sqn}: frame states {stated} bytes, header {raw_len}")
        raw = zstandard.ZstdDecompressor().decompress(payload, max_output_size=raw_len)
    except zstandard.ZstdError as exc:
        raise CorruptChangelogError(path, f"segment of sqn {sqn} does not decompress: {exc}") from None
    except MemoryError:  # one buffer of the header's size (< 4 GiB) could not be had
        raise CorruptChangelogError(path, f"segment of sqn {sqn} states {raw_len} bytes, too many") from None
    return _decode_columns(path, raw, raw_len, sqn, expected_records)


def _decode_columns(
    path: str, raw: bytes, raw_len: int, sqn: int, expected_records: int | None
) -> tuple[array[int], list[bytes]]:
    if len(raw) != raw_len or raw_len < 4:
        raise CorruptChangelogError(path, f"segment of sqn {sqn} has {len(raw)} bytes, header says {raw_len}")
    (count,) = struct.unpack_from("<I", raw)
    kg_end = 4 + 2 * count
    len_end = kg_end + 4 * count
    if len_end > raw_len or (expected_records is not None and count != expected_records):
        raise CorruptChangelogError(path, f"segment of sqn {sqn} has an impossible record count {count}")
    view = memoryview(raw)
    key_groups = array_from_le("H", view[4:kg_end])
    lengths = array_from_le("I", view[kg_end:len_end])
    if len_end + sum(lengths) != raw_len:
        raise CorruptChangelogError(path, f"segment of sqn {sqn}: record lengths do not add up")
    ends = list(accumulate(lengths, initial=len_end))
    payloads = [raw[ends[i] : ends[i + 1]] for i in range(count)]
    return key_groups, payloads


def iter_records(key_groups: array[int], payloads: list[bytes], start: int, end: int) -> Iterator[tuple[int, bytes]]:
    """The records whose key group is in ``[start, end]``, in append order."""
    if key_groups and start <= min(key_groups) and max(key_groups) <= end:
        yield from zip(key_groups, payloads, strict=True)
        return
    for kg, payload in zip(key_groups, payloads, strict=True):
        if start <= kg <= end:
            yield kg, payload


@dataclass(frozen=True, slots=True)
class FileIndex:
    version: int
    segments: list[dict[str, Any]]


def read_footer(path: str, data: bytes) -> FileIndex:
    """Check a whole file's framing and footer (for verification tools); returns its index."""
    if len(data) < FILE_HEADER.size + TRAILER.size:
        raise CorruptChangelogError(path, f"file truncated ({len(data)} bytes)")
    flags = _file_flags(path, data)
    version = FORMAT_VERSION
    body = FILE_HEADER.size
    if flags & FLAG_NOTES:
        if len(data) < FILE_HEADER.size + NOTES_HEADER.size:
            raise CorruptChangelogError(path, "file truncated in its notes")
        body += NOTES_HEADER.size + NOTES_HEADER.unpack_from(data, FILE_HEADER.size)[0]
    footer_len, footer_crc, t_version, t_magic = TRAILER.unpack_from(data, len(data) - TRAILER.size)
    if t_magic != TRAILER_MAGIC or t_version != version:
        raise CorruptChangelogError(path, "file truncated or trailer damaged")
    footer_start = len(data) - TRAILER.size - footer_len
    if footer_start < body:
        raise CorruptChangelogError(path, "footer length points outside the file")
    footer = data[footer_start : len(data) - TRAILER.size]
    if zlib.crc32(footer) != footer_crc:
        raise CorruptChangelogError(path, "footer checksum mismatch")
    try:
        index = json.loads(footer)
        segments = index["segments"]
        if index["version"] != version or not isinstance(segments, list):
            raise ValueError("bad footer fields")
        for seg in segments:
            ints = (seg["offset"], seg["length"], seg["sqn"], seg["records"], *seg["key_groups"])
            if not (all(type(v) is int for v in ints) and isinstance(seg["log_id"], str)):
                raise ValueError("bad segment entry")
            if len(seg["key_groups"]) != 2 or not 0 <= seg["sqn"] <= MAX_SQN:
                raise ValueError("segment key groups or sqn out of range")
            if seg["offset"] < body or seg["offset"] + seg["length"] > footer_start:
                raise ValueError("segment outside the file body")
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise CorruptChangelogError(path, f"malformed footer: {exc!r}") from None
    return FileIndex(version=version, segments=segments)


def verify_file(path: str, data: bytes) -> int:
    """Check every checksum of a whole file; returns the number of records in it."""
    index = read_footer(path, data)
    total = 0
    for seg in index.segments:
        blob = data[seg["offset"] : seg["offset"] + seg["length"]]
        kgs, _ = decode_segment(path, blob, log_id=seg["log_id"], sqn=seg["sqn"], expected_records=seg["records"])
        total += len(kgs)
    return total
