"""The background part of a lazy restore: load whole key groups until every key is local.

``Hydration.step`` loads key groups in order, a *unit* at a time: a cold key group and every chunk
part covering it (with the default one key group per chunk, one key group and its part). Each part
is read whole, as the eager restore reads it: a run of parts lying back to back in one pack in one
ranged read (``SPAN_BYTES`` at most), read ahead on the reader's pool with at most
``HYDRATION_BYTES`` read and not loaded yet, so the reads overlap the owner's work between steps.
A part is checked as the eager restore checks it (``ChunkSource.load``: size, hash, footer, key
groups; the order of its keys is left to the append, below) and its entries put but those of the
keys already local (loaded on access, and maybe changed since: their entries in LMDB are newer than
the chunk's; they are cut out of the part's sorted entries by a binary search per local key, not by
a test of every entry), then the pending changes of the unit's key groups (all of keys not local: a
key's are deleted when it is loaded) are applied in log order (and left in their table, which goes
when every key group is hydrated), and the key groups are marked hydrated. A step's units go in
one transaction (a new one after ``TXN_ENTRIES`` entries or ``TXN_BYTES`` of chunks), so that none
of its key groups is visible before all of them are, and a crash leaves the tables as before it.

How the entries are put: LMDB's sorted appends (``MDB_APPEND``, as the eager restore's bulk load)
fill every page and cost about half of plain puts of sorted keys into a table holding keys after
them, which split pages in the middle and leave them half full. An append takes only keys after
the table's last one, while the keys loaded on access lie in the unit and in the key groups after
it (and keys written since may lie in key groups the checkpoint has nothing of). So the entries of
a table at and after a transaction's first key (few: a batch's keys) are *moved* (``_Moved``): read
and deleted at the start of the transaction, merged back into each unit's appends where they lie in
it, and appended after the last unit; all of it in the transaction, so the owner never sees the
table without them. Moving costs a few puts per entry, so where more entries lie there than a
fraction of what the transaction loads (``MOVE_FRACTION``; ``MOVE_ALWAYS`` are always moved), the
table's entries are put with plain puts instead. The order of a chunk's keys, which the decoder
leaves unchecked (``Entries.unproven_order``), is proven by the append where it takes every entry
put (each key above the one before it), the runs of entries left out (the keys loaded on access)
checked with a neighbour on each side; before plain puts, or an append that did not take them
all, the whole section is checked. The pending changes are applied per key: a key
with only SETs comes down to the last SET of each state, put with the others of that state in one
sorted ``putmulti``; a key with any other change has its records applied one by one, in log order,
as the eager replay does (``restore.apply_record``).

The owner's thread calls ``step``: a write renews the LMDB read view that the hot read path uses
without a lock (``lmdb_tables``), so no other thread may write; the pool only reads the DFS.
A failed read or check fails the step with nothing of its transaction written; the next step reads
those key groups again (a part read ahead is dropped once loaded or refused).
"""

from __future__ import annotations

import bisect
import concurrent.futures
import itertools
import operator
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from backend.core import records as rec
from backend.core.entries import Entries
from backend.core.handles import CHUNK_HASH, chunk_digest
from backend.core.records import Op
from backend.core.tablekeys import key_group_prefix
from backend.state import restore as restoring
from backend.state.chunk_parts import ChunkSource, LocalKeys, Part, PartReader, intersection, named
from backend.state.lmdb_tables import LmdbTables
from backend.state.restore import SPAN_BYTES
from backend.state.timers import TIMERS_DB
from dstl.types import KeyGroupRange

__all__ = ["HYDRATION_BYTES", "MOVE_ALWAYS", "MOVE_FRACTION", "TXN_BYTES", "TXN_ENTRIES", "Hydration"]

#: the most bytes of chunks the hydration has read ahead and not loaded yet
HYDRATION_BYTES = 64 << 20
#: the units one transaction loads hold at most this many entries (by their chunks' entry counts)
#: and bytes of chunks, but for a first unit holding more: a bound on the pages a transaction
#: keeps in memory until it commits, and on how long it holds the backend's lock
TXN_ENTRIES, TXN_BYTES = 1 << 21, 32 << 20
#: a table's entries at and after a transaction's first key are moved out of the way of its sorted
#: appends if at most this fraction of the entries the transaction loads (module doc) ...
MOVE_FRACTION = 0.25
#: ... or at most this many
MOVE_ALWAYS = 1024
#: the pending changes' keys are ``ckey | seq:u64be`` (``backend.state.lazy``)
_SEQ_BYTES = 8
_WITHOUT_SEQ = slice(-_SEQ_BYTES)
_FIRST = operator.itemgetter(0)

Sections = Mapping[str, Sequence[tuple[bytes, bytes]]]


@dataclass(eq=False)
class _Unit:
    """What one hydration step loads at once: key groups ``rng`` and the parts covering them."""

    rng: KeyGroupRange
    parts: list[Part] = field(default_factory=list)
    #: about how many entries it loads: its chunks' entry counts (of every key group of theirs)
    entries: int = 0


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
        #: the head of a SET record of each state -> its state id
        self._set_heads = {rec.record_prefix(Op.SET, sid): sid for sid in kinds}

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
            unit.entries = sum(int(p.entry.get("entries", 0)) for p in unit.parts)
            units.append(unit)
        self._units = units

    def step(self, max_key_groups: int) -> int:
        """Hydrate units until at least ``max_key_groups`` key groups were or none is left; returns
        how many were."""
        done = 0
        while done < max_key_groups and not self.done:
            group = self._group(max_key_groups - done)
            self._prefetch()
            try:
                self._write(group, {part.number: self._part_bytes(part) for unit in group for part in unit.parts})
            finally:  # loaded or refused: read again if needed (a part reaching past the group is)
                for unit in group:
                    for part in unit.parts:
                        self._drop_prefetched(part)
            self._next += len(group)
            done += sum(len(unit.rng) for unit in group)
        self._prefetch()
        return done

    def _group(self, max_key_groups: int) -> list[_Unit]:
        """The next units one transaction loads: at least one, up to ``max_key_groups`` key groups,
        ``TXN_ENTRIES`` entries and ``TXN_BYTES`` bytes of chunks."""
        group: list[_Unit] = []
        key_groups = entries = size = 0
        for unit in self._units[self._next :]:
            entries, size = entries + unit.entries, size + sum(part.size for part in unit.parts)
            if group and (key_groups >= max_key_groups or entries > TXN_ENTRIES or size > TXN_BYTES):
                break
            group.append(unit)
            key_groups += len(unit.rng)
        return group

    def close(self) -> None:
        self._prefetched.clear()

    def _load(self, part: Part, data: bytes, rng: KeyGroupRange) -> Sections:
        assert self.chunks is not None
        chunks = self.chunks
        sections: Sections = named(f"key groups {rng.to_json()}", lambda: chunks.load(part.path, data, part.entry, rng))
        restoring.check_tables(part.path, sections, self.states)
        if CHUNK_HASH not in part.entry:  # a version-1 handle's: later snapshots carry its hash
            part.entry[CHUNK_HASH] = chunk_digest(data)
        return sections

    def _write(self, group: list[_Unit], datas: Mapping[int, bytes]) -> None:
        """Load the units of ``group``, their parts' bytes ``datas``, in one transaction (module doc)."""
        what = KeyGroupRange(group[0].rng.start, group[-1].rng.end).to_json()
        with self.lock:
            with self.tables.write(f"the hydration of key groups {what}") as txn:
                moved = _Moved(txn)
                for i, unit in enumerate(group):
                    self._write_unit(txn, moved, unit, datas, sum(u.entries for u in group[i:]))
                moved.put_back(None)
            for unit in group:
                for kg in unit.rng:
                    self.local.cold[kg] = False
                    self.local.key_groups.discard(kg)

    def _write_unit(self, txn: Any, moved: _Moved, unit: _Unit, datas: Mapping[int, bytes], coming: int) -> None:
        """Load ``unit`` in ``txn``: its entries, then its pending changes."""
        rng = unit.rng
        # a KeyGroupRange ends at MAX_KEY_GROUP, so end + 1 still fits the prefix
        start, end = key_group_prefix(rng.start), key_group_prefix(rng.end + 1)
        keys = self._local_keys(rng) if any(kg in self.local.key_groups for kg in rng) else []
        loaded = [self._load(part, datas[part.number], intersection(part.rng, rng)) for part in unit.parts]

        def put() -> None:  # the keys' order is proven here: its refusal names the key groups, as the load's
            for name, entries in _by_table(loaded).items():
                moved.put(name, self.tables.database_in(txn, name), entries, keys, start, end, coming)

        named(f"key groups {rng.to_json()}", put)
        moved.put_back(end)
        self._apply_pending(txn, start, end)
        self.local.record_hydrated(txn, rng)  # in the same transaction: an adopting process sees both or neither

    def _apply_pending(self, txn: Any, start: bytes, end: bytes) -> None:
        """Apply the pending changes of the keys in ``[start, end)`` (module doc). They are left in
        their table: no later load reads them (their key groups are hydrated now, and an adopting
        backend takes only those of key groups not hydrated: ``LocalKeys.adopted``), and the table
        goes when every key group is hydrated; a delete per change cost as much as applying it."""
        cursor = txn.cursor(db=self.pending)
        if not cursor.set_range(start):
            return
        keys = list(itertools.takewhile(end.__gt__, cursor.iternext(values=False)))  # the keys below ``end``
        if not keys:
            return
        cursor.set_range(start)
        datas = list(itertools.islice(cursor.iternext(keys=False), len(keys)))
        cks: list[bytes] = list(map(operator.getitem, keys, itertools.repeat(_WITHOUT_SEQ)))
        head = len(next(iter(self._set_heads)))
        heads: list[bytes] = list(map(operator.getitem, datas, itertools.repeat(slice(head))))
        sid = self._set_heads.get(heads[0])
        if sid is not None and heads.count(heads[0]) == len(heads):  # all SETs of one state: in C
            starts = map(operator.add, itertools.repeat(head), map(len, cks))
            values = map(operator.getitem, datas, map(slice, starts, itertools.repeat(None)))
            last = dict(zip(cks, values))  # noqa: B905 (one value per record); the last SET of each key
            db = self.tables.database_in(txn, self.kinds[sid][0])
            txn.cursor(db=db).putmulti(list(last.items()))
            return
        self._apply_mixed(txn, cks, datas, heads)

    def _apply_mixed(self, txn: Any, cks: list[bytes], datas: list[bytes], heads: list[bytes]) -> None:
        """Apply pending changes of several states or kinds: a key with only SETs comes down to its
        last SET of each state, a key with any other change has its records applied in log order."""
        head = len(heads[0])
        last_sets: dict[int, dict[bytes, bytes]] = {sid: {} for sid in self.kinds}  # sid -> ckey -> value
        others: set[bytes] = set()  # the keys with a change other than a SET
        for ck, data, first in zip(cks, datas, heads):  # noqa: B905 (one of each per record)
            sid = self._set_heads.get(first)
            if sid is None:
                others.add(ck)
            else:
                last_sets[sid][ck] = data[head + len(ck) :]
        if others:
            for values in last_sets.values():
                for ck in others.intersection(values):
                    del values[ck]
            for ck, data in zip(cks, datas):  # noqa: B905 (a key's records lie together, in log order)
                if ck in others:
                    op, sid, key, rest = rec.parse_record(data)
                    name, kind = self.kinds[sid]
                    restoring.apply_record(txn, self.tables.database_in(txn, name), kind, op, key, rest)
        for sid, values in last_sets.items():
            if values:
                db = self.tables.database_in(txn, self.kinds[sid][0])
                txn.cursor(db=db).putmulti(list(values.items()))

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


def _by_table(loaded: list[Sections]) -> dict[str, Sequence[tuple[bytes, bytes]]]:
    """The entries of the unit's parts per table, sorted (the parts of a unit hold different key
    groups); the timers are left out: they were loaded at restore, and changed since."""
    tables: dict[str, list[Sequence[tuple[bytes, bytes]]]] = {}
    for sections in loaded:
        for name, entries in sections.items():
            if name != TIMERS_DB and entries:
                tables.setdefault(name, []).append(entries)
    for runs in tables.values():
        if len(runs) > 1:  # merged: no append proves the order of each part's entries
            for run in runs:
                if isinstance(run, Entries):
                    run.prove_order()
    return {name: runs[0] if len(runs) == 1 else sorted(itertools.chain(*runs)) for name, runs in tables.items()}


@dataclass
class _Held:
    """A table's entries a transaction took out: ``entries[at:]`` are not put back yet."""

    db: Any
    entries: list[tuple[bytes, bytes]]
    at: int = 0

    def below(self, end: bytes | None) -> list[tuple[bytes, bytes]]:
        """Those not put back yet below ``end`` (None: all), now counted as put back."""
        at = self.at
        self.at = len(self.entries) if end is None else bisect.bisect_left(self.entries, end, at, key=_FIRST)
        return self.entries[at : self.at]


class _Moved:
    """The entries a transaction of the hydration took out of the way of its sorted appends, per
    table: those at and after the first key it loads in the table (module doc)."""

    def __init__(self, txn: Any) -> None:
        self.txn = txn
        self.held: dict[str, _Held] = {}
        #: the tables with too many entries after the transaction's first key to move: plain puts
        self.plain: set[str] = set()

    def put(
        self,
        name: str,
        db: Any,
        entries: Sequence[tuple[bytes, bytes]],
        cks: list[bytes],
        start: bytes,
        end: bytes,
        coming: int,
    ) -> None:
        """Put a unit's ``entries`` (sorted, in ``[start, end)``) but those of the keys ``cks`` (the
        unit's keys loaded on access: the table's are newer) into table ``name``: appended, what
        lies at and after ``start`` taken out first if at most ``MOVE_FRACTION`` of ``coming``
        entries (the transaction's, from this unit on); else with plain puts."""
        held = self.held.get(name)
        if held is None and name not in self.plain:
            cursor = self.txn.cursor(db=db)
            most = max(int(max(coming, len(entries)) * MOVE_FRACTION), MOVE_ALWAYS)
            taken = list(itertools.islice(cursor.iternext(), most + 1)) if cursor.set_range(start) else []
            if len(taken) > most:
                self.plain.add(name)
            else:
                if taken:
                    cursor.set_range(start)
                    while cursor.delete():  # every entry from ``start`` to the end of the table
                        pass
                held = self.held[name] = _Held(db, taken)
        cursor = self.txn.cursor(db=db)
        if held is None:
            spliced = _Spliced(entries, cks, [])
            spliced.entries.prove_order()  # plain puts prove nothing
            cursor.putmulti(spliced)
            return
        merged = _Spliced(entries, cks, held.below(end))
        consumed, added = cursor.putmulti(merged, append=True)  # a key not above the last one: not added
        if added != consumed:  # a key of the table's was in the chunk's too: plain puts, the table's last
            merged.entries.prove_order()
            cursor.putmulti(merged)
        else:
            merged.prove_left_out()

    def put_back(self, end: bytes | None) -> None:
        """Put back what was taken out below ``end`` (None: all of it): it appends."""
        for held in self.held.values():
            inside = held.below(end)
            if inside:
                restoring.bulk_put(self.txn, held.db, inside)


class _Spliced:
    """``entries`` (sorted by table key) without those of the keys ``cks`` (sorted) and with the
    ``extra`` entries (sorted), in order, an extra entry after an entry of the same table key: an
    iterable of pairs for ``putmulti``, iterable again for a second try. A key's entries are the
    table keys starting with its ckey (no ckey is a prefix of another one): found by a binary
    search per key and per extra entry, not a test of every entry. Iterating chains, in C, runs
    of one iterator over the columns (``islice``: a run kept, or an empty one that skips the
    run of a local key) and the extra entries: no entry is copied, where copying the runs into
    new columns cost about as much as putting them."""

    def __init__(
        self, entries: Sequence[tuple[bytes, bytes]], cks: list[bytes], extra: list[tuple[bytes, bytes]]
    ) -> None:
        if not isinstance(entries, Entries):  # a partly owned chunk's pairs, or a unit's merged parts
            entries = Entries([k for k, _ in entries], [v for _, v in entries])
        self.entries = entries
        keys = entries.keys
        #: (entries to keep, entries to skip, extra entries to put after them), in order
        self.steps: list[tuple[int, int, list[tuple[bytes, bytes]]]] = []
        taken = x = 0  # the entries kept or skipped so far; the extra entries placed so far
        for ck in cks:
            while x < len(extra) and extra[x][0] < ck:  # the extra entries before this key's
                at = bisect.bisect_right(keys, extra[x][0], taken)
                self.steps.append((at - taken, 0, [extra[x]]))
                taken, x = at, x + 1
            at = bisect.bisect_left(keys, ck, taken)
            skip = at
            while skip < len(keys) and keys[skip].startswith(ck):  # the key's entries: left out
                skip += 1
            self.steps.append((at - taken, skip - at, []))
            taken = skip
        for item in extra[x:]:
            at = bisect.bisect_right(keys, item[0], taken)
            self.steps.append((at - taken, 0, [item]))
            taken = at
        self.rest = len(keys) - taken

    def prove_left_out(self) -> None:
        """After an append took every entry put (which proves their order): prove the order of each
        run of entries left out, with a neighbour on each side (``Entries.prove_order_of``), so the
        whole section is proven as a full check would."""
        at = 0
        for keep, skip, _ in self.steps:
            at += keep
            if skip:
                self.entries.prove_order_of(max(at - 1, 0), at + skip + 1)
            at += skip

    def __iter__(self) -> Iterator[tuple[bytes, bytes]]:
        if not self.steps:
            return iter(self.entries)
        columns = iter(self.entries)
        runs: list[Iterable[tuple[bytes, bytes]]] = []
        for keep, skip, extra in self.steps:
            if keep:
                runs.append(itertools.islice(columns, keep))
            if skip:
                runs.append(itertools.islice(columns, skip, skip))  # consumes ``skip``, yields none
            if extra:
                runs.append(extra)
        runs.append(columns)
        return itertools.chain.from_iterable(runs)


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
