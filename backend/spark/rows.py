"""Rows as pyspark hands them to user code: ``Row`` objects, and Python scalars for numpy/pandas ones.

Shared by the codecs, the keys and the runners; no pyspark at import time (``Row`` is looked up on
first use, where a processor runs and pyspark is loaded).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["make_row", "plain_value"]

_ROW_CLASS: Any = None


def make_row(names: Sequence[str], values: Sequence[Any]) -> Any:
    """``pyspark.sql.Row`` with these field names (what Spark hands out), or a tuple without pyspark."""
    global _ROW_CLASS
    if _ROW_CLASS is None:
        try:
            from pyspark.sql import Row

            _ROW_CLASS = Row
        except ImportError:  # pragma: no cover - pyspark is installed wherever processors run
            _ROW_CLASS = False
    if _ROW_CLASS is False:
        return tuple(values)
    return _ROW_CLASS(*names)(*values)


def plain_value(value: Any) -> Any:
    """numpy and pandas scalars -> Python ones, as pyspark's ``_normalize_state_value`` does."""
    if type(value).__module__ == "numpy" and hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return value.item()
    if hasattr(value, "to_pydatetime"):
        return value.to_pydatetime()
    return value
