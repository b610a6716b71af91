"""A task's output frames are concatenated before Spark converts them to Arrow (one conversion per
run of frames of one schema, not one per key): the rows, their order and every column's dtype are
what the frames held; frames of another schema and the row bound start a new frame.
"""

from __future__ import annotations

import pytest

from backend.spark.coalesce import coalesced

pd = pytest.importorskip("pandas")


def frame(user: str, count: object) -> object:
    return pd.DataFrame({"user": [user], "count": [count]})


def test_frames_of_one_schema_become_one_frame_in_order() -> None:
    frames = [frame(f"u{i}", i) for i in range(5)]
    (out,) = coalesced(frames, 10_000)
    assert out["user"].tolist() == [f"u{i}" for i in range(5)] and out["count"].tolist() == list(range(5))
    assert out["count"].dtype == "int64" and list(out.index) == list(range(5))


def test_a_frame_of_another_dtype_starts_a_new_frame() -> None:
    """No column is widened: an int column next to a float one would become float, and convert differently."""
    frames = [frame("a", 1), frame("b", 2), frame("c", 2.5), frame("d", 3)]
    out = list(coalesced(frames, 10_000))
    assert [f["user"].tolist() for f in out] == [["a", "b"], ["c"], ["d"]]
    assert [str(f["count"].dtype) for f in out] == ["int64", "float64", "int64"]


def test_other_columns_start_a_new_frame() -> None:
    frames = [frame("a", 1), pd.DataFrame({"count": [2], "user": ["b"]}), frame("c", 3)]
    out = list(coalesced(frames, 10_000))
    assert [list(f.columns) for f in out] == [["user", "count"], ["count", "user"], ["user", "count"]]


def test_no_frame_grows_past_the_row_bound_and_a_larger_one_stays_whole() -> None:
    big = pd.DataFrame({"user": list("xyz"), "count": [7, 8, 9]})
    frames = [frame("a", 1), frame("b", 2), frame("c", 3), big, frame("d", 4)]
    out = list(coalesced(frames, 2))
    assert [f["user"].tolist() for f in out] == [["a", "b"], ["c"], ["x", "y", "z"], ["d"]]


def test_extension_dtypes_nulls_and_the_column_index_are_kept() -> None:
    """Nullable ints, Arrow strings and object columns holding None concatenate as pd.concat does."""
    frames = [
        pd.DataFrame({"user": pd.array(["a"], dtype="string"), "count": pd.array([1], dtype="Int64")}),
        pd.DataFrame({"user": pd.array(["b"], dtype="string"), "count": pd.array([None], dtype="Int64")}),
        pd.DataFrame({"user": ["c", None], "count": [3.5, float("nan")]}),
        pd.DataFrame({"user": ["d"], "count": [4.5]}),
    ]
    for f in frames:
        f.columns.name = "fields"
    out = list(coalesced(frames, 10_000))
    assert [str(f["count"].dtype) for f in out] == ["Int64", "float64"]
    assert out[0]["count"].isna().tolist() == [False, True] and out[1]["user"].tolist() == ["c", None, "d"]
    expected = pd.concat(frames[2:], ignore_index=True)
    assert out[1].equals(expected) and out[1].columns.name == "fields"


def test_nothing_in_nothing_out() -> None:
    assert list(coalesced([], 10)) == []
