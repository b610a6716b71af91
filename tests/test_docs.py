"""README.md is the user guide: its configuration reference names every option, its quick start
is exactly the two commands CI runs, and its prose stays readable.

Why a test: options are added in code and forgotten in the docs. The options are read from the
code (dataclass fields and keyword-only parameters), not from a list kept here, so a new option
fails this test until the README's configuration reference names it.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
import re
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")

#: packages whose options classes (frozen dataclasses named ``*Options``, ``*Config`` or ``*Policy``)
#: are user-facing; backend.spark is left out: its ``OperatorConfig`` is what a task is shipped,
#: its user-facing options are the keywords of the operator functions (checked below)
OPTION_PACKAGES = ("dstl", "backend.core", "backend.state", "backend.checkpointing", "backend.job", "materializer")
OPTION_SUFFIXES = ("Options", "Config", "Policy")

#: keyword-only parameters that are test seams, not options a user sets
TEST_HOOKS = {"rng", "upload"}


def _section(heading: str) -> str:
    """The README text from the ``## heading`` line to the next ``## `` heading."""
    match = re.search(rf"^## {re.escape(heading)}\s*$(.*?)(?=^## |\Z)", README, re.M | re.S)
    assert match, f"README.md has no '## {heading}' section"
    return match.group(1)


CONFIGURATION = _section("Configuration reference")


def _modules(package: str) -> Iterator[Any]:
    module = importlib.import_module(package)
    yield module
    for info in pkgutil.walk_packages(getattr(module, "__path__", []), prefix=f"{package}."):
        yield importlib.import_module(info.name)


def _options_classes() -> dict[str, type]:
    found: dict[str, type] = {}
    for package in OPTION_PACKAGES:
        for module in _modules(package):
            for name, obj in vars(module).items():
                if (
                    inspect.isclass(obj)
                    and dataclasses.is_dataclass(obj)
                    and obj.__module__ == module.__name__
                    and name.endswith(OPTION_SUFFIXES)
                    and not name.startswith("_")
                ):
                    found[f"{module.__name__}.{name}"] = obj
    return found


def _keyword_options(func: Callable[..., Any]) -> dict[str, Any]:
    """The options of ``func`` (keyword-only parameters, and parameters with a default) -> their
    resolved annotation (Any where it cannot be resolved)."""
    try:
        hints = typing.get_type_hints(func)
    except Exception:  # an annotation names a TYPE_CHECKING-only import: fall back to names only
        hints = {}
    return {
        name: hints.get(name, Any)
        for name, p in inspect.signature(func).parameters.items()
        if name not in TEST_HOOKS
        and (
            p.kind is inspect.Parameter.KEYWORD_ONLY
            or (p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and p.default is not inspect.Parameter.empty)
        )
    }


def _missing(names: list[str]) -> list[str]:
    return [n for n in names if f"`{n}`" not in CONFIGURATION]


def test_the_known_options_classes_are_found() -> None:
    """Guards the discovery itself: if these disappear, the test below checks nothing."""
    classes = {name.rsplit(".", 1)[1] for name in _options_classes()}
    assert {"ChangelogConfig", "HedgingPolicy", "S3Options"} <= classes, sorted(classes)


def test_every_field_of_an_options_class_is_in_the_configuration_reference() -> None:
    problems = []
    for qualname, cls in sorted(_options_classes().items()):
        if cls.__name__ not in CONFIGURATION:
            problems.append(f"no table for {qualname}")
        missing = _missing([f.name for f in dataclasses.fields(cls)])
        if missing:
            problems.append(f"{qualname} option(s) {missing}")
    assert not problems, f"README's configuration reference lacks: {problems}"


def _entry_points() -> dict[str, Any]:
    """The constructors, functions and options classes a user passes options to (located by import,
    so a move fails here by name instead of silently checking nothing)."""
    from backend.job import LocalJob, OperatorSpec
    from backend.spark.plan import build
    from backend.state.keyed_backend import ChangelogKeyedStateBackend
    from materializer.periodic import PeriodicMaterializer

    return {
        "ChangelogKeyedStateBackend": ChangelogKeyedStateBackend.__init__,
        "PeriodicMaterializer": PeriodicMaterializer.__init__,
        "LocalJob": LocalJob.__init__,
        "OperatorSpec": OperatorSpec,
        "Spark operator": build,
    }


def _option_names(target: Any) -> list[str]:
    """A dataclass: its fields; a callable: its options, and the fields of any options dataclass
    among them (``X | None`` included)."""
    if inspect.isclass(target) and dataclasses.is_dataclass(target):
        return [f.name for f in dataclasses.fields(target)]
    options = _keyword_options(target)
    names = list(options)
    for annotation in options.values():
        for candidate in (annotation, *typing.get_args(annotation)):
            if inspect.isclass(candidate) and dataclasses.is_dataclass(candidate):
                names += [f.name for f in dataclasses.fields(candidate)]
    return names


@pytest.mark.parametrize(
    "owner", ["ChangelogKeyedStateBackend", "LocalJob", "OperatorSpec", "PeriodicMaterializer", "Spark operator"]
)
def test_every_keyword_option_is_in_the_configuration_reference(owner: str) -> None:
    missing = _missing(_option_names(_entry_points()[owner]))
    assert not missing, f"README's configuration reference lacks {owner} option(s): {missing}"


def test_quick_start_has_exactly_the_two_commands_and_ci_runs_the_second() -> None:
    quick = _section("Quick start")
    blocks = re.findall(r"^```bash\n(.*?)^```", quick, re.M | re.S)
    assert len(blocks) == 1, "the quick start has one bash block"
    commands = [line for line in blocks[0].splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert len(commands) == 2, commands
    demo, suite = commands
    assert "pip install" in demo and "backend.spark.demo" in demo
    assert "pip install" in suite and "-m pytest" in suite
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    ci_commands = [line for line in ci.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert suite in ci_commands, f".ci/run must run exactly the README's second command: {suite!r}"


def test_no_prose_line_is_longer_than_200_characters() -> None:
    inside = False
    long_lines = []
    for number, line in enumerate(README.splitlines(), start=1):
        if line.startswith("```"):
            inside = not inside
            continue
        if not inside and len(line) > 200:
            long_lines.append(f"line {number}: {len(line)} characters")
    assert not long_lines, long_lines


def test_docs_linked_from_the_readme_exist() -> None:
    for target in re.findall(r"\]\((docs/[^)]+)\)", README):
        assert (ROOT / target).is_file(), f"README links to {target}, which does not exist"
