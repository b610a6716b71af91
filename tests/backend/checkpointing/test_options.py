"""A job's options are checked when they are made (naming the option), and the one "inside a
directory" check that keeps savepoints and restores out of a job directory."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from backend.checkpointing.metadata import is_inside, snapshot_location
from backend.core.descriptors import ValueStateDescriptor
from backend.core.errors import CheckpointError
from backend.core.serializers import Int64Serializer
from backend.job import JobOptions, LocalJob, OperatorSpec
from dstl import ConfigurationError
from dstl.paths import local_path
from materializer.options import MaterializationOptions

VALUE = ValueStateDescriptor("value", Int64Serializer())


@pytest.mark.parametrize(
    ("kwargs", "option"),
    [
        ({"num_retained": 0}, "num_retained"),
        ({"cache_limit": 0}, "cache_limit"),
        ({"metrics_port": -1}, "metrics_port"),
        ({"metrics_port": 65536}, "metrics_port"),
        ({"metrics_addr": ""}, "metrics_addr"),
        ({"restore_from": ""}, "restore_from"),
        ({"retention": "delete"}, "retention"),
        ({"restore_mode": "claim"}, "restore_mode"),
        ({"state_loading": "Lazy"}, "state_loading"),
        ({"state_loading": None}, "state_loading"),
        ({"hydration_key_groups": 0}, "hydration_key_groups"),
        ({"hydration_key_groups": 1.5}, "hydration_key_groups"),
    ],
)
def test_job_options_out_of_range_name_the_option(kwargs: dict[str, Any], option: str) -> None:
    with pytest.raises(ConfigurationError, match=option):
        JobOptions(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "option"),
    [
        ({"interval_ms": 0}, "interval_ms"),
        ({"size_trigger_bytes": 0}, "size_trigger_bytes"),
        ({"chunk_key_groups": 0}, "chunk_key_groups"),
        ({"max_failures_allowed": -1}, "max_failures_allowed"),
    ],
)
def test_materialization_options_out_of_range_name_the_option(kwargs: dict[str, Any], option: str) -> None:
    with pytest.raises(ConfigurationError, match=option):
        MaterializationOptions(**kwargs)


def test_defaults_are_valid_and_metrics_bind_to_loopback() -> None:
    options = JobOptions(metrics_port=0)
    assert options.metrics_addr == "127.0.0.1"
    assert MaterializationOptions().size_trigger_bytes is not None
    assert issubclass(ConfigurationError, ValueError)  # callers catching ValueError keep working


def test_bad_operators_and_job_ids_are_configuration_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="operator uid"):
        OperatorSpec("a/b", 1)
    with pytest.raises(ConfigurationError, match=r"operator uid '\.\.' must be .* not '\.' or '\.\.'"):
        OperatorSpec("..", 1)  # a name, not a way to the parent directory
    with pytest.raises(ConfigurationError, match="parallelism"):
        OperatorSpec("op", 200, max_parallelism=128)
    with pytest.raises(ConfigurationError, match="job id"):
        LocalJob(tmp_path / "ckpt", "a\\b", [OperatorSpec("op", 1)], tmp_path / "local")
    with pytest.raises(ConfigurationError, match="unique"):
        LocalJob(tmp_path / "ckpt", "job", [OperatorSpec("op", 1), OperatorSpec("op", 2)], tmp_path / "local")


def test_a_uid_and_job_id_of_any_other_characters_name_their_directories(tmp_path: Path) -> None:
    """The one rule refuses only what cannot name one directory level: a uid the storage's writers
    and the changelog service always took (a space, a colon, non-ASCII) keeps working everywhere."""
    ops = [OperatorSpec("orders: v2", 1), OperatorSpec("café", 1)]
    with LocalJob(tmp_path / "ckpt", "job 1", ops, tmp_path / "local") as job:
        for op in ops:
            backend = job.backend_for(op.uid, "k")
            backend.get_state(VALUE).update(7)
        job.checkpoint()
    with LocalJob(tmp_path / "ckpt", "job 1", ops, tmp_path / "local") as job:
        for op in ops:
            assert job.backend_for(op.uid, "k").get_state(VALUE).value() == 7


def test_is_inside(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "job").mkdir(parents=True)
    assert is_inside(root / "job", root)
    assert is_inside(root, root)
    assert is_inside(f"file://{root}/job/chk-1", root)
    assert not is_inside(tmp_path / "rootless", root)  # a common prefix is not containment
    assert not is_inside(root, root / "job")
    assert is_inside("s3://bucket/jobs/j1/chk-3", "s3://bucket/jobs/j1/")
    assert not is_inside("s3://bucket/jobs/j10", "s3://bucket/jobs/j1")
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert is_inside("root/job/../job/x", str(root))
    finally:
        os.chdir(cwd)


def test_a_local_snapshot_is_one_directory_however_spelled(tmp_path: Path) -> None:
    """A plain path and its ``file://`` URL name one snapshot (the one local-URL rule,
    ``dstl.paths.local_path``); another file system's URL is left as it is."""
    chk = tmp_path / "job" / "chk-3"
    expected = (str(tmp_path / "job"), "chk-3/_metadata")
    assert snapshot_location(str(chk)) == expected
    assert snapshot_location(f"file://{chk}/") == expected
    assert snapshot_location(f"file://{chk}/_metadata") == expected
    assert snapshot_location("s3://bucket/job/chk-3") == ("s3://bucket/job", "chk-3/_metadata")
    assert (local_path("/a/b"), local_path("file:///a/b"), local_path("s3://a/b")) == ("/a/b", "/a/b", None)


def test_is_inside_sees_through_symlinks(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "job").mkdir(parents=True)
    link = tmp_path / "link"
    link.symlink_to(root / "job")
    assert is_inside(link / "savepoint", root)


def test_a_savepoint_through_a_symlink_into_the_job_directory_is_refused(tmp_path: Path) -> None:
    job = LocalJob(tmp_path / "ckpt", "job", [OperatorSpec("op", 1)], tmp_path / "local")
    try:
        link = tmp_path / "link"
        link.symlink_to(tmp_path / "ckpt" / "job")
        with pytest.raises(CheckpointError, match="inside the job directory"):
            job.savepoint(str(link / "sp"))
        with pytest.raises(ConfigurationError, match="format"):
            job.savepoint(str(tmp_path / "sp"), format="zip")
    finally:
        job.close()
