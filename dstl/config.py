"""Configuration of the changelog storage, with Flink's defaults and option names.

Every field maps to the Flink option named in its comment where Flink has one, so that users
who tuned Flink's DSTL can carry their settings over. Differences from Flink, and why:

- ``compression_level``: Flink compresses with snappy and off by default; we always compress each
  segment with zstd at a fast level: uploads are smaller and a reader can seek to one segment
  instead of decompressing from the file start.
- ``hedging``: Flink hedges implicitly (a timed-out attempt is retried but not cancelled). We
  hedge explicitly at an adaptive latency percentile, cancel the loser, delete its object and cap
  hedges with a budget (see ``dstl.hedging``).

Times are in milliseconds (``*_ms``), as in Flink's and Spark's options; they become seconds only
where asyncio and botocore take them, once per storage. A value out of range raises
``ConfigurationError`` (a ``ValueError``) naming the option.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from dstl.errors import ConfigurationError

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class HedgingPolicy:
    """When to start one more attempt of a slow upload ("The Tail at Scale", Dean & Barroso).

    The hedge delay is the ``percentile`` of the latencies of recent uploads (a window of
    ``window`` samples), clamped to ``[min_delay_ms, max_delay_ms]``; until ``min_samples`` latencies
    were seen, ``initial_delay_ms`` is used. ``budget`` caps hedges to that fraction of uploads
    (a token bucket that holds at most ``burst`` hedges), so a storage that is slow for everyone
    is not hit with twice the load.

    A second hedge starts at the ``second_percentile`` (None: never) while an attempt is running
    and none has succeeded, once ``min_samples`` latencies were seen and only where that delay lies
    at least ``min_delay_ms`` beyond the first (a ``percentile`` at or above it means one hedge).
    Why: the p99.9 of once-hedged uploads is made of those whose hedge was slow too. For the same
    budget, a first hedge a little later and a second one at p99 give those a third chance. The
    defaults were chosen with ``benchmarks.hedging_model`` (this class's estimator and budget on
    FLIP-158's S3 latency profile) and checked with ``benchmarks hedging``; docs/benchmarks.md has
    the figures.
    """

    enabled: bool = True
    percentile: float = 0.965
    second_percentile: float | None = 0.99
    window: int = 1000
    min_samples: int = 20
    initial_delay_ms: int = 1000
    #: a float: a hedge floor below one millisecond makes sense on a fast local store
    min_delay_ms: float = 5.0
    max_delay_ms: int = 5000
    budget: float = 0.05
    burst: float = 10.0

    def __post_init__(self) -> None:
        if not 0.0 < self.percentile < 1.0:
            raise ConfigurationError(f"hedging.percentile must be in (0, 1), got {self.percentile}")
        if self.second_percentile is not None and not 0.0 < self.second_percentile < 1.0:
            raise ConfigurationError(
                f"hedging.second_percentile must be in (0, 1) or None, got {self.second_percentile}"
            )
        if not 0.0 <= self.budget <= 1.0:
            raise ConfigurationError(f"hedging.budget must be in [0, 1], got {self.budget}")
        if not 0.0 < self.min_delay_ms <= self.max_delay_ms:
            raise ConfigurationError(
                "hedging delays need 0 < hedging.min_delay_ms <= hedging.max_delay_ms, "
                f"got min_delay_ms={self.min_delay_ms}, max_delay_ms={self.max_delay_ms}"
            )
        for name, value in (("window", self.window), ("min_samples", self.min_samples)):
            if value < 1:
                raise ConfigurationError(f"hedging.{name} must be >= 1, got {value}")

    @classmethod
    def disabled(cls) -> HedgingPolicy:
        return cls(enabled=False)


@dataclass(frozen=True, slots=True)
class S3Options:
    """Connection settings for ``s3://`` base paths; ``None`` falls back to the usual environment
    variables (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
    ``AWS_SESSION_TOKEN``, ``AWS_DEFAULT_REGION``) and botocore's credential chain."""

    endpoint_url: str | None = None
    region: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)
    max_pool_connections: int = 64
    connect_timeout_ms: int = 5000
    read_timeout_ms: int = 30000
    #: one TCP connection per request (no keep-alive); for proxies that account per connection
    force_close: bool = False
    #: send ``Expect: 100-continue`` with each PUT (botocore's default) and wait for the server's
    #: interim answer before the body. It only saves bandwidth when a PUT is refused, and a log
    #: file is small; off, a PUT is one round trip less.
    expect_continue: bool = False


@dataclass(frozen=True, slots=True)
class ChangelogConfig:
    """Settings of one ``StateChangelogStorage``.

    ``base_path`` is a URL or local path: ``s3://bucket/prefix`` uses aiobotocore, any other
    fsspec URL (``file://``, ``memory://``, ...) or a plain path uses fsspec.
    """

    base_path: str
    #: state.changelog.dstl.dfs.batch.persist-delay
    #: (a float: a batching delay below one millisecond makes sense on a fast local store)
    persist_delay_ms: float = 10.0
    #: how long a flush waits for writers that said they will persist soon (``expect_persist``:
    #: the Spark tasks of one executor, which finish at different times) instead of
    #: ``persist_delay_ms``; no Flink option (Flink's writers all run in one TaskManager process)
    expected_persist_wait_ms: int = 5_000
    #: state.changelog.dstl.dfs.batch.persist-size-threshold
    persist_size_threshold: int = 10 * MiB
    #: state.changelog.dstl.dfs.preemptive-persist-threshold
    preemptive_persist_threshold: int = 5 * MiB
    #: state.changelog.dstl.dfs.upload.max-in-flight
    max_in_flight_bytes: int = 100 * MiB
    #: state.changelog.dstl.dfs.upload.timeout (per attempt)
    upload_timeout_ms: int = 1000
    #: the deadline of one attempt of every other DFS call: whole-file reads and writes of checkpoints
    #: and chunks, reads of log files, existence checks, listings, deletions (no Flink option; Flink
    #: relies on the file system's own timeouts). Large enough for the largest chunk at the store's
    #: slowest acceptable throughput; these calls are retried like uploads (``max_attempts``,
    #: ``retry_delay_ms``), so a call is bounded by about ``max_attempts`` times this plus the backoff.
    dfs_timeout_ms: int = 60_000
    #: state.changelog.dstl.dfs.upload.max-attempts (hedges count as attempts; also the attempts of
    #: every other DFS call)
    max_attempts: int = 3
    #: state.changelog.dstl.dfs.upload.next-attempt-delay (doubled after each failed attempt, of
    #: uploads and of every other DFS call)
    retry_delay_ms: int = 500
    #: state.changelog.dstl.dfs.compression.enabled is always on here; this is the zstd level
    compression_level: int = 1
    hedging: HedgingPolicy = field(default_factory=HedgingPolicy)
    s3: S3Options = field(default_factory=S3Options)
    #: number of directories files are spread over (``dstl/<prefix>/<uuid>``)
    prefix_count: int = 256
    #: ranged reads a reader of many parts (a lazy restore) keeps in flight
    #: (``DfsFiles.parallel_reads``); None: the store's own choice, 1 for a local directory (its
    #: reads are page-cache copies on the CPU: more threads only contend for the interpreter lock),
    #: no limit otherwise. A local path on a network mount (NFS, ``/dbfs``) waits on the network
    #: like an object store: give it more.
    parallel_reads: int | None = None

    def __post_init__(self) -> None:
        if not self.base_path:
            raise ConfigurationError("base_path must name a directory or URL")
        positive = {
            "persist_size_threshold": self.persist_size_threshold,
            "preemptive_persist_threshold": self.preemptive_persist_threshold,
            "max_in_flight_bytes": self.max_in_flight_bytes,
            "upload_timeout_ms": self.upload_timeout_ms,
            "dfs_timeout_ms": self.dfs_timeout_ms,
            "max_attempts": self.max_attempts,
            "prefix_count": self.prefix_count,
            "expected_persist_wait_ms": self.expected_persist_wait_ms,
            "parallel_reads": 1 if self.parallel_reads is None else self.parallel_reads,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ConfigurationError(f"{name} must be positive, got {value}")
        for name, delay in (("persist_delay_ms", self.persist_delay_ms), ("retry_delay_ms", self.retry_delay_ms)):
            if delay < 0:
                raise ConfigurationError(f"{name} must not be negative, got {delay}")
        if not -7 <= self.compression_level <= 22:
            raise ConfigurationError(f"compression_level (zstd) must be in [-7, 22], got {self.compression_level}")

    @classmethod
    def local(cls, directory: str | os.PathLike[str], **overrides: object) -> ChangelogConfig:
        """The embedded default: a local directory as the DFS."""
        return cls(base_path=os.fspath(directory), **overrides)  # type: ignore[arg-type]
