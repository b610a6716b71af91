"""The keyed backend's current key (``ChangelogKeyedStateBackend.set_current_key``): every key type
is distinct and round-trips through state, timers and a restore, the backend's fast path encodes a
key exactly as ``backend.core``'s canonical serializer does, and a key outside the backend's
key-group range or of an unsupported type is refused. (The serializer and the key-group assignment
themselves are tested in tests/backend/core.)"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from backend.core.keygroups import assign_key_group, key_group_ranges
from backend.core.serializers import serialize_key
from backend.core.tablekeys import ckey
from tests.backend.state.support import MAX_P, VALUE, Env, key_outside, owner

KEYS_BY_TYPE = {
    "int": [0, 1, -1, 2**63 - 1, -(2**63), 2**80, -(2**70)],
    "str": ["", "a", "ab", "ü-ñ-€", "\x00", "x" * 300],
    "bytes": [b"", b"\x00", b"\xff" * 3, b"ab"],
    "tuple": [(), (1,), (1, "a"), ("a", 1), ((1, 2), b"x"), (None, True, 1.5)],
    "mixed": [1, True, 1.0, "1", b"1", (1,), None, False, 0],
}


@pytest.mark.parametrize("kind", list(KEYS_BY_TYPE))
def test_keys_of_many_types_are_distinct_and_round_trip(env: Env, kind: str) -> None:
    keys = KEYS_BY_TYPE[kind]
    b = env.backend()
    v = b.get_state(VALUE)
    for i, k in enumerate(keys):
        b.set_current_key(k)
        v.update(i)
        b.register_event_time_timer(i)
    for i, k in enumerate(keys):
        b.set_current_key(k)
        assert v.value() == i, k

    b = env.reopen(b)
    v = b.get_state(VALUE)
    for i, k in enumerate(keys):
        b.set_current_key(k)
        assert v.value() == i, k
    fired: list[tuple[Any, int]] = []
    b.advance_watermark(len(keys), lambda key, ts: fired.append((key, ts)))
    assert fired == list(zip(keys, range(len(keys)), strict=True))
    for (key, _), original in zip(fired, keys, strict=True):
        assert type(key) is type(original)


def test_set_current_key_encodes_every_key_as_the_canonical_serializer_does(env: Env) -> None:
    """set_current_key inlines serialize_key's int case: the table key and key group must be
    those of the canonical encoding for every key, at the 64-bit edges and beyond them too
    (checkpoints and rescaling rely on them)."""

    b = env.backend()
    for key in [k for keys in KEYS_BY_TYPE.values() for k in keys] + [2**63, -(2**63) - 1, 2**64, True, 7]:
        data = serialize_key(key)
        kg = assign_key_group(data, MAX_P)
        b.set_current_key(key)
        assert (b.current_ckey, b.current_kg) == (ckey(kg, data), kg), key
        assert b.key_group_of(key) == kg


def test_set_current_key_outside_the_key_group_range_raises(env: Env) -> None:
    rng = key_group_ranges(MAX_P, 2)[0]
    b = env.backend(rng)
    s = b.get_state(VALUE)
    inside = next(i for i in itertools.count() if owner(i, 2) == 0)
    b.set_current_key(inside)
    s.update(1)
    key, kg = key_outside(rng)
    with pytest.raises(ValueError, match=rf"key group {kg}\b"):
        b.set_current_key(key)
    assert s.value() == 1  # the current key did not change


def test_unsupported_key_types_are_refused(env: Env) -> None:
    b = env.backend()
    with pytest.raises(ValueError):
        b.set_current_key([1, 2])  # type: ignore[arg-type]
