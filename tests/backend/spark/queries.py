"""Pieces of the streaming queries the Spark tests run: input files Spark's file source picks up
whole (``publish``) and a function for ``applyInPandasWithState`` (``count_rows``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def publish(path: Path, text: str) -> None:
    """Write an input file atomically under a name Spark's file source ignores until the rename
    (it lists every file not starting with "." or "_": a visible temporary name could become an
    extra batch)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def count_rows(key: Any, frames: Iterator[Any], state: Any) -> Iterator[Any]:
    """Per key, the running count of its rows in its GroupState; outputs ``user`` and ``n``."""
    import pandas as pd

    total = (state.get[0] if state.exists else 0) + sum(len(f) for f in frames)
    state.update((total,))
    yield pd.DataFrame({"user": [key[0]], "n": [total]})
