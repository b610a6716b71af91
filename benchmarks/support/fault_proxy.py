"""An HTTP/1.1 proxy in front of an S3 server (moto) that applies a ``FaultPlan`` per request.

The same rules as ``faulty_fs``, for S3: each request is classified (PUT/POST -> "put", GET of a
key -> "get", list-objects -> "list", DELETE or multi-object delete -> "delete", HEAD -> "exists")
and named by its key relative to ``base`` ("bucket/prefix"; a list request by its prefix, without
the trailing slash). Requests outside ``base`` pass untouched and unlogged; without a ``base``,
rules match the full "bucket/key". Per action: ``fail`` answers a 503 SlowDown (what S3 sends
under load), ``reset`` closes with an RST, ``stall`` holds the request until ``plan.release()``
(then forwards it, unless the client has gone: a stalled request whose client gave up is dropped;
"late" is the action for writes that land anyway), ``delay`` forwards after ``delay_s``,
``trickle`` forwards with the request body (put) or response body (get) paced at
``bytes_per_s``, ``truncate`` answers a get with the first half of the body, framed as if whole
(a misbehaving proxy: the client sees no error), ``late`` keeps the request, answers nothing, and
sends it to the server when ``plan.land_late()`` is called.

Why it is shaped so: it speaks HTTP rather than relaying TCP so that it can act per request on
keep-alive connections (aiobotocore pools them). Each forwarded request is a fresh upstream
connection and each answer is re-framed with a Content-Length, so upstream framing (chunked,
close-delimited) never leaks to the client. It runs on its own event loop in a daemon thread,
because the storage under test runs its HTTP client on its own loop; stalls wait in a small
thread pool on the plan's gate, which ``release()``/``close()`` end.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import http.client
import socket
import struct
import threading
import urllib.parse
from dataclasses import dataclass
from typing import Any

from benchmarks.support.fault_plan import Fault, FaultPlan, StallEnded

__all__ = ["FaultProxy"]

_WAIT_S = 30.0
_TRICKLE_STEP_S = 0.05
_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "upgrade",
    "trailer",
    "expect",
}
_SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate. (injected fault)</Message></Error>"
)


@dataclass
class _Request:
    method: str
    target: str
    version: str
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        name = name.lower()
        return next((v for k, v in self.headers if k.lower() == name), None)

    def keep_alive(self) -> bool:
        conn = (self.header("connection") or "").lower()
        return conn != "close" if self.version == "HTTP/1.1" else conn == "keep-alive"


async def _read_head(reader: asyncio.StreamReader) -> tuple[str, list[tuple[str, str]]] | None:
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    first, *lines = raw.decode("latin-1").split("\r\n")
    headers = [(k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in lines if line)]
    return first, headers


async def _read_body(reader: asyncio.StreamReader, headers: list[tuple[str, str]], until_eof: bool) -> bytes:
    lower = {k.lower(): v for k, v in headers}
    if "chunked" in lower.get("transfer-encoding", "").lower():
        parts: list[bytes] = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers
                    pass
                return b"".join(parts)
            parts.append(await reader.readexactly(size))
            await reader.readexactly(2)
    if "content-length" in lower:
        return await reader.readexactly(int(lower["content-length"]))
    return await reader.read() if until_eof else b""


def _classify(req: _Request, base: str | None) -> tuple[str, str] | None:
    """``(op, path relative to base)``, or ``None`` for a request outside the base."""
    parsed = urllib.parse.urlsplit(req.target)
    query = urllib.parse.parse_qs(parsed.query, keep_blank_values=True)
    full = urllib.parse.unquote(parsed.path).lstrip("/")
    host = (req.header("host") or "").split(":")[0]
    if host and not host.replace(".", "").isdigit() and host != "localhost" and "." in host:
        full = f"{host.split('.')[0]}/{full}"  # virtual-hosted style: the bucket is in the host
    bucket, _, key = full.partition("/")
    if req.method == "GET" and not key:
        op, name = "list", f"{bucket}/{query.get('prefix', [''])[0]}".rstrip("/")
    elif req.method == "POST" and "delete" in query:
        op, name = "delete", full.rstrip("/")
    else:
        op = {"PUT": "put", "POST": "put", "GET": "get", "DELETE": "delete", "HEAD": "exists"}.get(req.method, "other")
        name = full
    if base is None:
        return op, name
    root = base.strip("/")
    if name == root:
        return op, ""
    if name.startswith(root + "/"):
        return op, name[len(root) + 1 :]
    return None


def _head(status: int, reason: str, headers: list[tuple[str, str]], length: int | str, keep_alive: bool) -> bytes:
    """A response head re-framed for the client: our Content-Length and Connection."""
    lines = [f"HTTP/1.1 {status} {reason}"]
    lines += [f"{k}: {v}" for k, v in headers if k.lower() not in _HOP_BY_HOP and k.lower() != "content-length"]
    lines += [f"Content-Length: {length}", f"Connection: {'keep-alive' if keep_alive else 'close'}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _abort_with_rst(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class FaultProxy:
    """The proxy, started on construction; ``url`` is its endpoint. Use as a context manager."""

    def __init__(self, upstream_url: str, plan: FaultPlan, base: str | None = None) -> None:
        parsed = urllib.parse.urlsplit(upstream_url)
        self._upstream = (parsed.hostname or "127.0.0.1", parsed.port or 80)
        self.plan = plan
        self.base = base
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="fault-proxy-stall")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)
        self._thread.start()
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server = self._call(self._start())
        self.port: int = self._server.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(_WAIT_S)

    async def _start(self) -> asyncio.Server:
        return await asyncio.start_server(self._serve, "127.0.0.1", 0)

    async def _stop(self) -> None:
        self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        await self._server.wait_closed()

    def close(self) -> None:
        """Stop serving and drop every connection; held "late" requests stay landable."""
        if self._loop.is_closed():
            return
        try:
            self._call(self._stop())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(_WAIT_S)
            self._loop.close()
            self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- per connection --------------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while await self._one_request(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, StallEnded):
            writer.transport.abort()
        finally:
            self._writers.discard(writer)
            if not writer.transport.is_closing():
                writer.close()

    async def _one_request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Serve one request; ``False`` once the connection is done."""
        head = await _read_head(reader)
        if head is None:
            return False
        method, target, version = head[0].split(" ", 2)
        if any(k.lower() == "expect" and v.lower() == "100-continue" for k, v in head[1]):
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # the body is forwarded whole, without Expect
        req = _Request(method, target, version, head[1], await _read_body(reader, head[1], until_eof=False))
        named = _classify(req, self.base)
        fault = self.plan.decide(*named) if named is not None else None
        if fault is None:
            await self._forward(req, writer, None, named)
            return req.keep_alive()
        assert named is not None
        op, path = named
        what = f"{op} {path or '.'}"
        if fault.action == "fail":
            xml = [("Content-Type", "application/xml")]
            writer.write(_head(503, "Slow Down", xml, len(_SLOW_DOWN), req.keep_alive()) + _SLOW_DOWN)
            await writer.drain()
            return req.keep_alive()
        if fault.action == "reset":
            _abort_with_rst(writer)
            return False
        if fault.action == "late":
            self.plan.hold_late(op, path, lambda: self._send_blocking(req))
            await reader.read()  # answer nothing until the client gives up
            return False
        if fault.action == "stall":
            if not await self._stall(reader, what):
                self.plan.record(op, path, "dropped")
                return False
        elif fault.action == "delay":
            await asyncio.sleep(fault.delay_s)
        await self._forward(req, writer, fault, named)
        return req.keep_alive()

    async def _stall(self, reader: asyncio.StreamReader, what: str) -> bool:
        """Wait for ``release()``; ``False`` if the client went away first."""
        released: asyncio.Future[Any] = asyncio.wrap_future(self._pool.submit(self.plan.gate.stall, what))
        gone: asyncio.Future[Any] = asyncio.ensure_future(reader.read(1))
        done, _ = await asyncio.wait({released, gone}, return_when=asyncio.FIRST_COMPLETED)
        if released in done:
            gone.cancel()
            released.result()  # StallEnded when the plan was closed
            return True
        released.add_done_callback(lambda f: f.exception())  # the thread ends on release or close
        return False

    async def _forward(
        self, req: _Request, writer: asyncio.StreamWriter, fault: Fault | None, named: tuple[str, str] | None
    ) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self._upstream)
        try:
            headers = [(k, v) for k, v in req.headers if k.lower() not in _HOP_BY_HOP and k.lower() != "content-length"]
            if req.body or req.method in ("PUT", "POST"):
                headers.append(("Content-Length", str(len(req.body))))
            head = "\r\n".join([f"{req.method} {req.target} HTTP/1.1", *(f"{k}: {v}" for k, v in headers)])
            up_writer.write((head + "\r\nConnection: close\r\n\r\n").encode("latin-1"))
            trickle = fault is not None and fault.action == "trickle"
            await self._send(up_writer, req.body, fault.bytes_per_s if trickle and fault else None)
            status_head = await _read_head(up_reader)
            if status_head is None:
                raise ConnectionResetError("upstream closed without answering")
            _, code, reason = [*status_head[0].split(" ", 2), ""][:3]
            status = int(code)
            no_body = req.method == "HEAD" or status in (204, 304) or 100 <= status < 200
            body = b"" if no_body else await _read_body(up_reader, status_head[1], until_eof=True)
        finally:
            up_writer.transport.abort()
        if fault is None and named is not None:  # logged before the client can see the answer
            self.plan.record(*named, "ok" if status < 400 else f"status:{status}")
        out_headers = status_head[1]
        if fault is not None and fault.action == "truncate" and status < 300:
            body = body[: len(body) // 2]
            digests = ("etag", "content-md5", "x-amz-checksum")  # nothing the client could check the body by
            out_headers = [(k, v) for k, v in out_headers if not k.lower().startswith(digests)]
        if req.method == "HEAD":  # no body, but the object's size, which the client reads
            size = next((v for k, v in out_headers if k.lower() == "content-length"), "0")
            writer.write(_head(status, reason, out_headers, size, req.keep_alive()))
        else:
            writer.write(_head(status, reason, out_headers, len(body), req.keep_alive()))
            pace = fault.bytes_per_s if fault is not None and fault.action == "trickle" else None
            await self._send(writer, body, pace)
        await writer.drain()

    @staticmethod
    async def _send(writer: asyncio.StreamWriter, data: bytes, bytes_per_s: float | None) -> None:
        if bytes_per_s is None:
            writer.write(data)
            await writer.drain()
            return
        step = max(1, int(bytes_per_s * _TRICKLE_STEP_S))
        for i in range(0, len(data), step):
            writer.write(data[i : i + step])
            await writer.drain()
            await asyncio.sleep(min(step, len(data) - i) / bytes_per_s)

    def _send_blocking(self, req: _Request) -> None:
        """Send a held request to the server now (``land_late``), from the caller's thread."""
        conn = http.client.HTTPConnection(*self._upstream, timeout=_WAIT_S)
        try:
            headers = {k: v for k, v in req.headers if k.lower() not in _HOP_BY_HOP and k.lower() != "content-length"}
            conn.request(req.method, req.target, body=req.body, headers=headers)
            response = conn.getresponse()
            response.read()
            if response.status >= 300:
                raise OSError(f"late {req.method} {req.target} landed with HTTP {response.status}")
        finally:
            conn.close()
