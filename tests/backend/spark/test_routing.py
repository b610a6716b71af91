"""``use_for_session``: every routed operator gets its own uid and state directory, and two queries
never share one silently (issue: a second routed ``applyInPandasWithState`` query landed in the
first one's directory, because every plain function's uid was "function")."""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.backend.spark.test_parity import publish

pytestmark = pytest.mark.spark


def count_rows(key: Any, frames: Iterator[Any], state: Any) -> Iterator[Any]:
    import pandas as pd

    total = (state.get[0] if state.exists else 0) + sum(len(f) for f in frames)
    state.update((total,))
    yield pd.DataFrame({"user": [key[0]], "n": [total]})


def sum_values(key: Any, frames: Iterator[Any], state: Any) -> Iterator[Any]:
    import pandas as pd

    total = (state.get[0] if state.exists else 0) + sum(int(f["v"].sum()) for f in frames)
    state.update((total,))
    yield pd.DataFrame({"user": [key[0]], "n": [total]})


def run_routed(spark: Any, root: Path, name: str, func: Any, rows: list[str]) -> Counter[tuple[Any, ...]]:
    """One routed applyInPandasWithState query over its own input and Spark checkpoint; its output."""
    (root / f"in-{name}").mkdir()
    out = (
        spark.readStream.schema("user string, v long").json(str(root / f"in-{name}"))
        .groupBy("user").applyInPandasWithState(func, "user string, n long", "n long", "Update", "NoTimeout")
    )  # fmt: skip
    seen: Counter[tuple[Any, ...]] = Counter()
    query = (
        out.writeStream.foreachBatch(lambda df, _: seen.update(tuple(r) for r in df.collect()))
        .option("checkpointLocation", str(root / f"spark-{name}")).start()
    )  # fmt: skip
    try:
        for index, text in enumerate(rows):
            publish(root / f"in-{name}" / f"{index:04d}.json", text)
            query.processAllAvailable()
    finally:
        query.stop()
    return seen


@pytest.fixture
def routed(spark: Any, tmp_path: Path) -> Iterator[Path]:
    from backend.spark import driver
    from backend.spark.api import use_for_session

    driver.forget_all()
    restore = use_for_session(str(tmp_path / "states"), local_dir=str(tmp_path / "local"))
    try:
        yield tmp_path
    finally:
        restore()


def test_two_routed_functions_keep_their_own_state(spark: Any, routed: Path) -> None:
    one = '{"user": "a", "v": 5}\n{"user": "a", "v": 7}\n'
    assert run_routed(spark, routed, "count", count_rows, [one, one]) == Counter({("a", 2): 1, ("a", 4): 1})
    assert run_routed(spark, routed, "sum", sum_values, [one, one]) == Counter({("a", 12): 1, ("a", 24): 1})
    assert {p.name for p in (routed / "states").iterdir()} == {"count_rows", "sum_values"}


def test_a_function_without_a_name_of_its_own_needs_an_operator_uid(spark: Any, routed: Path) -> None:
    from dstl import ConfigurationError

    df = spark.readStream.schema("user string, v long").json(str(routed))
    for nameless in (lambda k, f, s: iter(()), functools.partial(count_rows)):
        with pytest.raises(ConfigurationError, match="operator_uid"):
            df.groupBy("user").applyInPandasWithState(nameless, "user string, n long", "n long", "Update", "NoTimeout")


def test_two_queries_routed_to_one_state_directory_are_refused(spark: Any, routed: Path) -> None:
    one = '{"user": "a", "v": 5}\n'
    run_routed(spark, routed, "first", count_rows, [one])
    with pytest.raises(Exception, match="belongs to another streaming query"):
        run_routed(spark, routed, "second", count_rows, [one])  # the same function, another query
