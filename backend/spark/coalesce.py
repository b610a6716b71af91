"""A task's output frames concatenated before Spark converts them to Arrow.

Spark converts every frame a ``mapInPandas`` task yields to an Arrow batch of its own, and a user's
processor yields a frame per key, so a partition of 10,000 keys cost 10,000 conversions, the
largest part of a heavy batch. ``coalesced`` concatenates consecutive frames of one schema (the
same columns and dtypes) into frames of at most ``max_rows`` rows, so each value converts as it
would have alone (no dtype is widened by the concatenation).

Why not ``pd.concat`` and ``frame.dtypes`` per frame: with one-row frames, both cost tens of
microseconds per frame (``dtypes`` builds a Series, ``concat`` plans blocks and indexes), paid
once per key. A frame's column arrays (as it holds them) give its dtypes and, when every column is
a NumPy array, the concatenated columns with one ``numpy.concatenate`` each. Frames with an
extension array (nullable ints, categoricals, Arrow strings), no columns or repeated column names
go through ``pd.concat``, as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["coalesced"]


def coalesced(frames: Iterable[Any], max_rows: int) -> Iterator[Any]:
    """``frames`` (pandas), consecutive ones with the same columns and dtypes concatenated into
    frames of at most ``max_rows`` rows (a frame larger than that stays whole), in order."""
    run: list[Any] = []
    arrays: list[list[Any]] = []
    rows = 0
    signature: tuple[Any, ...] | None = None
    for frame in frames:
        columns = _column_arrays(frame)
        this = (tuple(frame.columns), tuple(a.dtype for a in columns) if columns is not None else tuple(frame.dtypes))
        if run and (this != signature or rows + len(frame) > max_rows):
            yield _joined(run, arrays)
            run, arrays, rows = [], [], 0
        run.append(frame)
        if columns is not None:
            arrays.append(columns)
        rows += len(frame)
        signature = this
    if run:
        yield _joined(run, arrays)


def _column_arrays(frame: Any) -> list[Any] | None:
    """The frame's columns as the arrays it holds (NumPy or extension arrays, no copy), or None
    if this pandas does not say (then the public path)."""
    column = getattr(frame, "_get_column_array", None)
    return None if column is None else [column(i) for i in range(frame.shape[1])]


def _joined(run: list[Any], arrays: list[list[Any]]) -> Any:
    import numpy as np
    import pandas as pd  # type: ignore[import-untyped, unused-ignore]

    if len(run) == 1:
        return run[0]
    first = run[0]
    numpy_only = len(arrays) == len(run) and all(isinstance(a, np.ndarray) for a in arrays[0])
    if not numpy_only or not first.columns.is_unique or not first.shape[1]:
        return pd.concat(run, ignore_index=True)
    data = {name: np.concatenate([columns[i] for columns in arrays]) for i, name in enumerate(first.columns)}
    out = pd.DataFrame(data, copy=False)
    out.columns = first.columns  # its name and dtype too, as pd.concat keeps them
    return out
