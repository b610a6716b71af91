"""Point reads of chunks for the lazy restore: the chunk format (``materializer.chunks``) behind the
small interface ``backend.state.lazy`` defines (``ChunkSource``, ``ChunkView``).

Why an adapter: the backend must not import the materializer (the layers import one way), so it
names what it needs with plain types (byte ranges, table names, entries), and this module answers
with the chunk index: ``read_chunk_index`` (one ranged read of the tail, a second if it is longer),
checked against the handle's entry (key groups, SQN, entries: ``binding.check_index_binding``; the
size and hash need the whole chunk, which the hydration reads and checks with
``bulk_load_sections`` as an eager restore does, the keys' order left to its append), ``SectionInfo.blocks_for`` and
``ChunkIndex.point_entries`` with the keys as prefixes (only their entries are sliced out; the
keys of a batch that share blocks decode them once).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from backend.state.chunk_parts import BlockSpan
from dstl.types import KeyGroupRange
from materializer.binding import bulk_load_sections, check_index_binding
from materializer.chunks import BlockInfo, ChunkIndex, read_chunk_index

__all__ = ["POINT_READS", "ChunkPointReads", "IndexView"]


class IndexView:
    """A chunk's index, as ``backend.state.lazy.ChunkView``."""

    def __init__(self, info: ChunkIndex) -> None:
        self.info = info
        self._sections = {s.name: s for s in info.sections}

    def tables(self) -> list[str]:
        return list(self._sections)

    def key_blocks(self, table: str, ckey: bytes) -> Sequence[BlockInfo]:
        section = self._sections.get(table)
        return [] if section is None else section.blocks_for(ckey)

    def key_entries(
        self, table: str, ckeys: Sequence[bytes], blocks: Sequence[BlockSpan], datas: Sequence[bytes]
    ) -> list[tuple[bytes, bytes]]:
        return self.info.point_entries(cast("Sequence[BlockInfo]", blocks), datas, ckeys)  # what ``key_blocks`` gave

    def section_range(self, table: str) -> tuple[int, int] | None:
        section = self.info.table(table)
        return None if section is None or not section.count else section.byte_range

    def section_entries(self, table: str, data: bytes) -> Sequence[tuple[bytes, bytes]]:
        return self.info.decode_section(data, table)


class ChunkPointReads:
    """``backend.state.lazy.ChunkSource`` over the chunk format."""

    def index(self, path: str, entry: Mapping[str, Any], read: Callable[[int, int], bytes]) -> IndexView:
        info = read_chunk_index(path, int(entry["size"]), read)
        check_index_binding(path, info, entry)
        return IndexView(info)

    def load(
        self, path: str, data: bytes, entry: Mapping[str, Any], key_groups: KeyGroupRange
    ) -> dict[str, Sequence[tuple[bytes, bytes]]]:
        return bulk_load_sections(path, data, entry, key_groups)


#: the one instance (it holds nothing)
POINT_READS = ChunkPointReads()
