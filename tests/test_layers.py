"""The layer contract of pyproject.toml ([tool.importlinter]) holds: imports point one way, no cycles.

A test rather than only a lint step so that the README's test command (what CI runs) enforces it.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept() -> None:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert exe, "lint-imports not installed (the test extra installs import-linter)"
    done = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "BROKEN" not in done.stdout


#: the packages that see the DFS through ``dstl.api.DfsFiles`` only (docs/architecture.md, "The two
#: interfaces"); import-linter checks modules, not names, so the name is checked here
FILES_ONLY = ("materializer", "backend/checkpointing")
#: where one of them may still name ``ChangelogStorage``, and why: (file, module-level function)
STORAGE_ALLOWED = {
    # a restore replays logs, which only the storage reads back (``ChangelogStorage.read``)
    ("materializer/periodic.py", "restore"),
}
IMPORT = "<import>"


def _storage_mentions(path: Path) -> list[tuple[int, str | None]]:
    """Each use of the name ``ChangelogStorage`` in ``path``: (line, the module-level function it
    is in, ``IMPORT`` for an import, None elsewhere)."""
    tree = ast.parse(path.read_text(), str(path))
    found: list[tuple[int, str | None]] = []
    for top in tree.body:
        where = top.name if isinstance(top, ast.FunctionDef | ast.AsyncFunctionDef) else None
        for node in ast.walk(top):
            if isinstance(node, ast.alias) and node.name.rsplit(".", 1)[-1] == "ChangelogStorage":
                found.append((top.lineno, IMPORT))
            elif (isinstance(node, ast.Name) and node.id == "ChangelogStorage") or (
                isinstance(node, ast.Attribute) and node.attr == "ChangelogStorage"
            ):
                found.append((node.lineno, where))
    return found


def test_checkpointing_and_the_materializer_take_files_not_the_storage() -> None:
    """They read and write files (``DfsFiles``); a ``ChangelogStorage`` creeping back in would hand
    them the writer factory and the log reader (issue 26)."""
    allowed_files = {file for file, _ in STORAGE_ALLOWED}
    offending = []
    for package in FILES_ONLY:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for line, where in _storage_mentions(path):
                if (rel, where) in STORAGE_ALLOWED or (where == IMPORT and rel in allowed_files):
                    continue
                offending.append(f"{rel}:{line}")
    assert not offending, (
        f"ChangelogStorage named in {', '.join(offending)}: {' and '.join(FILES_ONLY)} take a "
        "dstl.api.DfsFiles (storage.files) instead (docs/architecture.md, 'The two interfaces')"
    )
