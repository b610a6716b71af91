"""Which uid each routed operator of a query resumes (``backend.spark.operator_ids``): the one
recorded at its place, as Spark knows an operator by its operator id; the rules without Spark."""

from __future__ import annotations

import pytest

from backend.spark.operator_ids import assign_uids
from dstl import ConfigurationError


def test_a_new_query_takes_each_operators_own_uid() -> None:
    assert assign_uids([], [("Counting", True), ("count_rows", True)]) == ["Counting", "count_rows"]


def test_a_derived_uid_resumes_the_one_recorded_at_its_place() -> None:
    assert assign_uids(["Counting", "Summing"], [("Renamed", True), ("Summing", True)]) == ["Counting", "Summing"]


def test_a_given_uid_names_its_operator_wherever_it_is() -> None:
    assert assign_uids(["Counting"], [("mine", False), ("Summing", True)]) == ["mine", "Summing"]


def test_an_operator_added_at_the_end_takes_its_own_uid_and_meeting_ones_get_their_place() -> None:
    assert assign_uids(["operator"], [("operator", True), ("operator", True)]) == ["operator", "operator-1"]
    assert assign_uids([], [("f", True), ("f", True), ("f", True)]) == ["f", "f-1", "f-2"]
    assert assign_uids(["f", "f-2"], [("g", True), ("g", True), ("f", True)]) == ["f", "f-2", "f-2-1"]


def test_two_given_uids_that_meet_are_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"more than one routed stateful operator with uid \['x'\]"):
        assign_uids([], [("x", False), ("x", False)])
    with pytest.raises(ConfigurationError, match=r"place 1 of this query resumes the state recorded there, 'x'"):
        assign_uids(["a", "x"], [("x", False), ("b", True)])  # the second's place recorded 'x'
