"""S3, or any S3-compatible store, as an ``Uploader``: aiobotocore, natively async.

Retries and timeouts belong to the log (per attempt, with hedging, ``dstl.hedging``, and
``dstl.retry`` for the other calls), so the client is configured to make exactly one request
per call. A cancelled request is simply abandoned: the caller deletes the key that attempt may
still have written.

The client is created by ``open``, which the storage awaits when it is created, before it hands
out any writer: creating it is slow, CPU-bound work on the storage's loop thread (importing
aiobotocore, loading and parsing botocore's S3 models: hundreds of milliseconds on a busy
machine), and that thread also applies the in-flight bound to every writer every few milliseconds
(``dstl.storage.throttle``): a client created by the first upload would hold it while operators
append without bound. A call finding no client (``open`` failed) creates it then.

Credentials never reach a log: at DEBUG botocore logs request headers (the session token, the
Authorization header) and signing inputs. A filter on a logger misses records of its children and
a filter on handlers misses handlers added later, so the redaction sits in the log record factory,
which every record of the process passes through (``dstl.uploaders.redact``).
"""

from __future__ import annotations

import asyncio
import os
from contextlib import AsyncExitStack
from typing import Any

from dstl.config import S3Options
from dstl.errors import ConfigurationError
from dstl.paths import check_relative
from dstl.uploaders.base import USER_AGENT
from dstl.uploaders.redact import install_redaction

__all__ = ["S3Uploader"]


class S3Uploader:
    """S3 (or any S3-compatible store) through aiobotocore, natively async."""

    def __init__(self, base_path: str, options: S3Options) -> None:
        without_scheme = base_path[len("s3://") :]
        bucket, _, prefix = without_scheme.partition("/")
        if not bucket:
            raise ConfigurationError(f"base_path {base_path!r} names no S3 bucket")
        self.bucket = bucket
        self._prefix = prefix.strip("/")
        self._options = options
        self._client: Any = None
        self._stack = AsyncExitStack()
        self._lock = asyncio.Lock()

    async def open(self) -> None:
        """Create the client now rather than on the first call (see the module doc)."""
        await self._get_client()

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
            connect_timeout=opts.connect_timeout_ms / 1000,
            read_timeout=opts.read_timeout_ms / 1000,
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            # Every call is built here (bucket, key, bytes); checking it again costs client CPU
            # that a hedged upload pays twice.
            parameter_validation=False,
            # A fixed User-Agent: botocore otherwise rebuilds its structured one (sdk, os, python,
            # features, config) for every request, a measurable share of the client's CPU per PUT.
            # It also names this library in the store's access logs.
            user_agent=USER_AGENT,
        )
        install_redaction(opts.access_key_id, opts.secret_access_key, opts.session_token)
        session = get_session()
        # Credentials the chain resolves (environment, profile): known only once resolved. With
        # explicit keys the client never asks the chain, and neither do we (it may go to the network).
        credentials = await session.get_credentials() if opts.access_key_id is None else None
        if credentials is not None:
            frozen = await credentials.get_frozen_credentials()
            install_redaction(frozen.access_key, frozen.secret_key, frozen.token)
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
        except client.exceptions.ClientError as exc:
            if exc.response.get("Error", {}).get("Code") == "InvalidRange":
                return b""  # a range past the object's end reads nothing, as from a file (a caller checks lengths)
            raise
        async with response["Body"] as body:
            data: bytes = await body.read()
        return data

    async def delete(self, path: str) -> None:
        client = await self._get_client()
        await client.delete_object(Bucket=self.bucket, Key=self._key(path))

    def remove_empty_directory(self, path: str) -> bool:
        """Always True: an object store has no directories (a prefix is gone with its last key)."""
        return True

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
