"""Key groups: how keys are spread over subtasks, following Flink's ``KeyGroupRangeAssignment``.

Every key is hashed once into one of ``max_parallelism`` *key groups*::

    key_group = murmur3_32(serialized_key) % max_parallelism

and subtask ``i`` of ``p`` owns one *contiguous* range of key groups. ``max_parallelism`` is fixed
for the life of a job (it is the unit of rescaling); ``p`` may change from one run to the next.

Why contiguous ranges rather than, say, ``key_group % p``:

- **Rescaling reads only what overlaps.** Every handle (materialized snapshot, changelog segment)
  records the key-group range it covers. A subtask restoring ``[a, b]`` at a new parallelism
  opens only the handles whose range intersects ``[a, b]``; with ranges, each old subtask's
  output overlaps at most a couple of new subtasks, instead of all of them.
- **A key group is a contiguous LMDB key range.** Table keys start with the key group as two
  big-endian bytes, so one key group (and one range of key groups) is one cursor range: a
  snapshot or a drop of the key groups a subtask gave away is a range scan or a range delete, not
  a filter over the whole table.

Ranges are Flink's exactly, so that ``subtask_for_key_group`` (``kg * p // max_p``) and
``key_group_range_for_subtask`` always agree: subtask ``i`` owns ``[ceil(i*max_p/p),
ceil((i+1)*max_p/p) - 1]``. (The floor form ``[i*max_p//p, (i+1)*max_p//p - 1]`` is also a
partition, but disagrees with ``kg * p // max_p`` whenever ``p`` does not divide ``max_p``.)
"""

from __future__ import annotations

from collections.abc import Sequence

import mmh3

from dstl.errors import ConfigurationError
from dstl.types import MAX_KEY_GROUP, KeyGroupRange

#: Flink's default when nothing is configured (Flink derives it from the parallelism; we don't).
DEFAULT_MAX_PARALLELISM = 128

#: Key groups are stored in two bytes; Flink's upper bound for max-parallelism is ``2**15``.
UPPER_BOUND_MAX_PARALLELISM = MAX_KEY_GROUP + 1

__all__ = [
    "DEFAULT_MAX_PARALLELISM",
    "UPPER_BOUND_MAX_PARALLELISM",
    "assign_key_group",
    "check_max_parallelism",
    "key_group_range_for_subtask",
    "key_group_ranges",
    "murmur3_32",
    "subtask_for_key_group",
]


def murmur3_32(data: bytes) -> int:
    """MurmurHash3 x86 32-bit of ``data`` with seed 0, as an unsigned int in ``[0, 2**32)``."""
    return mmh3.hash(data, 0, signed=False)


def check_max_parallelism(max_parallelism: int) -> None:
    """Raise ``ConfigurationError`` (a ``ValueError``) unless ``max_parallelism`` is an int in ``[1, 32768]``."""
    if type(max_parallelism) is not int or not 0 < max_parallelism <= UPPER_BOUND_MAX_PARALLELISM:
        raise ConfigurationError(
            f"max_parallelism must be an int in [1, {UPPER_BOUND_MAX_PARALLELISM}], got {max_parallelism!r}"
        )


def _check_parallelism(max_parallelism: int, parallelism: int) -> None:
    check_max_parallelism(max_parallelism)
    if type(parallelism) is not int or not 0 < parallelism <= max_parallelism:
        raise ConfigurationError(
            f"parallelism must be an int in [1, max_parallelism={max_parallelism}], got {parallelism!r}"
        )


def assign_key_group(serialized_key: bytes, max_parallelism: int) -> int:
    """The key group of a key, given its canonical serialization (``serializers.serialize_key``).

    This is on the path of every keyed access, so it checks only the range of ``max_parallelism``.
    """
    if not 0 < max_parallelism <= UPPER_BOUND_MAX_PARALLELISM:
        check_max_parallelism(max_parallelism)  # raises with the full message
    return mmh3.hash(serialized_key, 0, signed=False) % max_parallelism


def key_group_range_for_subtask(max_parallelism: int, parallelism: int, index: int) -> KeyGroupRange:
    """The key groups subtask ``index`` of ``parallelism`` owns (never empty).

    Flink's ``KeyGroupRangeAssignment.computeKeyGroupRangeForOperatorIndex``. The ranges of
    subtasks ``0 .. parallelism-1`` partition ``[0, max_parallelism)`` in order, and their sizes
    differ by at most one.
    """
    _check_parallelism(max_parallelism, parallelism)
    if type(index) is not int or not 0 <= index < parallelism:
        raise ConfigurationError(f"subtask index must be an int in [0, parallelism={parallelism}), got {index!r}")
    start = (index * max_parallelism + parallelism - 1) // parallelism
    end = ((index + 1) * max_parallelism - 1) // parallelism
    return KeyGroupRange(start, end)


def subtask_for_key_group(max_parallelism: int, parallelism: int, key_group: int) -> int:
    """The subtask of ``parallelism`` that owns ``key_group``.

    Flink's ``KeyGroupRangeAssignment.computeOperatorIndexForKeyGroup``; the inverse of
    ``key_group_range_for_subtask``.
    """
    _check_parallelism(max_parallelism, parallelism)
    if type(key_group) is not int or not 0 <= key_group < max_parallelism:
        raise ConfigurationError(
            f"key group must be an int in [0, max_parallelism={max_parallelism}), got {key_group!r}"
        )
    return key_group * parallelism // max_parallelism


def key_group_ranges(max_parallelism: int, parallelism: int) -> Sequence[KeyGroupRange]:
    """The key-group ranges of subtasks ``0 .. parallelism-1``, in order (a partition of all)."""
    return [key_group_range_for_subtask(max_parallelism, parallelism, i) for i in range(parallelism)]
