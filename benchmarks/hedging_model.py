"""A Monte-Carlo model of the hedging policy, to tell the policy's share of a measured tail from
the harness's.

Why: the ``hedging`` benchmark's latencies are the profile's draw *plus* what every attempt pays
on this machine (client CPU, the proxy's forwarding), and a hedged upload pays that overhead twice
(the hedge delay is measured on full latencies, then the hedge itself pays it again). Whether a
ratio above the target is the policy's fault or the overhead's is a question this model answers:
it runs the production ``HedgeDelay`` and ``HedgeBudget`` (the same state, percentiles and budget
as ``UploadExecutor``) on independent draws of ``profile + overhead``, where the overhead is
sampled in the same run (latencies through a proxy holding every answer for a constant time,
minus that time). With zero overhead it gives the policy's own bound.

Common random numbers: primaries and hedges draw from separate generators, and the plain arm
uses the same seed as the hedged one, so both arms see the same primary latencies and the ratio
measures the policy, not two unrelated samples of the tail (whose p99.9 alone swings widely
between seeds).

Simplifications: every attempt's overhead is an independent draw, while in the benchmark a
stall of the client (its event loop, a garbage collection) delays a primary and its hedge
alike, so the model is a little optimistic; hedge timers fire exactly on time; the upload
succeeds (no failures, no retries).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from benchmarks.common import percentile
from benchmarks.support.latency_proxy import LatencyProfile
from dstl.config import ChangelogConfig, HedgingPolicy
from dstl.hedging import HedgeBudget, HedgeDelay

WARMUP = 300
DEFAULT_MAX_ATTEMPTS = ChangelogConfig(base_path="-").max_attempts


def simulate(
    policy: HedgingPolicy,
    profile: LatencyProfile,
    overhead_s: Sequence[float],
    uploads: int,
    *,
    seed: int,
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
) -> tuple[list[float], float]:
    """Latencies (seconds) of ``uploads`` modelled uploads after a warm-up, and the extra
    attempts per upload (hedges, as the benchmark's ``extra_request_pct`` / 100)."""
    primaries, hedges = random.Random(seed), random.Random(seed + 1_000_003)
    overhead = list(overhead_s) or [0.0]

    def draw(rng: random.Random) -> float:
        return profile.sample(rng) + rng.choice(overhead)

    delay, budget = HedgeDelay(policy), HedgeBudget(policy)
    latencies: list[float] = []
    extra = 0
    for i in range(WARMUP + uploads):
        budget.earn()
        ends = [draw(primaries)]
        for at in delay.delays() if policy.enabled else []:
            if min(ends) <= at or len(ends) >= max_attempts:
                break
            if budget.try_take():
                ends.append(at + draw(hedges))
                extra += i >= WARMUP
        latency = min(ends)
        if policy.enabled:
            delay.observe(latency)  # the primary's latency, or the winner's when a hedge won (as ``_won``)
        latencies.append(latency)
    return latencies[WARMUP:], extra / uploads


def p999_ratio(
    policy: HedgingPolicy,
    profile: LatencyProfile,
    overhead_s: Sequence[float],
    uploads: int,
    *,
    seeds: int = 3,
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
) -> tuple[float, float]:
    """Mean over ``seeds`` runs of hedged p99.9 / plain p99.9 (same primaries), and the mean
    extra attempts per upload of the hedged arm."""
    ratios: list[float] = []
    extras: list[float] = []
    for seed in range(seeds):
        hedged, extra = simulate(policy, profile, overhead_s, uploads, seed=seed, max_attempts=max_attempts)
        plain, _ = simulate(HedgingPolicy.disabled(), profile, overhead_s, uploads, seed=seed)
        ratios.append(percentile(hedged, 0.999) / percentile(plain, 0.999))
        extras.append(extra)
    return sum(ratios) / len(ratios), sum(extras) / len(extras)


def run_spread(
    policy: HedgingPolicy,
    profile: LatencyProfile,
    overhead_s: Sequence[float],
    uploads: int,
    *,
    runs: int,
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
) -> list[float]:
    """The ratios of ``runs`` modelled benchmark runs of ``uploads`` uploads per mode, sorted.

    Unlike :func:`p999_ratio`, the two arms draw independent primaries, as the benchmark's two
    modes do: this is how far one run's ratio strays from the policy's by sampling alone (the
    plain p99.9 of 10,000 uploads is the 10th-largest draw of a heavy tail)."""
    ratios = []
    for run in range(runs):
        seed = 1000 + run
        hedged, _ = simulate(policy, profile, overhead_s, uploads, seed=seed, max_attempts=max_attempts)
        plain, _ = simulate(HedgingPolicy.disabled(), profile, overhead_s, uploads, seed=seed + 500_000)
        ratios.append(percentile(hedged, 0.999) / percentile(plain, 0.999))
    return sorted(ratios)
