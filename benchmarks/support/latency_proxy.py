"""Loopback TCP proxy that injects latency and faults per accepted connection.

Why this exists: moto's S3 server answers in well under a millisecond, so tests and benchmarks against it
say nothing about how the DSTL behaves against a real object store, where a PUT takes hundreds of
milliseconds and occasionally hangs or is reset. This proxy sits between the HTTP client and the server
and, for every accepted TCP connection, either forwards it after a sampled delay (``PASS``), swallows it
(``STALL``) or kills it with an RST (``RESET``).

The client is expected to use one TCP connection per request (aiohttp ``force_close``), so "per
connection" means "per request attempt": a retried request is a new connection, gets a freshly sampled
delay and the next scripted behaviour. That is what makes retry/timeout logic testable deterministically.

Only the standard library is needed, so the proxy can also run as ``python -m benchmarks.support.latency_proxy`` in a
separate process (see :func:`run_in_subprocess`), keeping its event loop off the client's GIL; there it
runs on uvloop when that is installed.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import collections
import contextlib
import enum
import itertools
import math
import random
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Behavior", "LatencyProfile", "LatencyProxy", "run_in_subprocess"]

_CHUNK = 64 * 1024


class Behavior(enum.Enum):
    """What the proxy does with one accepted connection."""

    #: Forward both directions to the upstream server after the sampled delay (by default the
    #: request waits; with ``delay_response`` the answer does).
    PASS = "pass"
    #: Accept and read, but never forward or answer: models a request that hangs (client timeout path).
    STALL = "stall"
    #: Accept and immediately close with an RST: models a connection reset by the store / a middlebox.
    RESET = "reset"


@dataclass
class LatencyProfile:
    """Latency distribution given as a piecewise log-linear inverse CDF.

    ``points`` are ``(quantile, milliseconds)`` pairs. Between neighbouring points ``log(ms)`` is
    interpolated linearly in the quantile. Log-space interpolation is used because latency
    distributions are heavy-tailed: linear interpolation between p99 and p99.9 would put far too much
    mass near the upper point, log-linear keeps the shape roughly exponential between the anchors.

    Quantiles must start at 0.0 and end at 1.0 (so every ``u`` in ``[0, 1)`` has a segment and the
    distribution is bounded), be strictly increasing (no zero-width segments) and the milliseconds
    must be positive (log) and non-decreasing (an inverse CDF is monotone).
    """

    points: list[tuple[float, float]]
    _qs: list[float] = field(init=False, repr=False, compare=False)
    _log_ms: list[float] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        pts = [(float(q), float(ms)) for q, ms in self.points]
        if len(pts) < 2:
            raise ValueError("a latency profile needs at least the 0.0 and 1.0 quantile points")
        if pts[0][0] != 0.0 or pts[-1][0] != 1.0:
            raise ValueError(f"quantiles must start at 0.0 and end at 1.0, got {pts[0][0]}..{pts[-1][0]}")
        for q, ms in pts:
            if not math.isfinite(q) or not math.isfinite(ms):
                raise ValueError(f"non-finite point ({q}, {ms})")
            if ms <= 0.0:
                raise ValueError(f"milliseconds must be positive for log interpolation, got {ms} at q={q}")
        for (q0, ms0), (q1, ms1) in itertools.pairwise(pts):
            if not q1 > q0:
                raise ValueError(f"quantiles must be strictly increasing, got {q0} then {q1}")
            if ms1 < ms0:
                raise ValueError(f"milliseconds must be non-decreasing, got {ms0} at q={q0} then {ms1} at q={q1}")
        self.points = pts
        self._qs = [q for q, _ in pts]
        self._log_ms = [math.log(ms) for _, ms in pts]

    def quantile(self, q: float) -> float:
        """Latency in seconds at quantile ``q`` (same interpolation as :meth:`sample`, for reporting)."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile must be in [0, 1], got {q}")
        # Segment i spans qs[i]..qs[i+1]; q == 1.0 falls into the last segment.
        i = min(bisect.bisect_right(self._qs, q) - 1, len(self._qs) - 2)
        q0, q1 = self._qs[i], self._qs[i + 1]
        t = (q - q0) / (q1 - q0)
        log_ms = self._log_ms[i] + t * (self._log_ms[i + 1] - self._log_ms[i])
        return math.exp(log_ms) / 1000.0

    def sample(self, rng: random.Random) -> float:
        """Draw one latency in seconds by inverse-transform sampling with ``u = rng.random()``."""
        return self.quantile(rng.random())

    @classmethod
    def constant(cls, ms: float) -> LatencyProfile:
        """Every draw ``ms`` milliseconds (what an attempt costs besides the draw is then the rest)."""
        return cls([(0.0, ms), (1.0, ms)])

    @classmethod
    def flip158(cls, scale: float = 0.1) -> LatencyProfile:
        """S3 latency for 5 MB objects as measured in FLIP-158 (Flink generalized incremental checkpoints).

        Measured: p50 459, p90 740, p95 833, p99 1039, p99.9 3202 ms. The two ends are OUR ASSUMPTION,
        not measurements: p0 = 0.5 * p50 (nothing is faster than half the median) and
        p100 = 2 * p99.9 (the tail is bounded at twice p99.9). Every value is multiplied by ``scale``
        so that test suites and benchmarks can run the same shape faster (default: 10x faster).
        """
        if not scale > 0.0:
            raise ValueError(f"scale must be positive, got {scale}")
        p50, p999 = 459.0, 3202.0
        measured = [(0.5, p50), (0.9, 740.0), (0.95, 833.0), (0.99, 1039.0), (0.999, p999)]
        pts = [(0.0, 0.5 * p50), *measured, (1.0, 2.0 * p999)]
        return cls([(q, ms * scale) for q, ms in pts])


class LatencyProxy:
    """Asyncio TCP proxy injecting a per-connection delay or fault in front of ``upstream``.

    Per accepted connection, in accept order: the delay is sampled once from ``profile`` (always, even
    for STALL/RESET, so that connection *k* gets the same delay for a given seed whatever was scripted
    before it) and the behaviour is popped from :attr:`scripted` (or :attr:`default_behavior` when it is
    empty). For PASS the delay is slept before the upstream connection is opened, i.e. before the first
    byte of the client's data is forwarded, so the whole exchange is shifted by the delay.

    With ``delay_response`` the request is forwarded at once and the delay is the least time from
    accepting the connection to the first byte of the answer, or to its EOF if the upstream closes
    without one: the upstream's own processing then overlaps the delay instead of adding to it.
    That is the faithful model of a *measured* store latency such as FLIP-158's, which already
    includes the store's processing; in front of moto, which spends milliseconds of Python per PUT
    (plus the proxy's upstream connect), the default mode adds that to every draw. A request that
    was sent whole before its client gave up still reaches the upstream, as a slow PUT to a real
    store may complete after its client stopped waiting. Not held: an upstream that cannot be
    reached or resets (the client is reset at once), and nothing after the first bytes, so an
    interim answer such as ``100 Continue`` would release the hold (our S3 client sends no
    ``Expect``).
    """

    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        *,
        profile: LatencyProfile | None = None,
        seed: int = 0,
        host: str = "127.0.0.1",
        port: int = 0,
        delay_response: bool = False,
    ) -> None:
        self.upstream_host = upstream_host
        self.delay_response = delay_response
        self.upstream_port = upstream_port
        self.profile = profile
        self.host = host
        #: The requested port before :meth:`start`, the actually bound port after it.
        self.port = port
        #: Behaviours for the next accepted connections, popped from the left one per connection.
        self.scripted: collections.deque[Behavior] = collections.deque()
        #: Behaviour used once :attr:`scripted` is exhausted.
        self.default_behavior: Behavior = Behavior.PASS
        self.accepted = 0
        #: Every byte clients sent upstream, when set to a bytearray (tests that check the wire).
        self.client_bytes: bytearray | None = None
        self.stalled = 0
        self.resets = 0
        self._rng = random.Random(seed)
        self._server: asyncio.Server | None = None
        self._accepted_changed = asyncio.Condition()
        # Everything open, so stop() can tear down stalled and in-flight connections, not just the listener.
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        """Base URL for an HTTP client (e.g. an S3 ``endpoint_url``)."""
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        """Start listening; afterwards :attr:`port` is the bound port."""
        if self._server is not None:
            raise RuntimeError("proxy already started")
        self._server = await asyncio.start_server(self._on_connect, self.host, self.port)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        """Stop listening and close every open connection, including stalled and sleeping ones."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # Only after the connections are gone: on Python >= 3.12 wait_closed() waits for them.
        await server.wait_closed()

    async def __aenter__(self) -> LatencyProxy:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def wait_for_accepted(self, n: int) -> None:
        """Resolve once at least ``n`` connections have been accepted (event driven, no polling)."""
        async with self._accepted_changed:
            await self._accepted_changed.wait_for(lambda: self.accepted >= n)

    # -- connection handling -------------------------------------------------------------------------

    def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A plain callback, not a coroutine: asyncio.streams then does not wrap it in a task of its own.
        # We own (and on stop() cancel) the task; cancelling the streams-made task trips a bug in the
        # done-callback of Python 3.11's StreamReaderProtocol (task.exception() on a cancelled task).
        # Sampling, popping and all counting happen here, synchronously in accept order, so connection k
        # always gets the k-th delay and the k-th scripted behaviour.
        if self._server is None:  # accepted in the same loop iteration as stop(): nothing may outlive it
            writer.transport.abort()
            return
        delay = self.profile.sample(self._rng) if self.profile is not None else 0.0
        behavior = self.scripted.popleft() if self.scripted else self.default_behavior
        self.accepted += 1
        if behavior is Behavior.STALL:
            self.stalled += 1
        elif behavior is Behavior.RESET:
            self.resets += 1
        self._writers.add(writer)
        # The hold of delay_response counts from the accept, on the monotonic clock: uvloop's loop
        # time and timers have a resolution of 1 ms, which would let a hold end early.
        answer_not_before = time.monotonic() + delay if self.delay_response else None
        task = asyncio.get_running_loop().create_task(self._handle(reader, writer, behavior, delay, answer_not_before))
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            task.get_loop().call_exception_handler(
                {"message": "latency proxy connection handler failed", "exception": exc, "task": task}
            )

    async def _handle(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        behavior: Behavior,
        delay: float,
        answer_not_before: float | None,
    ) -> None:
        try:
            async with self._accepted_changed:
                self._accepted_changed.notify_all()
            if behavior is Behavior.RESET:
                _reset(writer)
            elif behavior is Behavior.STALL:
                await _drain_until_eof(reader)
            else:
                await self._pass(reader, writer, delay, answer_not_before)
        finally:
            self._writers.discard(writer)
            await _close(writer)

    async def _pass(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        delay: float,
        answer_not_before: float | None,
    ) -> None:
        if answer_not_before is None and delay > 0.0:
            await asyncio.sleep(delay)
        try:
            up_reader, up_writer = await asyncio.open_connection(self.upstream_host, self.upstream_port)
        except OSError:
            # Upstream down: the client sees a reset, like a load balancer with no healthy backend.
            _reset(writer)
            return
        self._writers.add(up_writer)
        try:
            pumps = [
                asyncio.ensure_future(_pump(reader, up_writer, self.client_bytes)),
                asyncio.ensure_future(_pump(up_reader, writer, not_before=answer_not_before)),
            ]
            try:
                # Both directions end on EOF (propagated as a half-close); an error in either aborts both.
                done, _ = await asyncio.wait(pumps, return_when=asyncio.FIRST_EXCEPTION)
                if any(not t.cancelled() and t.exception() is not None for t in done):
                    writer.transport.abort()
                    up_writer.transport.abort()
            finally:
                for t in pumps:
                    t.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)
        finally:
            self._writers.discard(up_writer)
            await _close(up_writer)


async def _pump(
    src: asyncio.StreamReader,
    dst: asyncio.StreamWriter,
    record: bytearray | None = None,
    *,
    not_before: float | None = None,
) -> None:
    """Copy ``src`` to ``dst`` until EOF, then half-close ``dst`` so the peer sees the EOF too;
    nothing (not even the EOF) reaches ``dst`` before ``time.monotonic()`` reaches ``not_before``."""
    while True:
        data = await src.read(_CHUNK)
        if not_before is not None:
            # A loop: a timer may fire up to its loop's resolution early (1 ms on uvloop).
            while (remaining := not_before - time.monotonic()) > 0.0:
                await asyncio.sleep(remaining)
            not_before = None
        if not data:
            break
        if record is not None:
            record += data
        dst.write(data)
        await dst.drain()
    if dst.can_write_eof() and not dst.is_closing():
        dst.write_eof()


async def _drain_until_eof(reader: asyncio.StreamReader) -> None:
    """Read and discard until the client closes (or the transport is aborted by stop())."""
    with contextlib.suppress(OSError):
        while await reader.read(_CHUNK):
            pass


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with an RST: SO_LINGER (on, 0 s) makes close() abortive instead of a FIN handshake."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


# -- separate-process runner -------------------------------------------------------------------------

_PROJECT_ROOT = Path(__file__).resolve().parent.parent


def run_in_subprocess(
    upstream_port: int,
    *,
    scale: float = 0.1,
    seed: int = 0,
    delay_response: bool = False,
    constant_ms: float | None = None,
    startup_timeout: float = 30.0,
) -> tuple[subprocess.Popen[str], int]:
    """Run a PASS proxy with the FLIP-158 profile (or a ``constant_ms`` delay) in a child process;
    return ``(process, port)``. ``delay_response`` as in :class:`LatencyProxy`.

    A separate process keeps the proxy's event loop (and its byte copying) from competing with the
    benchmarked client for the GIL, which would otherwise distort the latencies being measured.
    Blocks (at most ``startup_timeout`` seconds) until the child reports ``PORT <n>``; the child's
    stdout pipe is closed right after, so the returned process holds no open pipe that could leak.
    The caller owns the process: ``terminate()`` and ``wait()`` it when done (SIGTERM stops it cleanly).
    """
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.support.latency_proxy",
        "--upstream-port",
        str(upstream_port),
        "--scale",
        repr(scale),
        "--seed",
        str(seed),
        *(["--delay-response"] if delay_response else []),
        *(["--constant-ms", repr(constant_ms)] if constant_ms is not None else []),
    ]
    proc = subprocess.Popen(cmd, cwd=_PROJECT_ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    with proc.stdout:
        ready, _, _ = select.select([proc.stdout], [], [], startup_timeout)
        line = proc.stdout.readline() if ready else ""
    parts = line.split()
    if len(parts) != 2 or parts[0] != "PORT" or not parts[1].isdigit():
        proc.kill()
        proc.wait()
        raise RuntimeError(f"latency proxy did not start (exit code {proc.returncode}, first line {line!r})")
    return proc, int(parts[1])


async def _serve(args: argparse.Namespace) -> None:
    proxy = LatencyProxy(
        args.upstream_host,
        args.upstream_port,
        profile=(
            LatencyProfile.constant(args.constant_ms)
            if args.constant_ms is not None
            else LatencyProfile.flip158(args.scale)
        ),
        seed=args.seed,
        host=args.host,
        port=args.port,
        delay_response=args.delay_response,
    )
    await proxy.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"PORT {proxy.port}", flush=True)
    try:
        await stop.wait()
    finally:
        await proxy.stop()


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m benchmarks.support.latency_proxy``: a PASS proxy (FLIP-158 profile by default)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--upstream-port", type=int, required=True)
    parser.add_argument("--upstream-host", default="127.0.0.1")
    parser.add_argument("--scale", type=float, default=0.1, help="multiplier on the FLIP-158 latencies")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--delay-response", action="store_true", help="forward at once, hold the answer")
    parser.add_argument("--constant-ms", type=float, default=None, help="a fixed delay instead of FLIP-158")
    args = parser.parse_args(argv)
    try:
        # libuv's loop forwards with less delay beyond the hold than asyncio's (docs/benchmarks.md).
        import uvloop
    except ImportError:
        asyncio.run(_serve(args))
    else:
        uvloop.run(_serve(args))


if __name__ == "__main__":
    main()
