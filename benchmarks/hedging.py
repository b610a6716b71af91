"""``hedging``: tail latency of uploads with and without request hedging, on a heavy-tailed store.

Setup, all real parts over loopback HTTP: moto's S3 server (a subprocess) behind the latency
proxy of ``benchmarks.support.latency_proxy`` (another subprocess), which draws a latency for every connection
from FLIP-158's measured S3 latency profile (p50 459, p90 740, p95 833, p99 1039, p99.9 3202 ms)
scaled by 1/10. The client uses one connection per request (``force_close``), so every attempt,
hedges included, draws its own latency independently. The proxy forwards each request at once and
holds the answer until the draw has passed (``delay_response``): a measured store latency includes
the store's own processing, so moto's (Python, milliseconds per PUT) must overlap the draw, not add
to it; a loser that the client gave up on still lands in moto, as it may in S3, and is deleted.

Each mode has its own ``UploadExecutor`` over the aiobotocore S3 uploader (the production path of
a flush, without the batching delay), with the default ``HedgingPolicy`` for the hedged mode and
hedging disabled for the plain one. The two modes run in alternating blocks, so drift of the
shared machine hits both alike; each warms up first (the hedged mode's delay estimate needs
samples); then the long-lived objects are frozen out of the cyclic GC's scans (``gc.freeze``;
the S3 server does the same), so that the tail measured is the store's and the policy's, not
the collector's. Objects are 1 KiB: the server's memory stays small without deleting as we go.

Figures: p50/p99/p99.9 of upload latency per mode, ``p999_ratio`` = hedged / plain, and
``extra_request_pct`` = PUT attempts beyond one per upload, in percent (the loser deletions are
reported separately: they are cleanup off the latency path). The p99.9 of 10,000 samples is the
10th-largest latency of a heavy tail, and the two modes draw different samples: one run's ratio
is a noisy figure (how noisy, the model below says; docs/benchmarks.md has the spread of past runs).

The same run then measures what an attempt costs besides the profile's draw (uploads through a
second proxy that holds every answer for the profile's minimum, 22.95 ms, minus that) and feeds
it to ``benchmarks.hedging_model``: the modelled ratio at this overhead (both arms on the same
draws, 100,000 uploads) says what the policy achieves on this machine without the sampling noise,
and how runs of this benchmark's size spread around it; the ratio without overhead is the
policy's own bound on this profile.
"""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
from pathlib import Path

from benchmarks import hedging_model
from benchmarks.common import BenchResult, percentile, progress, save_figure
from benchmarks.support.latency_proxy import LatencyProfile, run_in_subprocess
from benchmarks.support.s3_server import ACCESS_KEY, REGION, SECRET_KEY, create_bucket, start_s3_server
from dstl.config import ChangelogConfig, HedgingPolicy, S3Options
from dstl.hedging import UploadExecutor
from dstl.metrics import ChangelogMetrics
from dstl.paths import new_file_name
from dstl.uploaders import S3Uploader

BUCKET = "hedging-bench"
# One upload at a time, as one TaskManager's flushes mostly are. Every upload's client work
# (botocore's CPU per PUT) runs on one event loop, so at 2 concurrent uploads each attempt also
# waits for the other's, a cost that a hedged upload pays twice (docs/benchmarks.md has the figures).
CONCURRENCY = 1
BLOCK = 500
WARMUP = 300
SCALE = 0.1
SEEDS = 3  # runs of the Monte-Carlo model
SPREAD_RUNS = 100  # modelled runs of the benchmark's size
# The profile's fastest draw: longer than moto's processing, so it overlaps the hold entirely.
FLOOR_MS = round(LatencyProfile.flip158(SCALE).quantile(0.0) * 1000, 2)


def _config(endpoint: str, hedging: HedgingPolicy) -> ChangelogConfig:
    return ChangelogConfig(
        base_path=f"s3://{BUCKET}/bench",
        hedging=hedging,
        # The per-attempt timeout must not act as a second hedge: 10x the profile's p99.9.
        upload_timeout_ms=3200,
        s3=S3Options(
            endpoint_url=endpoint,
            region=REGION,
            access_key_id=ACCESS_KEY,
            secret_access_key=SECRET_KEY,
            force_close=True,
            max_pool_connections=4 * CONCURRENCY,
        ),
    )


class _Mode:
    def __init__(self, name: str, endpoint: str, hedging: HedgingPolicy) -> None:
        self.name = name
        config = _config(endpoint, hedging)
        self.uploader = S3Uploader(config.base_path, config.s3)
        self.metrics = ChangelogMetrics()
        self.executor = UploadExecutor(self.uploader, config, self.metrics, lambda: new_file_name(256))
        self.latencies_ms: list[float] = []

    async def run(self, count: int, record: bool) -> None:
        payload = os.urandom(1024)
        remaining = count

        async def worker() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                outcome = await self.executor.upload(payload)
                if record:
                    self.latencies_ms.append(outcome.latency_ms)

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))


async def _bench(endpoint: str, uploads: int, warmup: int) -> tuple[_Mode, _Mode, dict[str, float]]:
    plain = _Mode("plain", endpoint, HedgingPolicy.disabled())
    hedged = _Mode("hedged", endpoint, HedgingPolicy())
    for mode in (plain, hedged):
        await mode.run(warmup, record=False)
        await mode.executor.drain()
    # As a tuned long-running service does (gc.freeze, Python >= 3.7): botocore's models and the
    # clients are many long-lived objects that each full collection of the cyclic GC walks: a
    # stall of every upload in flight that hits hedges too.
    gc.collect()
    gc.freeze()
    counters_after_warmup = {m.name: (m.metrics.upload_attempts, m.metrics.upload_requests) for m in (plain, hedged)}
    done = 0
    while done < uploads:
        block = min(BLOCK, uploads - done)
        for mode in (plain, hedged):
            await mode.run(block, record=True)
            # The losers' deletions of a hedged block must not run into the next plain block.
            await mode.executor.drain()
        done += block
        progress(f"hedging: {done}/{uploads} uploads per mode")
    for mode in (plain, hedged):
        await mode.executor.drain()
        await mode.uploader.close()
    attempts = {m.name: m.metrics.upload_attempts - counters_after_warmup[m.name][0] for m in (plain, hedged)}
    requests = {m.name: m.metrics.upload_requests - counters_after_warmup[m.name][1] for m in (plain, hedged)}
    extra = {
        "extra_request_pct": 100.0 * (attempts["hedged"] - requests["hedged"]) / requests["hedged"],
        "extra_request_pct_plain": 100.0 * (attempts["plain"] - requests["plain"]) / requests["plain"],
    }
    return plain, hedged, extra


def _plot(plain: list[float], hedged: list[float], path: Path) -> bool:
    """Write the tail plot; False when matplotlib (the ``bench`` extra) is not installed."""
    try:
        import matplotlib
    except ImportError:
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, values in (("plain", plain), ("hedged", hedged)):
        ordered = sorted(values)
        tail = [1 - (i + 0.5) / len(ordered) for i in range(len(ordered))]
        ax.plot(ordered, tail, label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("upload latency (ms)")
    ax.set_ylabel("1 - CDF (fraction of uploads slower)")
    ax.set_title("Upload latency, FLIP-158 S3 profile x 0.1, through moto + latency proxy")
    for q in (0.01, 0.001):
        ax.axhline(q, color="grey", linewidth=0.5, linestyle=":")
    ax.legend()
    ax.grid(True, which="both", linewidth=0.3)
    save_figure(fig, path)
    return True


async def _overhead(endpoint: str, uploads: int) -> list[float]:
    """What every attempt pays on this machine besides the profile's draw (s): latencies of plain
    uploads through a proxy that holds each answer for ``FLOOR_MS``, minus that."""
    mode = _Mode("overhead", endpoint, HedgingPolicy.disabled())
    await mode.run(100, record=False)
    gc.collect()  # the new client's objects, as after the main warm-up
    gc.freeze()
    await mode.run(uploads, record=True)
    await mode.uploader.close()
    # Never negative: the proxy holds every answer at least FLOOR_MS from the accept.
    return [(ms - FLOOR_MS) / 1000 for ms in mode.latencies_ms]


def run(quick: bool, out_dir: Path) -> BenchResult:
    # Quick mode is a smoke run: its p99.9 is one of the few largest samples.
    uploads, warmup = (800, 200) if quick else (10_000, WARMUP)
    server = start_s3_server()
    proxies: list[subprocess.Popen[str]] = []
    try:
        create_bucket(server.endpoint_url, BUCKET)
        proxy, port = run_in_subprocess(server.port, scale=SCALE, seed=42, delay_response=True)
        proxies.append(proxy)
        plain, hedged, extra = asyncio.run(_bench(f"http://127.0.0.1:{port}", uploads, warmup))
        progress("hedging: per-attempt overhead through a constant-latency proxy")
        proxy, port = run_in_subprocess(server.port, constant_ms=FLOOR_MS, seed=7, delay_response=True)
        proxies.append(proxy)
        overhead = asyncio.run(_overhead(f"http://127.0.0.1:{port}", 500 if quick else 2000))
    finally:
        for proxy in proxies:
            proxy.terminate()
            proxy.wait(10)
        server.stop()
    progress("hedging: Monte-Carlo model of the policy at the measured overhead and at none")
    profile = LatencyProfile.flip158(SCALE)
    modelled = 20_000 if quick else 100_000
    model_ratio, _ = hedging_model.p999_ratio(HedgingPolicy(), profile, overhead, modelled, seeds=SEEDS)
    model_ratio_free, model_extra_free = hedging_model.p999_ratio(HedgingPolicy(), profile, [], modelled, seeds=SEEDS)
    spread = hedging_model.run_spread(HedgingPolicy(), profile, overhead, uploads, runs=SPREAD_RUNS)
    metrics: dict[str, float | int] = {"uploads_per_mode": uploads}
    for mode in (plain, hedged):
        for label, q in (("p50", 0.5), ("p99", 0.99), ("p999", 0.999)):
            metrics[f"{label}_ms_{mode.name}"] = round(percentile(mode.latencies_ms, q), 1)
    metrics["p999_ratio"] = round(metrics["p999_ms_hedged"] / metrics["p999_ms_plain"], 3)
    metrics["p99_ratio"] = round(metrics["p99_ms_hedged"] / metrics["p99_ms_plain"], 3)
    metrics["extra_request_pct"] = round(extra["extra_request_pct"], 2)
    metrics["hedges"] = hedged.metrics.hedges
    metrics["hedges_won"] = hedged.metrics.hedges_won
    metrics["hedges_denied_by_budget"] = hedged.metrics.hedges_denied_by_budget
    metrics["loser_deletes"] = hedged.metrics.deleted_orphans
    metrics["final_hedge_delay_ms"] = round(hedged.executor.hedge_delay.current() * 1000, 1)
    overhead_ms = [s * 1000 for s in overhead]
    for label, q in (("p50", 0.5), ("p99", 0.99), ("p999", 0.999)):
        metrics[f"overhead_{label}_ms"] = round(percentile(overhead_ms, q), 1)
    metrics["model_p999_ratio"] = round(model_ratio, 3)
    metrics["model_p999_ratio_no_overhead"] = round(model_ratio_free, 3)
    metrics["model_extra_request_pct_no_overhead"] = round(100 * model_extra_free, 2)
    # How runs of this size spread around the policy's ratio by sampling alone.
    for label, q in (("p10", 0.1), ("p50", 0.5), ("p90", 0.9)):
        metrics[f"model_run_ratio_{label}"] = round(percentile(spread, q), 3)
    metrics["model_runs_at_most_half_pct"] = round(100 * sum(r <= 0.5 for r in spread) / len(spread))
    plot = out_dir / "hedging_cdf.png"
    plotted = _plot(plain.latencies_ms, hedged.latencies_ms, plot)
    table = [
        ("uploads per mode", f"{uploads} (+{warmup} warm-up), {CONCURRENCY} concurrent"),
        ("profile p50/p99/p99.9 (ms)", "/".join(f"{profile.quantile(q) * 1000:.1f}" for q in (0.5, 0.99, 0.999))),
        *(
            (f"{m:<6} p50/p99/p99.9 (ms)", " / ".join(str(metrics[f"{q}_ms_{m}"]) for q in ("p50", "p99", "p999")))
            for m in ("plain", "hedged")
        ),
        ("p99.9 ratio hedged/plain", f"{metrics['p999_ratio']}"),
        (
            "extra requests",
            f"{metrics['extra_request_pct']} % ({metrics['hedges']} hedges, {metrics['hedges_won']} won)",
        ),
        ("hedge delay at the end (ms)", f"{metrics['final_hedge_delay_ms']}"),
        (
            "overhead per attempt p50/p99/p99.9",
            " / ".join(str(metrics[f"overhead_{q}_ms"]) for q in ("p50", "p99", "p999")) + " ms",
        ),
        ("model ratio, this overhead", f"{metrics['model_p999_ratio']} ({modelled:,} modelled uploads x {SEEDS})"),
        (
            "model ratio, no overhead",
            f"{metrics['model_p999_ratio_no_overhead']} ({metrics['model_extra_request_pct_no_overhead']} % extra)",
        ),
        (
            f"model, runs of {uploads} uploads",
            f"ratio p10/p50/p90 {metrics['model_run_ratio_p10']} / {metrics['model_run_ratio_p50']} / "
            f"{metrics['model_run_ratio_p90']}; <= 0.5 in {metrics['model_runs_at_most_half_pct']} % "
            f"of {SPREAD_RUNS} runs",
        ),
    ]
    return BenchResult(
        name="hedging",
        metrics=metrics,
        table=table,
        plots=[str(plot)] if plotted else [],
        # The overhead samples let the model be re-run on this run's machine state.
        details={"extra_request_pct_plain": extra["extra_request_pct_plain"], "overhead_ms": overhead_ms},
    )
