"""``dstl checkpoints verify``: read every file a snapshot references and check every byte of it.

- ``_metadata``: parsed and checksummed when the snapshot is opened (``SnapshotMetadata.loads``).
- log files: ``dstl.format.verify_file`` on the whole file (header, footer, every segment's
  checksums and columns); then every segment a handle references must lie inside the file and be
  one the footer lists (same log, SQN, offset, length, record count), else it is decoded on its
  own.
- chunks: ``materializer.chunks.decode_chunk`` on each chunk a handle names (the whole file, or
  the bytes at the entry's offset in a pack; every section decompressed and checked); the
  handle's entry (key groups, SQN, size, entry count, and the hash where the handle records one)
  must match the chunk, as a restore checks it (``materializer.binding.check_binding``).
- packs: a restore reads only the ranges its entries name, so bytes no entry names would go
  unseen. A pack is chunks back to back, and keeps chunks no handle names any more (superseded,
  ``materializer.packs``), so every byte outside the named ranges must belong to a whole chunk
  (``chunk_info``: its framing and checksummed footer); anything else, such as bytes appended
  after the last chunk, is reported with the byte range.

Every problem is collected (a missing file, each corrupt file), not just the first one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from backend.checkpointing.metadata import Progress
from backend.tools.inspect_state import Snapshot
from dstl import CorruptChangelogError, KeyGroupRange, SegmentRef
from dstl.errors import StorageError
from dstl.format import decode_segment, read_footer, verify_file
from materializer.binding import check_binding
from materializer.chunks import CHUNK_TRAILER_MAGIC, chunk_info, decode_chunk
from materializer.errors import CorruptChunkError


@dataclass
class VerifyResult:
    files: int = 0  # files read, _metadata included
    bytes: int = 0
    problems: list[tuple[str, str]] = field(default_factory=list)  # (path, problem)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(snapshot: Snapshot, progress: Progress) -> VerifyResult:
    """Check every file ``snapshot`` references; ``progress`` hears ``(path, files done, files in all)``."""
    result = VerifyResult(files=1, bytes=snapshot.metadata_size)
    chunks: dict[str, list[dict[str, Any]]] = {}
    segments: dict[str, list[tuple[str, SegmentRef]]] = {}
    for uid in sorted(snapshot.meta.operators):
        for handle in snapshot.handles(uid):
            for chunk in handle.materialized:
                chunks.setdefault(str(chunk["path"]), []).append(chunk)
            for entry in handle.changelog:
                for seg in entry.log.segments:
                    segments.setdefault(seg.path, []).append((entry.log.log_id, seg))
    paths = sorted(snapshot.meta.referenced_files() | set(chunks) | set(segments))
    for done, path in enumerate(paths, start=1):
        progress(path, done, len(paths))
        full = f"{snapshot.base}/{path}"
        try:
            data = snapshot.storage.files.get(path)
        except FileNotFoundError:
            result.problems.append((full, "missing"))
            continue
        except (OSError, ValueError, StorageError) as exc:
            result.problems.append((full, f"cannot be read: {exc}"))
            continue
        result.files += 1
        result.bytes += len(data)
        if path in chunks:
            problems = _check_chunk(path, data, chunks[path])
        else:
            problems = _check_log(path, data, segments.get(path, []))
        result.problems.extend((full, p) for p in problems)
    return result


def _check_chunk(path: str, data: bytes, entries: list[dict[str, Any]]) -> list[str]:
    """Check each entry's chunk: the whole file, or (in a pack) the bytes at the entry's offset."""
    problems: list[str] = []
    for span in sorted({(e.get("offset"), e.get("size")) for e in entries}, key=str):
        offset, size = span
        named = [e for e in entries if (e.get("offset"), e.get("size")) == span]
        if offset is None:
            problems.extend(_check_one_chunk(path, data, named))
        elif not (isinstance(offset, int) and isinstance(size, int) and offset + size <= len(data)):
            problems.append(f"the chunk at offset {offset} ({size} bytes) lies outside the file ({len(data)} bytes)")
        else:
            found = _check_one_chunk(path, data[offset : offset + size], named)
            problems.extend(f"the chunk at offset {offset}: {problem}" for problem in found)
    if all(isinstance(e.get("offset"), int) and isinstance(e.get("size"), int) for e in entries):
        problems.extend(_unnamed_bytes(path, data, [(e["offset"], e["offset"] + e["size"]) for e in entries]))
    return sorted(set(problems))


def _unnamed_bytes(path: str, data: bytes, named: list[tuple[int, int]]) -> list[str]:
    """The ranges of a pack that no entry names and that are not whole chunks (module doc)."""
    size = len(data)
    problems = []
    start = 0
    for begin, end in [*sorted((min(max(b, 0), size), min(max(e, 0), size)) for b, e in named), (size, size)]:
        stray = _not_chunks(path, data, start, begin) if begin > start else None
        if stray is not None and begin == size:
            problems.append(
                f"the file is {size} bytes, but its chunks end at byte {stray}: "
                f"bytes [{stray}, {size}) are no chunk (a restore never reads them)"
            )
        elif stray is not None:
            problems.append(f"bytes [{stray}, {begin}) between the file's chunks are no chunk")
        start = max(start, end)
    return problems


def _not_chunks(path: str, data: bytes, start: int, end: int) -> int | None:
    """Where whole chunks back to back from ``start`` stop short of ``end`` (None: they reach it).
    A chunk's end is found by its trailer's magic; its framing and checksummed footer decide."""
    while start < end:
        for candidate in _trailer_ends(data, start, end):
            try:
                chunk_info(path, data[start:candidate])
            except CorruptChunkError:
                continue
            start = candidate
            break
        else:
            return start
    return None


def _trailer_ends(data: bytes, start: int, end: int) -> list[int]:
    ends = []
    at = data.find(CHUNK_TRAILER_MAGIC, start, end)
    while at != -1:
        ends.append(at + len(CHUNK_TRAILER_MAGIC))
        at = data.find(CHUNK_TRAILER_MAGIC, at + 1, end)
    return ends


def _check_one_chunk(path: str, data: bytes, entries: list[dict[str, Any]]) -> list[str]:
    try:
        chunk = decode_chunk(path, data)
        info = chunk_info(path, data)
    except CorruptChunkError as exc:
        return [exc.problem]
    problems = []
    for entry in entries:
        try:
            check_binding(path, data, info, entry)
        except CorruptChunkError as exc:
            problems.append(exc.problem)
        try:
            scope = KeyGroupRange.from_json(entry.get("scope", entry.get("key_groups")))
        except ValueError as exc:
            problems.append(f"the handle's chunk entry is malformed: {exc}")
            continue
        if len(scope) and not (chunk.key_groups.start <= scope.start and scope.end <= chunk.key_groups.end):
            problems.append(f"the handle's scope {scope.to_json()} is outside the chunk's key groups")
    return problems


def _check_log(path: str, data: bytes, refs: list[tuple[str, SegmentRef]]) -> list[str]:
    try:
        verify_file(path, data)
        listed = {
            (s["log_id"], s["sqn"], s["offset"], s["length"], s["records"], *s["key_groups"])
            for s in read_footer(path, data).segments
        }
    except CorruptChangelogError as exc:
        return [exc.problem]
    except (KeyError, TypeError) as exc:  # a footer entry verify_file accepted without these fields
        return [f"malformed footer: {exc}"]
    problems = []
    for log_id, seg in sorted(set(refs), key=lambda r: (r[0], r[1].sqn)):
        where = f"segment sqn {seg.sqn} of log {log_id}"
        if seg.offset + seg.length > len(data):
            end = seg.offset + seg.length
            problems.append(f"{where} at bytes [{seg.offset}, {end}) ends past the file's end ({len(data)} bytes)")
            continue
        if (log_id, seg.sqn, seg.offset, seg.length, seg.records, seg.min_key_group, seg.max_key_group) in listed:
            continue  # verify_file decoded exactly these bytes
        try:
            kgs, _ = decode_segment(
                path, data[seg.offset : seg.offset + seg.length], log_id=log_id, sqn=seg.sqn,
                expected_records=seg.records,
            )  # fmt: skip
        except CorruptChangelogError as exc:
            problems.append(f"{where}: {exc.problem}")
            continue
        if kgs and (min(kgs) < seg.min_key_group or max(kgs) > seg.max_key_group):
            problems.append(f"{where} has key groups outside the handle's bounds")
    return problems
