"""The state benchmark's two modes do the same work: per call and in batches (``backend.batch``),
with the log on and off, the counts they leave are the same as a dict's; so does the batch mode's
floor (nothing of ours) in its LMDB table.

Only the work is checked here; the rates are the benchmark's to measure (its full run).
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from backend.core.descriptors import ValueStateDescriptor
from backend.core.serializers import Int64Serializer
from benchmarks import state as bench
from dstl import ChangelogConfig, StateChangelogStorage


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("log", [True, False])
def test_both_modes_leave_the_counts_a_dict_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, batched: bool, log: bool
) -> None:
    monkeypatch.setattr(bench, "CHECKPOINT_EVERY", 1_000)
    monkeypatch.setattr(bench, "BATCH_KEYS", 100)
    keys = 2_000
    rng = random.Random(7)
    sample = [rng.randrange(keys) for _ in range(3_000)]
    with StateChangelogStorage(ChangelogConfig.local(tmp_path / "dfs")) as storage:
        backend = bench._backend(str(tmp_path), storage if log else None, log)
        try:
            bench._populate(backend, keys)
            assert bench._updates(backend, sample, 100, batched) > 0
            counts = Counter(sample)
            state = backend.get_state(ValueStateDescriptor("count", Int64Serializer()))
            for key in range(keys):
                backend.set_current_key(key)
                assert state.value() == counts[key], key
        finally:
            backend.close()


def test_the_batch_floor_leaves_the_counts_a_dict_would(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "CHECKPOINT_EVERY", 1_000)
    monkeypatch.setattr(bench, "BATCH_KEYS", 100)
    keys = 2_000
    rng = random.Random(7)
    sample = [rng.randrange(keys) for _ in range(3_000)]
    env = bench._floor_table(str(tmp_path), keys)
    try:
        assert bench._batch_floor(env, sample) > 0
        counts = Counter(sample)
        with env.begin() as txn:
            assert [bench._VALUE.unpack(v)[0] for _, v in txn.cursor()] == [counts[k] for k in range(keys)]
    finally:
        env.close()
