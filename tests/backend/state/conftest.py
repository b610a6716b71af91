"""Fixtures of the keyed-state tests: ``env`` (creates backends, closes them) and ``phase``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from dstl import StateChangelogStorage
from tests.backend.state.support import B, Env, Phase


@pytest.fixture
def env(tmp_path: Path, local_storage: StateChangelogStorage) -> Iterator[Env]:
    e = Env(tmp_path, local_storage)
    try:
        yield e
    finally:
        e.close_all()


def _cached(b: B) -> B:
    return b


def _flushed(b: B) -> B:
    b.flush()
    return b


@pytest.fixture(params=["cached", "flushed", "snapshotted", "restored"])
def phase(request: pytest.FixtureRequest, env: Env) -> Phase:
    """Where the last writes are when they are read back: the same backend or a restored one."""

    def snapshotted(b: B) -> B:
        env.checkpoint(b)
        return b

    return {"cached": _cached, "flushed": _flushed, "snapshotted": snapshotted, "restored": env.reopen}[request.param]
