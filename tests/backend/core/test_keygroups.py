"""Key-group assignment: murmur3, Flink's ranges, and their agreement with the inverse mapping."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from backend.core.keygroups import (
    DEFAULT_MAX_PARALLELISM,
    UPPER_BOUND_MAX_PARALLELISM,
    assign_key_group,
    key_group_range_for_subtask,
    murmur3_32,
    subtask_for_key_group,
)
from backend.core.serializers import serialize_key
from dstl.types import KeyGroupRange


def _reference_murmur3_32(data: bytes, seed: int = 0) -> int:
    """The textbook MurmurHash3 x86_32, to check that the C one is used unsigned with seed 0."""
    c1, c2, mask = 0xCC9E2D51, 0x1B873593, 0xFFFFFFFF
    h = seed
    full = len(data) - len(data) % 4
    for i in range(0, full, 4):
        k = int.from_bytes(data[i : i + 4], "little")
        k = (k * c1) & mask
        k = ((k << 15) | (k >> 17)) & mask
        k = (k * c2) & mask
        h ^= k
        h = ((h << 13) | (h >> 19)) & mask
        h = (h * 5 + 0xE6546B64) & mask
    tail = data[full:]
    if tail:
        k = int.from_bytes(tail, "little")
        k = (k * c1) & mask
        k = ((k << 15) | (k >> 17)) & mask
        k = (k * c2) & mask
        h ^= k
    h ^= len(data)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & mask
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & mask
    h ^= h >> 16
    return h


def test_murmur3_known_vectors() -> None:
    assert murmur3_32(b"") == 0
    assert murmur3_32(b"hello") == 0x248BFA47
    assert murmur3_32(b"The quick brown fox jumps over the lazy dog") == 0x2E4FF723
    assert murmur3_32(b"\xff\xff\xff\xff") == _reference_murmur3_32(b"\xff\xff\xff\xff")  # unsigned, not negative


@given(st.binary(max_size=64))
def test_murmur3_matches_reference(data: bytes) -> None:
    assert murmur3_32(data) == _reference_murmur3_32(data)
    assert 0 <= murmur3_32(data) < 2**32


@given(st.binary(max_size=64), st.integers(1, UPPER_BOUND_MAX_PARALLELISM))
def test_assign_key_group_is_murmur_mod_max_parallelism(data: bytes, max_p: int) -> None:
    kg = assign_key_group(data, max_p)
    assert kg == murmur3_32(data) % max_p
    assert 0 <= kg < max_p


def test_key_groups_of_sequential_int_keys_are_uniform() -> None:
    # Deterministic (no randomness): with 100k keys the mean per group is ~781 and a fair hash
    # has a standard deviation of ~28, so a 30% band is more than 8 sigma wide.
    max_p = DEFAULT_MAX_PARALLELISM
    counts = [0] * max_p
    for key in range(100_000):
        counts[assign_key_group(serialize_key(key), max_p)] += 1
    mean = 100_000 / max_p
    assert all(0.7 * mean <= c <= 1.3 * mean for c in counts), (min(counts), max(counts), mean)


def test_key_groups_of_string_keys_are_uniform() -> None:
    max_p = 128
    counts = [0] * max_p
    for i in range(100_000):
        counts[assign_key_group(serialize_key(f"user-{i}"), max_p)] += 1
    mean = 100_000 / max_p
    assert all(0.7 * mean <= c <= 1.3 * mean for c in counts), (min(counts), max(counts), mean)


@pytest.mark.parametrize("max_p", [1, 2, 3, 7, 10, 128, 129, 300])
def test_subtask_ranges_partition_all_key_groups(max_p: int) -> None:
    for p in range(1, max_p + 1):
        ranges = [key_group_range_for_subtask(max_p, p, i) for i in range(p)]
        assert ranges[0].start == 0
        assert ranges[-1].end == max_p - 1
        for prev, cur in itertools.pairwise(ranges):
            assert cur.start == prev.end + 1
        sizes = {len(r) for r in ranges}
        assert min(sizes) >= 1
        assert max(sizes) - min(sizes) <= 1
        for i, r in enumerate(ranges):
            for kg in r:
                assert subtask_for_key_group(max_p, p, kg) == i


@given(st.data())
def test_subtask_for_key_group_agrees_with_ranges_up_to_the_bound(data: st.DataObject) -> None:
    max_p = data.draw(st.integers(1, UPPER_BOUND_MAX_PARALLELISM))
    p = data.draw(st.integers(1, max_p))
    kg = data.draw(st.integers(0, max_p - 1))
    index = subtask_for_key_group(max_p, p, kg)
    assert 0 <= index < p
    assert kg in key_group_range_for_subtask(max_p, p, index)


def test_ranges_are_flinks() -> None:
    # KeyGroupRangeAssignment.computeKeyGroupRangeForOperatorIndex(128, 3, i)
    assert [key_group_range_for_subtask(128, 3, i) for i in range(3)] == [
        KeyGroupRange(0, 42),
        KeyGroupRange(43, 85),
        KeyGroupRange(86, 127),
    ]
    assert key_group_range_for_subtask(128, 1, 0) == KeyGroupRange(0, 127)
    assert key_group_range_for_subtask(128, 128, 5) == KeyGroupRange(5, 5)
    assert key_group_range_for_subtask(UPPER_BOUND_MAX_PARALLELISM, 2, 1) == KeyGroupRange(16384, 32767)


@pytest.mark.parametrize("max_p", [0, -1, UPPER_BOUND_MAX_PARALLELISM + 1, 1.5, True])
def test_invalid_max_parallelism(max_p: int) -> None:
    with pytest.raises(ValueError, match="max_parallelism"):
        key_group_range_for_subtask(max_p, 1, 0)
    with pytest.raises(ValueError, match="max_parallelism"):
        subtask_for_key_group(max_p, 1, 0)
    if type(max_p) is int:  # the hot path checks only the range
        with pytest.raises(ValueError, match="max_parallelism"):
            assign_key_group(b"k", max_p)


@pytest.mark.parametrize("p", [0, -3, 129])
def test_invalid_parallelism(p: int) -> None:
    with pytest.raises(ValueError, match="parallelism must be"):
        key_group_range_for_subtask(128, p, 0)
    with pytest.raises(ValueError, match="parallelism must be"):
        subtask_for_key_group(128, p, 0)


def test_invalid_index_and_key_group() -> None:
    with pytest.raises(ValueError, match="subtask index"):
        key_group_range_for_subtask(128, 4, 4)
    with pytest.raises(ValueError, match="subtask index"):
        key_group_range_for_subtask(128, 4, -1)
    with pytest.raises(ValueError, match="key group"):
        subtask_for_key_group(128, 4, 128)
    with pytest.raises(ValueError, match="key group"):
        subtask_for_key_group(128, 4, -1)
