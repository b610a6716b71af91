"""``PeriodicMaterializer``: when a materialization is triggered (the jittered interval, the size
of the log), and the settings and storage it refuses.

Uploads are held by the ``upload`` callable the materializer accepts and time is a fake clock;
nothing here waits by sleeping.
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any

import pytest

from backend.core.descriptors import ValueStateDescriptor
from backend.core.errors import StateRestoreError
from backend.core.handles import KeyedStateHandle
from backend.core.serializers import Int64Serializer
from backend.state.keyed_backend import ChangelogKeyedStateBackend
from dstl import ChangelogConfig, ConfigurationError, KeyGroupRange, StateChangelogStorage
from materializer.options import MaterializationOptions
from materializer.periodic import PeriodicMaterializer, restore
from tests.materializer.backends import FULL, NEVER, WAIT_S, B, Env, GatedUpload, fake_clock
from tests.support.materializer_crash_child import MAX_P, OPERATOR, apply_to_backend, batch_a, batch_b

# -- 5. when a materialization starts ------------------------------------------------------------


def test_periodic_trigger_waits_for_the_jittered_due_time(env: Env) -> None:
    now = [1_000_000.0]  # ms
    interval = 100_000
    b = env.backends.new()
    upload = GatedUpload(env.storage)
    m = PeriodicMaterializer(
        b,
        MaterializationOptions(interval_ms=interval, size_trigger_bytes=None),
        clock_ms=fake_clock(now),
        rng=random.Random(7),
        upload=upload,
    )
    due = now[0] + interval * random.Random(7).uniform(0.5, 1.0)
    apply_to_backend(b, batch_a())
    b.flush()

    for t in (now[0], now[0] + interval * 0.5 - 1e-6, due - 1e-6):
        now[0] = t
        assert m.poll() is False
    assert m.metrics.started == 0
    now[0] = due
    upload.gate.clear()
    assert m.poll() is True
    assert m.metrics.started == 1

    apply_to_backend(b, batch_b())  # while it runs, even past the next due time, none starts
    b.flush()
    now[0] = due + 2 * interval
    assert m.poll() is False
    assert m.trigger() is False
    assert m.metrics.started == 1
    upload.gate.set()
    m.wait(WAIT_S)
    assert m.metrics.completed == 1
    assert m.poll() is True  # overdue and batch B changed the state: starts at once
    m.wait(WAIT_S)

    started = now[0]  # the next due time counts from when the last one started
    apply_to_backend(b, [(1, 1, 1, ("x", 1))])
    b.flush()
    now[0] = started + interval - 1e-6
    assert m.poll() is False
    now[0] = started + interval
    assert m.poll() is True
    m.wait(WAIT_S)
    assert m.metrics.started == 3

    now[0] = started + 2 * interval  # due, but nothing changed: skipped, due again an interval later
    assert m.poll() is False
    assert (m.metrics.skipped_unchanged, m.metrics.started) == (1, 3)
    apply_to_backend(b, [(2, 2, 2, ("x", 2))])
    b.flush()
    now[0] = started + 3 * interval - 1e-6
    assert m.poll() is False
    now[0] = started + 3 * interval
    assert m.poll() is True
    m.wait(WAIT_S)
    assert (m.metrics.started, m.metrics.completed, m.metrics.skipped_unchanged) == (4, 4, 1)
    m.close()


def test_first_due_time_is_jittered_between_half_and_one_interval(env: Env) -> None:
    b = env.backends.new()
    apply_to_backend(b, [(1, 1, 1, ("x", 1))])
    b.flush()
    dues = set()
    for seed in range(5):
        now = [0.0]
        m = PeriodicMaterializer(
            b,
            MaterializationOptions(interval_ms=100_000, size_trigger_bytes=None),
            clock_ms=fake_clock(now),
            rng=random.Random(seed),
        )
        expected = 100_000 * random.Random(seed).uniform(0.5, 1.0)
        now[0] = expected - 1e-6
        assert m.poll() is False
        now[0] = expected
        assert m.poll() is True
        m.close()
        dues.add(expected)
        apply_to_backend(b, [(seed, seed, seed, ("x", seed))])
        b.flush()
    assert len(dues) == 5  # subtasks do not all upload at once


def test_size_trigger_starts_as_soon_as_enough_was_logged(env: Env) -> None:
    now = [0.0]
    b = env.backends.new()
    upload = GatedUpload(env.storage)
    m = PeriodicMaterializer(
        b, MaterializationOptions(interval_ms=NEVER, size_trigger_bytes=2_000), clock_ms=fake_clock(now), upload=upload
    )
    key = itertools.count()
    while True:
        k = next(key)
        apply_to_backend(b, [(k, k, k, ("x", k))])
        b.flush()  # logged: the size counts what the log holds
        if b.log_bytes_since_materialization >= 2_000:
            break
        assert m.poll() is False
    upload.gate.clear()
    assert m.poll() is True
    assert b.log_bytes_since_materialization == 0
    for _ in range(30):  # a burst while it runs: no second one starts
        k = next(key)
        apply_to_backend(b, [(k, k, k, ("x", k))])
    b.flush()
    assert b.log_bytes_since_materialization >= 2_000
    assert m.poll() is False
    assert m.metrics.started == 1
    upload.gate.set()
    m.wait(WAIT_S)
    assert m.poll() is True  # the burst alone was enough
    m.wait(WAIT_S)
    assert (m.metrics.started, m.metrics.completed) == (2, 2)
    m.close()


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({"interval_ms": 0}, "interval_ms"),
        ({"chunk_key_groups": 0}, "chunk_key_groups"),
        ({"max_failures_allowed": -1}, "max_failures_allowed"),
    ],
)
def test_bad_settings_are_rejected(env: Env, kwargs: dict[str, Any], problem: str) -> None:
    with pytest.raises(ConfigurationError, match=problem):
        PeriodicMaterializer(env.backends.new(), MaterializationOptions(**kwargs))


def test_materialization_needs_the_changelog(env: Env) -> None:
    b = B(OPERATOR, FULL, env.tmp / "no-log", storage=None, max_parallelism=MAX_P, log_enabled=False)
    try:
        with pytest.raises(ConfigurationError, match="changelog storage"):
            PeriodicMaterializer(b)
    finally:
        b.close()


@pytest.mark.parametrize("path", ["../outside.chunk", "/etc/passwd", "s3://other/bucket.chunk"])
def test_a_chunk_path_outside_the_base_path_is_refused(tmp_path: Path, path: str) -> None:
    storage = StateChangelogStorage(ChangelogConfig.local(tmp_path / "dfs"))
    try:
        backend = ChangelogKeyedStateBackend("op", KeyGroupRange(0, 127), tmp_path / "a", storage=storage)
        m = PeriodicMaterializer(backend, MaterializationOptions(interval_ms=NEVER, size_trigger_bytes=None))
        backend.get_state(ValueStateDescriptor("v", Int64Serializer()))
        backend.set_current_key(1)
        backend.get_state(ValueStateDescriptor("v", Int64Serializer())).update(1)
        assert m.trigger()
        m.wait()
        handle = backend.snapshot(1).result(30)
        backend.notify_checkpoint_complete(1)
        tampered = handle.to_json()
        tampered["materialized"][0]["path"] = path
        fresh = ChangelogKeyedStateBackend("op", KeyGroupRange(0, 127), tmp_path / "b", storage=storage)
        with pytest.raises(StateRestoreError, match=r"outside|not relative"):
            restore(fresh, [KeyedStateHandle.from_json(tampered)])
        m.close()
    finally:
        storage.close()
