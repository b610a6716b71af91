"""The error of the command line tools, under the project's one hierarchy (``dstl.errors``).

The ``dstl`` command (``backend.tools.cli``) reports any ``ChangelogError`` as ``dstl: error:
<message>``; ``CliError`` is the tools' own (a path that is not a checkpoint, an unknown state),
with the exit code to use.
"""

from __future__ import annotations

from dstl.errors import ChangelogError

__all__ = ["CliError"]


class CliError(ChangelogError):
    """An error the command line reports as ``dstl: error: <message>`` with exit code ``code``."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code
