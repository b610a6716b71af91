"""Options and the choice of uploader: a bad option names itself; ``make_uploader`` goes by scheme."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import dstl
from dstl import ChangelogConfig, ConfigurationError, HedgingPolicy, make_uploader
from dstl.paths import check_relative, new_file_name
from dstl.uploaders import FsspecUploader, S3Uploader


@pytest.mark.parametrize(
    ("overrides", "option"),
    [
        ({"persist_size_threshold": 0}, "persist_size_threshold"),
        ({"preemptive_persist_threshold": -1}, "preemptive_persist_threshold"),
        ({"max_in_flight_bytes": 0}, "max_in_flight_bytes"),
        ({"upload_timeout_ms": 0}, "upload_timeout_ms"),
        ({"max_attempts": 0}, "max_attempts"),
        ({"prefix_count": 0}, "prefix_count"),
        ({"persist_delay_ms": -0.1}, "persist_delay_ms"),
        ({"retry_delay_ms": -1}, "retry_delay_ms"),
        ({"compression_level": 23}, "compression_level"),
        ({"parallel_reads": 0}, "parallel_reads"),
    ],
)
def test_a_bad_option_raises_a_configuration_error_naming_it(overrides: dict[str, Any], option: str) -> None:
    with pytest.raises(ConfigurationError, match=option) as info:
        ChangelogConfig(base_path="/tmp/unused", **overrides)
    assert isinstance(info.value, ValueError)  # callers that catch ValueError keep working


@pytest.mark.parametrize(
    ("overrides", "option"),
    [
        ({"percentile": 1.0}, "hedging.percentile"),
        ({"second_percentile": 0.0}, "hedging.second_percentile"),
        ({"budget": 1.5}, "hedging.budget"),
        ({"min_delay_ms": 2000, "max_delay_ms": 1000}, "hedging.min_delay_ms"),
        ({"window": 0}, "hedging.window"),
        ({"min_samples": 0}, "hedging.min_samples"),
    ],
)
def test_a_bad_hedging_option_names_it(overrides: dict[str, Any], option: str) -> None:
    with pytest.raises(ConfigurationError, match=option):
        HedgingPolicy(**overrides)


def test_an_empty_base_path_and_an_s3_url_without_bucket_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="base_path"):
        ChangelogConfig(base_path="")
    with pytest.raises(ConfigurationError, match="base_path"):
        make_uploader(ChangelogConfig(base_path="s3:///prefix"))


def test_make_uploader_is_exported_and_picks_the_implementation_by_scheme(tmp_path: Path) -> None:
    assert "make_uploader" in dstl.__all__ and "Uploader" in dstl.__all__
    assert "CorruptDataError" in dstl.__all__  # the troubleshooting table names its subclasses
    assert isinstance(make_uploader(ChangelogConfig(base_path="s3://bucket/prefix")), S3Uploader)
    assert isinstance(make_uploader(ChangelogConfig.local(tmp_path)), FsspecUploader)
    assert isinstance(make_uploader(ChangelogConfig(base_path="memory://dstl-config-test")), FsspecUploader)
    assert isinstance(make_uploader(ChangelogConfig(base_path=f"file://{tmp_path}")), FsspecUploader)


@pytest.mark.parametrize("path", ["", "/abs", "../up", "a/../../up", ".", "a\\b", "s3://bucket/key"])
def test_check_relative_refuses_paths_leaving_the_base_path(path: str) -> None:
    with pytest.raises(ConfigurationError, match="base path"):
        check_relative(path)


def test_check_relative_normalizes_and_new_file_names_are_spread_over_prefixes() -> None:
    assert check_relative("dstl/./00/../01/x") == "dstl/01/x"
    names = {new_file_name(4) for _ in range(64)}
    assert len(names) == 64
    assert {name.split("/")[1] for name in names} <= {"00", "01", "02", "03"}
    assert all(check_relative(name) == name and name.startswith("dstl/") for name in names)
