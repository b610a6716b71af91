"""The schema-change matrix against Spark's own operator runs in full only when asked for.

Each of its cases starts two streaming queries twice (about half a minute on a 2-core machine), so
the default suite runs one representative per change kind (``REPRESENTATIVES``, unmarked) and
deselects the rest, which carry the ``spark_parity`` marker: they run under ``-m spark_parity``
(``tox -e slow``)."""

from __future__ import annotations

from typing import Any

import pytest

_MATRIX = "test_schema_evolution_parity.py"


def pytest_collection_modifyitems(config: Any, items: list[pytest.Item]) -> None:
    if "spark_parity" in (config.getoption("markexpr") or ""):
        return
    keep, drop = [], []
    for item in items:
        matrix = item.nodeid.split("::")[0].endswith(_MATRIX) and item.get_closest_marker("spark_parity")
        (drop if matrix else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
