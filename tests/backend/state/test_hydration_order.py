"""The hydration's proof of a chunk's key order (``hydration._Moved.put``): whatever keys are local
(left out of the append) and whatever the table holds, the entries go in as the table should hold
them, or a chunk whose keys are out of order or repeated is refused; never written as it is."""

from __future__ import annotations

import itertools
import tempfile
from functools import partial

import lmdb
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.core.entries import Entries
from backend.state.hydration import _Moved
from materializer.blocks import check_order
from materializer.errors import CorruptChunkError

START, END = b"\x01", b"\x02"  # the unit's key groups' range of table keys
Case = tuple[list[bytes], list[bytes], list[bytes]]


def ck(i: int) -> bytes:
    """A key's ckey: of one length, so none is a prefix of another."""
    return START + bytes([i]) + b"k"


def table_key(i: int, j: int) -> bytes:
    """Entry ``j`` of key ``i`` (a map state's entries share their key's ckey as prefix)."""
    return ck(i) + bytes([j])


@st.composite
def cases(draw: st.DrawFn) -> Case:
    """A chunk's table keys, maybe damaged (two swapped, one repeated, one moved); the keys local
    already (left out); the table's own entries of those keys (newer, maybe other table keys)."""
    n = draw(st.integers(1, 12))
    pairs = draw(st.lists(st.tuples(st.integers(0, n), st.integers(0, 3)), min_size=1, max_size=30))
    chunk = sorted({table_key(i, j) for i, j in pairs})
    how = draw(st.sampled_from(["sound", "swap", "repeat", "move"]))
    if how == "swap" and len(chunk) > 1:
        i = draw(st.integers(0, len(chunk) - 2))
        chunk[i], chunk[i + 1] = chunk[i + 1], chunk[i]
    elif how == "repeat":
        i = draw(st.integers(0, len(chunk) - 1))
        chunk.insert(i, chunk[i])
    elif how == "move" and len(chunk) > 1:
        i, j = draw(st.integers(0, len(chunk) - 1)), draw(st.integers(0, len(chunk) - 1))
        chunk.insert(j, chunk.pop(i))
    local = sorted(set(draw(st.lists(st.sampled_from([ck(i) for i in range(n + 1)]), max_size=4))))
    held = sorted({c + bytes([j]) for c in local for j in draw(st.lists(st.integers(0, 4), max_size=2))})
    return chunk, local, held


def put(env: lmdb.Environment, db: lmdb._Database, chunk: list[bytes], local: list[bytes], plain: bool) -> dict:
    """``_Moved.put`` of ``chunk`` (its order left unproven, as the hydration's loader leaves it)
    in one transaction; what the table holds after it."""
    with env.begin(write=True) as txn:
        moved = _Moved(txn)
        if plain:
            moved.plain.add("t")
        entries = Entries(list(chunk), [b"chunk"] * len(chunk), partial(check_order, "chunk", "t"))
        moved.put("t", db, entries, local, START, END, len(chunk))
        moved.put_back(END)
        moved.put_back(None)
        return dict(txn.cursor(db=db).iternext())


@settings(max_examples=400, deadline=None)
@given(cases(), st.booleans())
def test_a_chunk_goes_in_whole_and_in_order_or_is_refused(case: Case, plain: bool) -> None:
    chunk, local, held = case
    sound = all(itertools.starmap(bytes.__lt__, itertools.pairwise(chunk)))
    with tempfile.TemporaryDirectory() as tmp, lmdb.open(tmp, max_dbs=2, map_size=1 << 24) as env:
        db = env.open_db(b"t")
        with env.begin(write=True) as txn:  # an entry below the unit, and the local keys' own
            txn.cursor(db=db).putmulti([(k, b"table") for k in [b"\x00a", *held]])
        if not sound:
            with pytest.raises(CorruptChunkError, match="keys not strictly increasing"):
                put(env, db, chunk, local, plain)
            return
        kept = {k: b"chunk" for k in chunk if k[: len(ck(0))] not in local}
        assert put(env, db, chunk, local, plain) == {b"\x00a": b"table", **kept, **dict.fromkeys(held, b"table")}


def test_a_disorder_next_to_a_local_key_is_refused_though_the_append_takes_the_rest() -> None:
    """Key 2 is local: its entry, which the chunk holds before key 1's, is left out, and the append
    of the others succeeds; the run left out is checked with its neighbours."""
    chunk = [table_key(0, 0), table_key(2, 0), table_key(1, 0)]
    with tempfile.TemporaryDirectory() as tmp, lmdb.open(tmp, max_dbs=2, map_size=1 << 24) as env:
        db = env.open_db(b"t")
        with pytest.raises(CorruptChunkError, match="keys not strictly increasing"):
            put(env, db, chunk, [ck(2)], plain=False)
