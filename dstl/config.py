"""Configuration of the changelog storage, with Flink's defaults and option names.

Every field maps to the Flink option named in its comment where Flink has one, so that users
who tuned Flink's DSTL can carry their settings over. Differences from Flink, and why:

- ``compression_level``: Flink compresses with snappy and off by default; we always compress each
  segment with zstd level 1 (~450 MiB/s here, ratio ~2.4 on state changes): uploads are smaller
  and a reader can seek to one segment instead of decompressing from the file start.
- ``hedging``: Flink hedges implicitly (a timed-out attempt is retried but not cancelled). We
  hedge explicitly at an adaptive latency percentile, cancel the loser, delete its object and cap
  hedges with a budget (see ``dstl.hedging``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class HedgingPolicy:
    """When to start one more attempt of a slow upload ("The Tail at Scale", Dean & Barroso).

    The hedge delay is the ``percentile`` of the latencies of recent uploads (a window of
    ``window`` samples), clamped to ``[min_delay_s, max_delay_s]``; until ``min_samples`` latencies
    were seen, ``initial_delay_s`` is used. ``budget`` caps hedges to that fraction of uploads
    (a token bucket that holds at most ``burst`` hedges), so a storage that is slow for everyone
    is not hit with twice the load.

    A second hedge starts at the ``second_percentile`` (None: never) while an attempt is running
    and none has succeeded, once ``min_samples`` latencies were seen and only where that delay lies at least
    ``min_delay_s`` beyond the first (a ``percentile`` at or above it means one hedge). Why: the
    p99.9 of once-hedged uploads is made of those whose hedge was slow too. For the same budget,
    a first hedge a little later and a second one at p99 give those a third chance.
    Modelled (``benchmarks.hedging_model``: this class's estimator and budget on FLIP-158's S3
    profile, both arms on the same primary draws, 20k uploads x 2 seeds): p99.9 hedged / plain
    0.472 with (0.965, 0.99) vs 0.483 with one hedge at p95, and 0.507 vs 0.519 when every
    attempt pays 8 ms more (a hedged upload pays it twice); lower first percentiles run out of
    budget, and a grid of other pairs was within the model's noise of this one. Measured
    (``benchmarks hedging``, 10k uploads): 0.531 with one hedge at p95, 0.513 with (0.965, 0.99)
    at 2 concurrent uploads; 0.505 at 1 concurrent (per-attempt overhead p50 6.9 ms); 0.443-0.486
    in four runs once the test store's processing overlapped the sampled latency (overhead p50
    2.9-3.8 ms, where the model gives 0.50; modelled runs of 10k uploads spread 0.40-0.55, p10-p90).
    """

    enabled: bool = True
    percentile: float = 0.965
    second_percentile: float | None = 0.99
    window: int = 1000
    min_samples: int = 20
    initial_delay_s: float = 1.0
    min_delay_s: float = 0.005
    max_delay_s: float = 5.0
    budget: float = 0.05
    burst: float = 10.0

    def __post_init__(self) -> None:
        if not 0.0 < self.percentile < 1.0:
            raise ValueError(f"hedging percentile must be in (0, 1), got {self.percentile}")
        if self.second_percentile is not None and not 0.0 < self.second_percentile < 1.0:
            raise ValueError(f"hedging second_percentile must be in (0, 1) or None, got {self.second_percentile}")
        if not 0.0 <= self.budget <= 1.0:
            raise ValueError(f"hedging budget must be in [0, 1], got {self.budget}")
        if not 0.0 < self.min_delay_s <= self.max_delay_s:
            raise ValueError("hedging delays need 0 < min_delay_s <= max_delay_s")
        if self.window < 1 or self.min_samples < 1:
            raise ValueError("hedging window and min_samples must be >= 1")

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
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 30.0
    #: one TCP connection per request (no keep-alive); for proxies that account per connection
    force_close: bool = False
    #: send ``Expect: 100-continue`` with each PUT (botocore's default) and wait for the server's
    #: interim answer before the body. It only saves bandwidth when a PUT is refused, and a log
    #: file is small; off, a PUT is one round trip less (measured against moto through the
    #: latency proxy: 7.1 -> 4.4 ms mean per PUT, the 12-15 ms mode of 40 % of the PUTs gone).
    expect_continue: bool = False


@dataclass(frozen=True, slots=True)
class ChangelogConfig:
    """Settings of one ``StateChangelogStorage``.

    ``base_path`` is a URL or local path: ``s3://bucket/prefix`` uses aiobotocore, any other
    fsspec URL (``file://``, ``memory://``, ...) or a plain path uses fsspec.
    """

    base_path: str
    #: state.changelog.dstl.dfs.batch.persist-delay
    persist_delay_s: float = 0.010
    #: state.changelog.dstl.dfs.batch.persist-size-threshold
    persist_size_threshold: int = 10 * MiB
    #: state.changelog.dstl.dfs.preemptive-persist-threshold
    preemptive_persist_threshold: int = 5 * MiB
    #: state.changelog.dstl.dfs.upload.max-in-flight
    max_in_flight_bytes: int = 100 * MiB
    #: state.changelog.dstl.dfs.upload.timeout (per attempt)
    upload_timeout_s: float = 1.0
    #: state.changelog.dstl.dfs.upload.max-attempts (hedges count as attempts)
    max_attempts: int = 3
    #: state.changelog.dstl.dfs.upload.next-attempt-delay (doubled after each failed attempt)
    retry_delay_s: float = 0.5
    #: state.changelog.dstl.dfs.compression.enabled is always on here; this is the zstd level
    compression_level: int = 1
    hedging: HedgingPolicy = field(default_factory=HedgingPolicy)
    s3: S3Options = field(default_factory=S3Options)
    #: number of directories files are spread over (``dstl/<prefix>/<uuid>``)
    prefix_count: int = 256

    def __post_init__(self) -> None:
        if not self.base_path:
            raise ValueError("base_path must name a directory or URL")
        positive = {
            "persist_size_threshold": self.persist_size_threshold,
            "preemptive_persist_threshold": self.preemptive_persist_threshold,
            "max_in_flight_bytes": self.max_in_flight_bytes,
            "upload_timeout_s": self.upload_timeout_s,
            "max_attempts": self.max_attempts,
            "prefix_count": self.prefix_count,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.persist_delay_s < 0 or self.retry_delay_s < 0:
            raise ValueError("persist_delay_s and retry_delay_s must not be negative")
        if not -7 <= self.compression_level <= 22:
            raise ValueError(f"zstd compression_level must be in [-7, 22], got {self.compression_level}")

    @classmethod
    def local(cls, directory: str | os.PathLike[str], **overrides: object) -> ChangelogConfig:
        """The embedded default: a local directory as the DFS."""
        return cls(base_path=os.fspath(directory), **overrides)  # type: ignore[arg-type]
