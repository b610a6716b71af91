"""``Entries``: a decoded section's (key, value) entries kept as the two columns a decode gives.

A restore decodes millions of entries per chunk into a list of keys and a list of values, and hands
them to LMDB's ``putmulti``, which takes (key, value) pairs. Zipping the columns into a list of
pairs costs a tuple per entry: its allocation, its deallocation, and the garbage collector's passes
over millions of young containers, about as much CPU as decoding them. ``Entries`` is the sequence
of pairs without the pairs: iterating it zips the columns as it goes (``zip`` reuses its tuple when
the consumer drops it, as ``putmulti`` does, so a bulk load allocates none), an index gives one
pair and a slice another ``Entries``, so ``bisect`` and the restore's other sequence code work on it
unchanged. ``cut`` cuts a column of keys or values into its pieces.

A decoder may leave the check that the keys are strictly increasing to an LMDB bulk load
(``unproven_order``): an append (``putmulti(append=True)``) takes a key only if it is above the
table's last one, so an append that takes every entry has compared each key with the one before it,
as the check would, and a second pass over every key in Python is saved. The bulk load
(``backend.state.restore.bulk_put``) calls ``prove_order`` when its append did not take them all,
before it puts them another way; one that appends all but some runs of entries (the hydration of a
lazy restore leaves out the keys already local) proves those runs with a neighbour on each side
(``prove_order_of``).
"""

from __future__ import annotations

import io
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import lru_cache
from itertools import repeat
from typing import Any, overload

__all__ = ["Entries", "cut"]


class Entries(Sequence[tuple[bytes, bytes]]):
    """The pairs ``(keys[i], values[i])``, sorted by key as the section holds them.

    ``unproven_order``: the decoder's check that the keys given are strictly increasing, raising
    its error naming the file if they are not, when it left the check to a bulk load (module doc).
    """

    __slots__ = ("keys", "unproven_order", "values")

    def __init__(
        self,
        keys: list[bytes],
        values: list[bytes],
        unproven_order: Callable[[Sequence[bytes]], None] | None = None,
    ) -> None:
        self.keys, self.values = keys, values
        self.unproven_order = unproven_order

    def prove_order(self) -> None:
        """Run the order check the decoder left to a bulk load, if any, on every key (it raises if
        they are unsorted); proven, it is dropped."""
        check, self.unproven_order = self.unproven_order, None
        if check is not None:
            check(self.keys)

    def prove_order_of(self, start: int, stop: int) -> None:
        """Run that check on the keys ``[start, stop)`` only: what an append that took the others
        did not compare (module doc)."""
        if self.unproven_order is not None:
            self.unproven_order(self.keys[start:stop])

    def __len__(self) -> int:
        return len(self.keys)

    def __iter__(self) -> Iterator[tuple[bytes, bytes]]:
        return zip(self.keys, self.values)  # noqa: B905 (equal lengths: the decoder checked them)

    @overload
    def __getitem__(self, index: int) -> tuple[bytes, bytes]: ...

    @overload
    def __getitem__(self, index: slice) -> Entries: ...

    def __getitem__(self, index: int | slice) -> tuple[bytes, bytes] | Entries:
        if isinstance(index, slice):
            return Entries(self.keys[index], self.values[index], self.unproven_order)
        return self.keys[index], self.values[index]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Entries):
            return self.keys == other.keys and self.values == other.values
        if isinstance(other, (list, tuple)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))  # noqa: B905
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable columns, as a list's

    def __repr__(self) -> str:
        return f"Entries({list(self)!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        self.prove_order()  # a check of this process's decoder does not travel
        return Entries, (self.keys, self.values)


def cut(blob: bytes, count: int, width: int, lengths: Iterable[int] = (), start: int = 0) -> list[bytes]:
    """``count`` consecutive pieces of ``blob`` from ``start``: each ``width`` bytes long, or (``width``
    0) of the ``lengths`` given, which the caller has checked to fit.

    In C either way, no Python step per piece: pieces of one width thousands, hundreds or tens at a
    time by one call of a compiled ``struct`` format (``_FIELDS``), the rest by
    ``map(BytesIO.read, lengths)`` (twice as fast as a comprehension of slices; ``BytesIO`` shares
    ``blob`` instead of copying it).
    """
    out: list[bytes] = []
    if width:
        for fields in _FIELDS:
            if count - len(out) >= fields:
                many = _fields(width, fields)
                step = fields * width
                while count - len(out) >= fields:
                    out += many.unpack_from(blob, start)
                    start += step
    buffer = io.BytesIO(blob)
    buffer.seek(start)
    out += map(buffer.read, repeat(width, count - len(out)) if width else lengths)
    return out


#: pieces of one width cut by one ``struct`` call: as many of the most as fit, then of the fewer
_FIELDS = (4096, 256, 16)


@lru_cache(maxsize=24)
def _fields(width: int, count: int) -> struct.Struct:
    """``count`` byte strings of ``width`` bytes (a compiled format of 32 bytes a field: kept for a few widths)."""
    return struct.Struct(f"{width}s" * count)
