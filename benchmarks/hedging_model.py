"""A Monte-Carlo model of the hedging policy, to tell the policy's share of a measured tail from
the harness's.

Why: the ``hedging`` benchmark's latencies are the profile's draw *plus* what every attempt pays
on this machine (client CPU, the proxy, moto), and a hedged upload pays that overhead twice (the
hedge delay is measured on full latencies, then the hedge itself pays it again). Whether a ratio
above the target is the policy's fault or the overhead's is a question this model answers: it
runs the production ``HedgeDelay`` and ``HedgeBudget`` (the same state, percentiles and budget
as ``UploadExecutor``) on independent draws of ``profile + overhead``, where the overhead is
sampled from latencies measured in the same run through a zero-latency proxy. With zero
overhead it gives the policy's own bound.

Simplifications, each small against the tail: every attempt's overhead is an independent draw
(in the benchmark two concurrent uploads may share a stall), the hedge timers fire exactly on
time, and a primary cancelled by a winning hedge is sampled at the winner's latency, as the
executor does.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from dstl.config import HedgingPolicy
from dstl.hedging import HedgeBudget, HedgeDelay
from tests.latency_proxy import LatencyProfile

WARMUP = 300


def simulate(
    policy: HedgingPolicy,
    profile: LatencyProfile,
    overhead_s: Sequence[float],
    uploads: int,
    *,
    seed: int,
    max_attempts: int = 3,
) -> tuple[list[float], float]:
    """Latencies (seconds) of ``uploads`` modelled uploads and the extra attempts per upload."""
    rng = random.Random(seed)
    overhead = list(overhead_s) or [0.0]

    def draw() -> float:
        return profile.sample(rng) + rng.choice(overhead)

    delay, budget = HedgeDelay(policy), HedgeBudget(policy)
    latencies: list[float] = []
    extra = 0
    for _ in range(WARMUP + uploads):
        budget.earn()
        ends = [draw()]
        for at in delay.delays() if policy.enabled else []:
            if min(ends) <= at or len(ends) >= max_attempts:
                break
            if budget.try_take():
                ends.append(at + draw())
                extra += 1
        latency = min(ends)
        if policy.enabled:
            delay.observe(latency)
        latencies.append(latency)
    return latencies[WARMUP:], extra / (WARMUP + uploads)


def p999_ratio(
    policy: HedgingPolicy, profile: LatencyProfile, overhead_s: Sequence[float], uploads: int, seeds: int = 3
) -> tuple[float, float]:
    """Mean over ``seeds`` runs of hedged p99.9 / plain p99.9, and the hedged extra requests."""
    ratios, extras = [], []
    for seed in range(seeds):
        hedged, extra = simulate(policy, profile, overhead_s, uploads, seed=seed)
        plain, _ = simulate(HedgingPolicy.disabled(), profile, overhead_s, uploads, seed=seed + 1000)
        ratios.append(_p999(hedged) / _p999(plain))
        extras.append(extra)
    return sum(ratios) / len(ratios), sum(extras) / len(extras)


def _p999(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.999 * len(ordered)))]
