"""Object stores behind one async ``Uploader`` protocol: aiobotocore for ``s3://``, fsspec otherwise.

All paths given to an uploader are relative to the storage's base path; ``resolve`` rejects
anything that would escape it (``..``, absolute paths), because handles come from storage and a
crafted handle must not make us read or delete foreign files.

Cancellation matters for hedging: a cancelled attempt may still have written its object. The
S3 uploader's request is simply abandoned (the caller then deletes the key). The fsspec uploader
runs blocking calls in a thread that cannot be interrupted, so on cancellation it first waits for
the thread to finish: when the caller deletes the loser's object, the object is really there to
delete and cannot reappear afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import os
import posixpath
import uuid
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Any, Protocol, TypeVar

import fsspec

from dstl.config import ChangelogConfig, S3Options

T = TypeVar("T")


def _user_agent() -> str:
    """Our name and version, for the store's access logs. botocore's own app id setting
    (``AWS_SDK_UA_APP_ID``) is not included in a fixed User-Agent; ``user_agent_extra`` is."""
    try:
        return f"dstl-state-backend/{importlib.metadata.version('dstl-state-backend')}"
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
        return "dstl-state-backend/dev"


#: the User-Agent of S3 requests (see ``S3Uploader._open``)
USER_AGENT = _user_agent()


class Uploader(Protocol):
    """What the log needs from a file system. Every method may raise ``OSError``-like errors."""

    async def put(self, path: str, data: bytes) -> None: ...
    async def get(self, path: str, offset: int = 0, length: int | None = None) -> bytes: ...
    async def delete(self, path: str) -> None: ...  # a missing object is not an error
    async def list(self, prefix: str = "") -> list[str]: ...
    async def close(self) -> None: ...


def check_relative(path: str) -> str:
    """Normalize a storage-relative path, refusing anything that leaves the base directory."""
    if not path or path.startswith("/") or "\\" in path or "://" in path:
        raise ValueError(f"path {path!r} is not relative to the changelog base path")
    norm = posixpath.normpath(path)
    if norm == ".." or norm.startswith("../") or norm == ".":
        raise ValueError(f"path {path!r} points outside the changelog base path")
    return norm


def new_file_name(prefix_count: int) -> str:
    """``dstl/<prefix>/<uuid>``: random names spread over many prefixes (S3 partitions by prefix;
    Flink users hit "too many files in one directory")."""
    ident = uuid.uuid4()
    return f"dstl/{ident.int % prefix_count:02x}/{ident.hex}"


async def _finish_even_if_cancelled(fut: asyncio.Future[T]) -> T:
    """Await a thread's future; if we are cancelled, let the thread finish before re-raising."""
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        with contextlib.suppress(BaseException):
            await fut
        raise


class FsspecUploader:
    """Any fsspec file system; blocking calls run in the default thread pool.

    Local files (``file://`` or plain paths) are written to a temporary name, fsynced and renamed,
    so a crash never leaves a partial file under a final name.
    """

    def __init__(self, base_path: str) -> None:
        self._fs, root = fsspec.core.url_to_fs(base_path)
        self._root = root.rstrip("/")
        self._local = "file" in _protocols(self._fs)

    def _full(self, path: str) -> str:
        return f"{self._root}/{check_relative(path)}"

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await _finish_even_if_cancelled(loop.run_in_executor(None, fn, *args))

    def _put_sync(self, full: str, data: bytes) -> None:
        if self._local:
            directory = os.path.dirname(full)
            os.makedirs(directory, exist_ok=True)
            tmp = f"{full}.tmp-{uuid.uuid4().hex[:8]}"
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, full)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        else:
            self._fs.pipe_file(full, data)

    async def put(self, path: str, data: bytes) -> None:
        await self._run(self._put_sync, self._full(path), data)

    def _get_sync(self, full: str, offset: int, length: int | None) -> bytes:
        end = None if length is None else offset + length
        data: bytes = self._fs.cat_file(full, start=offset or None, end=end)
        return data

    async def get(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        return await self._run(self._get_sync, self._full(path), offset, length)

    def _delete_sync(self, full: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._fs.rm_file(full)

    async def delete(self, path: str) -> None:
        await self._run(self._delete_sync, self._full(path))

    def _list_sync(self, prefix: str) -> list[str]:
        base = f"{self._root}/{prefix}".rstrip("/") if prefix else self._root
        if not self._fs.exists(base):
            return []
        names = self._fs.find(base)
        offset = len(self._root) + 1
        return sorted(n[offset:] if n.startswith(self._root) else n for n in names)

    async def list(self, prefix: str = "") -> list[str]:
        return await self._run(self._list_sync, prefix)

    def remove_empty_directory(self, path: str) -> None:
        if self._local:
            with contextlib.suppress(OSError):
                os.rmdir(self._full(path))

    async def close(self) -> None:
        return None


def _protocols(fs: Any) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)


class S3Uploader:
    """S3 (or any S3-compatible store) through aiobotocore, natively async."""

    def __init__(self, base_path: str, options: S3Options) -> None:
        without_scheme = base_path[len("s3://") :]
        bucket, _, prefix = without_scheme.partition("/")
        if not bucket:
            raise ValueError(f"s3 base path {base_path!r} names no bucket")
        self.bucket = bucket
        self._prefix = prefix.strip("/")
        self._options = options
        self._client: Any = None
        self._stack = AsyncExitStack()
        self._lock = asyncio.Lock()

    async def _get_client(self) -> Any:
        if self._client is None:
            async with self._lock:
                if self._client is None:
                    self._client = await self._open()
        return self._client

    async def _open(self) -> Any:
        from aiobotocore.config import AioConfig
        from aiobotocore.session import get_session

        opts = self._options
        # AioConfig adds a default keepalive_timeout, which aiohttp rejects together with
        # force_close ("keepalive_timeout cannot be set if force_close is True"): clear it.
        connector: dict[str, Any] = {"force_close": True, "keepalive_timeout": None} if opts.force_close else {}
        config = AioConfig(
            max_pool_connections=opts.max_pool_connections,
            connector_args=connector or None,
            # Retries and timeouts are ours (per attempt, with hedging); botocore must not add its own.
            # botocore's "max_attempts" counts retries (total = max_attempts + 1); "total_max_attempts"
            # includes the first request, so 1 means no botocore retry at all.
            retries={"total_max_attempts": 1, "mode": "standard"},
            connect_timeout=opts.connect_timeout_s,
            read_timeout=opts.read_timeout_s,
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            # Every call is built here (bucket, key, bytes); checking it again costs client CPU
            # that a hedged upload pays twice.
            parameter_validation=False,
            # A fixed User-Agent: botocore otherwise rebuilds its structured one (sdk, os, python,
            # features, config) for every request, 5-9 % of the client's CPU per PUT (py-spy).
            # It also names this library in the store's access logs.
            user_agent=USER_AGENT,
        )
        session = get_session()
        client = await self._stack.enter_async_context(
            session.create_client(
                "s3",
                endpoint_url=opts.endpoint_url or os.environ.get("AWS_ENDPOINT_URL"),
                region_name=opts.region or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
                aws_access_key_id=opts.access_key_id,
                aws_secret_access_key=opts.secret_access_key,
                aws_session_token=opts.session_token,
                config=config,
            )
        )
        if not opts.expect_continue:
            # botocore adds the header in a "before-call.s3" handler; this one runs after it.
            client.meta.events.register_last("before-call.s3", _drop_expect_continue)
        return client

    def _key(self, path: str) -> str:
        rel = check_relative(path)
        return f"{self._prefix}/{rel}" if self._prefix else rel

    async def put(self, path: str, data: bytes) -> None:
        client = await self._get_client()
        await client.put_object(Bucket=self.bucket, Key=self._key(path), Body=data)

    async def get(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        client = await self._get_client()
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": self._key(path)}
        if offset or length is not None:
            end = "" if length is None else str(offset + length - 1)
            kwargs["Range"] = f"bytes={offset}-{end}"
        try:
            response = await client.get_object(**kwargs)
        except client.exceptions.NoSuchKey:
            raise FileNotFoundError(f"s3://{self.bucket}/{kwargs['Key']}") from None
        async with response["Body"] as body:
            data: bytes = await body.read()
        return data

    async def delete(self, path: str) -> None:
        client = await self._get_client()
        await client.delete_object(Bucket=self.bucket, Key=self._key(path))

    async def list(self, prefix: str = "") -> list[str]:
        client = await self._get_client()
        full = self._key(prefix) if prefix else self._prefix
        if full:
            full += "/"
        names: list[str] = []
        paginator = client.get_paginator("list_objects_v2")
        async for page in paginator.paginate(Bucket=self.bucket, Prefix=full):
            for obj in page.get("Contents", []):
                key: str = obj["Key"]
                names.append(key[len(self._prefix) + 1 :] if self._prefix else key)
        return sorted(names)

    async def close(self) -> None:
        await self._stack.aclose()
        self._client = None


def _drop_expect_continue(params: dict[str, Any], **_: Any) -> None:
    params["headers"].pop("Expect", None)


def make_uploader(config: ChangelogConfig) -> Uploader:
    """Pick the implementation by URL scheme."""
    if config.base_path.startswith("s3://"):
        return S3Uploader(config.base_path, config.s3)
    return FsspecUploader(config.base_path)
