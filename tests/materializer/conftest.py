"""Fixtures of the materializer tests: ``env``, a local DFS and the backends of one test
(``tests.materializer.backends.environment``). The handover and pack tests override it with a
storage that owns no files, as a Spark worker's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.materializer.backends import Env, environment


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    with environment(tmp_path) as e:
        yield e
