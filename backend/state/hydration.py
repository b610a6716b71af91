"""The background part of a lazy restore: load whole key groups until every key is local.

``Hydration.step`` loads key groups in order, a *unit* at a time: a cold key group and every chunk
part covering it (with the default one key group per chunk, one key group and its part). Each part
is read whole, as the eager restore reads it: a run of parts lying back to back in one pack in one
ranged read (``SPAN_BYTES`` at most), read ahead on the reader's pool with at most
``HYDRATION_BYTES`` read and not loaded yet, so the reads overlap the owner's work between steps.
A part is checked as the eager restore checks it (``ChunkSource.load``: size, hash, footer, key
groups) and bulk-put skipping the keys already local (loaded on access, and maybe changed since:
their entries in LMDB are newer than the chunk's; they are cut out of the part's sorted entries by
a binary search per local key, not by a test of every entry), then the pending changes of the unit's key
groups (all of keys not local: a key's are deleted when it is loaded) are applied in log order
and deleted, in the same transaction, and the key groups are marked hydrated.

The owner's thread calls ``step``: a write renews the LMDB read view that the hot read path uses
without a lock (``lmdb_tables``), so no other thread may write; the pool only reads the DFS.
A failed read or check fails the step with nothing written; the next step reads the unit again.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import operator
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from backend.core.handles import CHUNK_HASH, chunk_digest
from backend.core.tablekeys import key_group_prefix
from backend.state import restore as restoring
from backend.state.chunk_parts import ChunkSource, LocalKeys, Part, PartReader, apply_pending, intersection, named
from backend.state.lmdb_tables import LmdbTables
from backend.state.restore import SPAN_BYTES
from backend.state.timers import TIMERS_DB
from dstl.types import KeyGroupRange

__all__ = ["HYDRATION_BYTES", "Hydration"]

#: the most bytes of chunks the hydration has read ahead and not loaded yet
HYDRATION_BYTES = 64 << 20

Sections = Mapping[str, Sequence[tuple[bytes, bytes]]]


@dataclass(eq=False)
class _Unit:
    """What one hydration step loads at once: key groups ``rng`` and the parts covering them."""

    rng: KeyGroupRange
    parts: list[Part] = field(default_factory=list)


class Hydration:
    """Loads the cold key groups of a lazy restore, in order (module doc)."""

    def __init__(
        self,
        tables: LmdbTables,
        lock: threading.RLock,
        reader: PartReader,
        chunks: ChunkSource | None,
        states: Mapping[str, Mapping[str, Any]],
        local: LocalKeys,
        pending: Any,
        kinds: Mapping[int, tuple[str, str]],
    ) -> None:
        self.tables, self.lock, self.reader, self.chunks = tables, lock, reader, chunks
        self.states, self.local, self.pending, self.kinds = states, local, pending, kinds
        self._units: list[_Unit] = []
        self._next = 0
        self._prefetched: dict[int, concurrent.futures.Future[dict[int, bytes]]] = {}
        self._in_flight = 0
        #: ``local.keys`` sorted (keys are only added while lazy: a new length means new keys)
        self._sorted_keys: list[bytes] = []

    @property
    def done(self) -> bool:
        return self._next >= len(self._units)

    def plan(self, owned: KeyGroupRange, parts: Sequence[Part]) -> None:
        """The units, in key-group order: each cold key group with the parts covering it, widened
        to the key groups of those parts (they are read whole)."""
        units: list[_Unit] = []
        for kg in owned:
            if not self.local.cold[kg] or (units and units[-1].rng.end >= kg):
                continue
            end = max([kg, *(min(p.rng.end, owned.end) for p in parts if kg in p.rng)])
            unit = _Unit(KeyGroupRange(kg, end))
            unit.parts = [p for p in parts if p.rng.intersects(kg, end)]
            units.append(unit)
        self._units = units

    def step(self, max_key_groups: int) -> int:
        """Hydrate units until at least ``max_key_groups`` key groups were or none is left; returns
        how many were."""
        done = 0
        while done < max_key_groups and not self.done:
            unit = self._units[self._next]
            self._prefetch()
            loaded = [self._load(part, intersection(part.rng, unit.rng)) for part in unit.parts]
            self._write(unit.rng, loaded)
            for part in unit.parts:  # a part reaching past the unit is read again by the next one
                self._drop_prefetched(part)
            self._next += 1
            done += len(unit.rng)
        self._prefetch()
        return done

    def close(self) -> None:
        self._prefetched.clear()

    def _load(self, part: Part, rng: KeyGroupRange) -> Sections:
        data = self._part_bytes(part)
        assert self.chunks is not None
        chunks = self.chunks
        sections: Sections = named(f"key groups {rng.to_json()}", lambda: chunks.load(part.path, data, part.entry, rng))
        restoring.check_tables(part.path, sections, self.states)
        if CHUNK_HASH not in part.entry:  # a version-1 handle's: later snapshots carry its hash
            part.entry[CHUNK_HASH] = chunk_digest(data)
        return sections

    def _write(self, rng: KeyGroupRange, loaded: list[Sections]) -> None:
        local = self.local
        with self.lock:
            keys = self._local_keys(rng) if any(kg in local.key_groups for kg in rng) else []
            with self.tables.write(f"the hydration of key groups {rng.to_json()}") as txn:
                for sections in loaded:
                    for name, entries in sections.items():
                        if name == TIMERS_DB:
                            continue  # loaded at restore, and changed since
                        if keys:
                            entries = _without(entries, keys)
                        if entries:
                            restoring.bulk_put(txn, self.tables.database_in(txn, name), entries)
                # a KeyGroupRange ends at MAX_KEY_GROUP, so end + 1 still fits the prefix
                start, end = key_group_prefix(rng.start), key_group_prefix(rng.end + 1)
                apply_pending(txn, self.tables, self.pending, self.kinds, start, end)
                local.record_hydrated(txn, rng)
            for kg in rng:
                local.cold[kg] = False
                local.key_groups.discard(kg)

    def _local_keys(self, rng: KeyGroupRange) -> list[bytes]:
        """The keys of ``rng`` loaded one by one (on access), sorted."""
        if len(self._sorted_keys) != len(self.local.keys):
            self._sorted_keys = sorted(self.local.keys)
        keys = self._sorted_keys
        start, end = key_group_prefix(rng.start), key_group_prefix(rng.end + 1)
        return keys[bisect.bisect_left(keys, start) : bisect.bisect_left(keys, end)]

    def _part_bytes(self, part: Part) -> bytes:
        future = self._prefetched.get(part.number)
        if future is None:
            return self.reader.read(part, 0, part.size, f"key groups {part.rng.to_json()}")
        try:
            return future.result()[part.number]
        except BaseException:
            self._prefetched.clear()  # every read ahead may have failed alike: the next step reads again
            self._in_flight = 0
            raise

    def _drop_prefetched(self, part: Part) -> None:
        if self._prefetched.pop(part.number, None) is not None:
            self._in_flight -= part.size

    def _prefetch(self) -> None:
        """Read the next units' parts ahead, a run back to back in one pack in one read, with at
        most ``HYDRATION_BYTES`` read ahead and not loaded."""
        order = [part for unit in self._units[self._next :] for part in unit.parts]
        order = list(dict.fromkeys(p for p in order if p.number not in self._prefetched))
        i = 0
        while i < len(order) and self._in_flight < HYDRATION_BYTES:
            run = [order[i]]
            while i + len(run) < len(order) and _follows(run, order[i + len(run)]):
                run.append(order[i + len(run)])
            future = self.reader.pool().submit(self._read_run, run)
            for part in run:
                self._prefetched[part.number] = future
                self._in_flight += part.size
            i += len(run)

    def _read_run(self, run: list[Part]) -> dict[int, bytes]:
        what = f"key groups {KeyGroupRange(run[0].rng.start, run[-1].rng.end).to_json()}"
        data = self.reader.read(run[0], 0, sum(p.size for p in run), what)
        out, at = {}, 0
        for part in run:
            out[part.number] = data[at : at + part.size]
            at += part.size
        return out


def _without(entries: Sequence[tuple[bytes, bytes]], cks: list[bytes]) -> list[tuple[bytes, bytes]]:
    """``entries`` (sorted by table key) without those of the keys ``cks`` (sorted): a key's
    entries are the table keys starting with its ckey, and no ckey is a prefix of another one."""
    first = operator.itemgetter(0)
    kept: list[tuple[bytes, bytes]] = []
    at = 0
    for ck in cks:
        lo = bisect.bisect_left(entries, ck, at, key=first)
        hi = lo
        while hi < len(entries) and entries[hi][0].startswith(ck):
            hi += 1
        kept += entries[at:lo]
        at = hi
    kept += entries[at:]
    return kept


def _follows(run: list[Part], part: Part) -> bool:
    """Whether ``part`` lies right after ``run`` in the same pack, the run staying in ``SPAN_BYTES``."""
    last = run[-1]
    return (
        part.path == last.path
        and "offset" in part.entry
        and "offset" in last.entry
        and int(part.entry["offset"]) == int(last.entry["offset"]) + last.size
        and sum(p.size for p in run) + part.size <= SPAN_BYTES
    )
