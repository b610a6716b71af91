"""File systems behind one ``Uploader`` protocol, chosen by the base path's URL scheme.

The shape of fsspec's registry: one protocol (``base.Uploader``), one small module per
implementation (``s3`` through aiobotocore, ``fsspec`` for every other scheme and local
directories), and ``make_uploader`` mapping a scheme to its implementation. A scheme without an
entry of its own goes to fsspec, which knows many (``file://``, ``memory://``, ``gs://``, ...).
"""

from __future__ import annotations

from collections.abc import Callable

from dstl.config import ChangelogConfig
from dstl.uploaders.base import USER_AGENT, Uploader
from dstl.uploaders.fsspec import FsspecUploader
from dstl.uploaders.s3 import S3Uploader

__all__ = ["USER_AGENT", "FsspecUploader", "S3Uploader", "Uploader", "make_uploader"]

#: schemes with an implementation of their own; any other goes to fsspec
_BY_SCHEME: dict[str, Callable[[ChangelogConfig], Uploader]] = {
    "s3": lambda config: S3Uploader(config.base_path, config.s3),
}


def make_uploader(config: ChangelogConfig) -> Uploader:
    """The uploader of ``config.base_path``: by its URL scheme, fsspec for the rest and plain paths."""
    scheme, sep, _ = config.base_path.partition("://")
    factory = _BY_SCHEME.get(scheme) if sep else None
    return factory(config) if factory is not None else FsspecUploader(config.base_path)
