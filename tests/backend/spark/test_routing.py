"""``use_for_session``: a routed operator's state follows the query that runs it, as Spark's own
operators' state follows the query's checkpointLocation: two queries of one program, even of one
function, keep their own state; a query restarted under its checkpoint resumes it, one started under
another checkpoint starts empty. As in Spark, an operator is known by its place in its query: a
restart with the function renamed or replaced (a lambda even) resumes its state."""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.backend.spark.queries import count_rows, publish

pytestmark = pytest.mark.spark


def sum_values(key: Any, frames: Iterator[Any], state: Any) -> Iterator[Any]:
    import pandas as pd

    total = (state.get[0] if state.exists else 0) + sum(int(f["v"].sum()) for f in frames)
    state.update((total,))
    yield pd.DataFrame({"user": [key[0]], "n": [total]})


def run_routed(spark: Any, root: Path, name: str, func: Any, rows: list[str]) -> Counter[tuple[Any, ...]]:
    """One routed applyInPandasWithState query over the input directory ``in-<name>`` (one more file
    per round) and the Spark checkpoint ``spark-<name>``; its output."""
    source = root / f"in-{name}"
    source.mkdir(exist_ok=True)
    out = (
        spark.readStream.schema("user string, v long").json(str(source))
        .groupBy("user").applyInPandasWithState(func, "user string, n long", "n long", "Update", "NoTimeout")
    )  # fmt: skip
    seen: Counter[tuple[Any, ...]] = Counter()
    query = (
        out.writeStream.foreachBatch(lambda df, _: seen.update(tuple(r) for r in df.collect()))
        .option("checkpointLocation", str(root / f"spark-{name}")).start()
    )  # fmt: skip
    try:
        for text in rows:
            publish(source / f"{len(list(source.iterdir())):04d}.json", text)
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
    # under the root: a directory per query (named after its checkpoint location), one per operator in it
    layout = {
        (query.name.rsplit("-", 1)[0], op.name)
        for query in (routed / "states").iterdir()
        for op in query.iterdir()
        if op.is_dir()
    }
    assert layout == {("spark-count", "count_rows"), ("spark-sum", "sum_values")}


def counting_again(key: Any, frames: Iterator[Any], state: Any) -> Iterator[Any]:
    """``count_rows`` under another name: the next release of the same operator."""
    yield from count_rows(key, frames, state)


def test_a_restart_with_the_function_renamed_or_nameless_resumes_the_state_at_its_place(
    spark: Any, routed: Path
) -> None:
    one = '{"user": "a", "v": 5}\n'
    assert run_routed(spark, routed, "count", count_rows, [one]) == Counter({("a", 1): 1})
    assert run_routed(spark, routed, "count", counting_again, [one]) == Counter({("a", 2): 1})
    assert run_routed(spark, routed, "count", lambda k, f, s: count_rows(k, f, s), [one]) == Counter({("a", 3): 1})
    assert run_routed(spark, routed, "count", functools.partial(count_rows), [one]) == Counter({("a", 4): 1})
    (query,) = (routed / "states").iterdir()
    assert sorted(p.name for p in query.iterdir()) == ["count_rows", "operators.json"]
    # a new query of a lambda: its state directory is named after its place
    assert run_routed(spark, routed, "fresh", lambda k, f, s: count_rows(k, f, s), [one]) == Counter({("a", 1): 1})
    (fresh,) = (routed / "states").glob("spark-fresh-*")
    assert sorted(p.name for p in fresh.iterdir()) == ["operator", "operators.json"]


def test_a_corrupt_list_of_operators_is_refused_naming_it(spark: Any, routed: Path) -> None:
    from dstl import ConfigurationError

    one = '{"user": "a", "v": 5}\n'
    run_routed(spark, routed, "count", count_rows, [one])
    (listing,) = (routed / "states").glob("*/operators.json")
    listing.write_text('["count_rows", "../elsewhere"]')
    with pytest.raises(ConfigurationError, match=r"operators\.json.*must be a non-empty name"):
        run_routed(spark, routed, "count", count_rows, [one])
    listing.write_text("{not json")
    with pytest.raises(ConfigurationError, match=r"operators\.json is corrupt"):
        run_routed(spark, routed, "count", count_rows, [one])


def test_the_state_follows_the_querys_checkpoint_location(spark: Any, tmp_path: Path) -> None:
    """One function in two queries, one of them restarted: as Spark's own operator, the state is
    the query's (under its checkpointLocation without a checkpoint_root)."""
    from backend.spark import driver
    from backend.spark.api import use_for_session

    driver.forget_all()
    restore = use_for_session(local_dir=str(tmp_path / "local"))
    one = '{"user": "a", "v": 5}\n'
    try:
        assert run_routed(spark, tmp_path, "first", count_rows, [one]) == Counter({("a", 1): 1})
        assert run_routed(spark, tmp_path, "first", count_rows, [one]) == Counter({("a", 2): 1})  # restarted
        # another query of the same function (Spark: another checkpoint is another query): its own state
        second = run_routed(spark, tmp_path, "second", count_rows, [one, one])
    finally:
        restore()
    assert second == Counter({("a", 1): 1, ("a", 2): 1})
    for checkpoint in ("spark-first", "spark-second"):
        assert sorted((tmp_path / checkpoint / "dstl" / "count_rows").glob("chk-*/_metadata"))  # its checkpoints


def test_the_checkpoint_location_is_the_one_spark_chooses(spark: Any, tmp_path: Path) -> None:
    from backend.spark.routing import _checkpoint_location

    (tmp_path / "in").mkdir()
    df = spark.readStream.schema("user string, v long").json(str(tmp_path / "in"))
    writer = df.writeStream.option("checkpointLocation", str(tmp_path / "given"))
    assert _checkpoint_location(writer, spark, {"checkpointlocation": str(tmp_path / "given")}, None) == str(
        tmp_path / "given"
    )
    spark.conf.set("spark.sql.streaming.checkpointLocation", str(tmp_path / "default"))
    try:
        named = _checkpoint_location(df.writeStream, spark, {}, "q1")
        unnamed_writer = df.writeStream
        unnamed = _checkpoint_location(unnamed_writer, spark, {}, None)
    finally:
        spark.conf.unset("spark.sql.streaming.checkpointLocation")
    assert named == f"{tmp_path / 'default'}/q1"
    # Spark would choose a random name: the one chosen is set as the query's option
    assert unnamed.startswith(f"{tmp_path / 'default'}/") and unnamed_writer._dstl_options == {
        "checkpointlocation": unnamed
    }
    assert Path(_checkpoint_location(df.writeStream, spark, {}, None)).name.startswith("dstl-temporary-")
