"""``Entries`` stands for the list of (key, value) pairs its two columns make, wherever the restore
uses a section's entries: iteration, length, an index, a slice, a binary search, equality."""

from __future__ import annotations

import bisect
import operator

import lmdb
from hypothesis import given
from hypothesis import strategies as st

from backend.core.entries import Entries

_keys = st.lists(st.binary(min_size=1, max_size=6), unique=True, max_size=30).map(sorted)


@given(_keys, st.integers(-40, 40), st.integers(-40, 40), st.binary(max_size=6))
def test_entries_behave_as_the_list_of_their_pairs(keys: list[bytes], a: int, b: int, probe: bytes) -> None:
    values = [k[::-1] for k in keys]
    pairs = list(zip(keys, values, strict=True))
    entries = Entries(keys, values)
    assert list(entries) == pairs and len(entries) == len(pairs) and entries == pairs
    assert list(entries[a:b]) == pairs[a:b]
    if pairs:
        assert entries[a % len(pairs)] == pairs[a % len(pairs)]
    assert bisect.bisect_left(entries, (probe,)) == bisect.bisect_left(pairs, (probe,))
    first = operator.itemgetter(0)
    assert bisect.bisect_right(entries, probe, key=first) == bisect.bisect_right(pairs, probe, key=first)


def test_a_bulk_load_of_entries_puts_every_pair(tmp_path: object) -> None:
    keys = [i.to_bytes(4, "big") for i in range(10_000)]
    env = lmdb.open(str(tmp_path), map_size=1 << 26)
    with env.begin(write=True) as txn:
        assert txn.cursor().putmulti(Entries(keys, keys), append=True) == (10_000, 10_000)
    with env.begin() as txn:
        assert list(txn.cursor()) == list(zip(keys, keys, strict=True))
    env.close()
