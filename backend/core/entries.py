"""``Entries``: a decoded section's (key, value) entries kept as the two columns a decode gives.

A restore decodes millions of entries per chunk into a list of keys and a list of values, and hands
them to LMDB's ``putmulti``, which takes (key, value) pairs. Zipping the columns into a list of
pairs costs a tuple per entry: its allocation, its deallocation, and the garbage collector's passes
over millions of young containers, about as much CPU as decoding them. ``Entries`` is the sequence
of pairs without the pairs: iterating it zips the columns as it goes (``zip`` reuses its tuple when
the consumer drops it, as ``putmulti`` does, so a bulk load allocates none), an index gives one
pair and a slice another ``Entries``, so ``bisect`` and the restore's other sequence code work on it
unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

__all__ = ["Entries"]


class Entries(Sequence[tuple[bytes, bytes]]):
    """The pairs ``(keys[i], values[i])``, sorted by key as the section holds them."""

    __slots__ = ("keys", "values")

    def __init__(self, keys: list[bytes], values: list[bytes]) -> None:
        self.keys, self.values = keys, values

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
            return Entries(self.keys[index], self.values[index])
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
        return Entries, (self.keys, self.values)
