"""Peak memory of a writer on a stalled and on a refusing DFS, against the in-flight limit.

An operator thread appends distinct, incompressible changes as fast as it can while every PUT to
the DFS stalls (``faulty_fs`` "stall": attempts time out, uploads fail after their retries) or is
refused (``faulty_fs`` "fail"). Appends must block once the bytes the log holds for uploads
(changesets not yet durable, failed ones included, and the encoded files of uploads in progress
or pinned by a stuck write) reach ``max_in_flight_bytes``, so the process' RSS may grow by that
limit plus a fixed overhead and no more. The fault is then lifted and the run checks that the
appends resume and that every change became durable.

The fixed overhead is measured, not assumed: the "baseline" scenario is the same run on a healthy
DFS with the in-flight limit at its minimum (one byte: one upload at a time), so its RSS growth is
what the log needs besides the bytes the limit counts (the active changeset up to the pre-emptive
threshold, one file being encoded and uploaded, encoding buffers, threads, allocator slack). Each
faulty scenario passes when its peak RSS growth stays within ``limit + overhead``.

Each scenario runs in a fresh interpreter (``python -m benchmarks.backpressure --scenario ...``),
so one scenario's freed memory does not hide the next one's growth; the base is the RSS after a
warm-up without faults. RSS is read from ``/proc/self/statm`` every ``SAMPLE_S``.

JSON metrics: ``rss_peak_over_base_mb_stalled``, ``rss_peak_over_base_mb_refusing``,
``in_flight_limit_mb``, ``rss_overhead_mb`` (the baseline's growth), ``rss_bound_mb`` and
``within_bound_stalled`` / ``within_bound_refusing``. A PNG of RSS and of the bytes counted
against the limit over time is written when matplotlib (the ``bench`` extra) is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.common import BenchResult, MiB, progress, rss_mb, save_figure
from benchmarks.support.faulty_fs import Action, Fault, FaultPlan, faulty_base_path
from dstl import ChangelogConfig, KeyGroupRange, StateChangelogStorage

SAMPLE_S = 0.02
PAYLOAD = 1000
RANGE = KeyGroupRange(0, 127)
SCENARIOS = ("baseline", "stalled", "refusing")
FAULTS: dict[str, Action] = {"stalled": "stall", "refusing": "fail"}


class _Operator:
    """Appends distinct, incompressible changes until stopped; counts what it appended."""

    def __init__(self, storage: StateChangelogStorage) -> None:
        self.writer = storage.create_writer("op", RANGE)
        self.stop = threading.Event()
        self.appended = 0
        self.error: BaseException | None = None
        self._noise = os.urandom(4 * MiB)
        self.thread = threading.Thread(target=self._run, name="operator", daemon=True)

    def _run(self) -> None:
        noise, span = self._noise, len(self._noise) - PAYLOAD
        append = self.writer.append
        i = 0
        try:
            while not self.stop.is_set():
                off = (i * 7919) % span
                append(i % 128, noise[off : off + PAYLOAD])  # a slice is a copy: real memory per change
                i += 1
                self.appended = i
        except BaseException as exc:  # reported by the scenario
            self.error = exc


def scenario(name: str, limit_bytes: int, fault_s: float) -> dict[str, Any]:
    """One run in this process: warm up, append under the fault for ``fault_s``, lift it, drain."""
    plan = FaultPlan()
    with tempfile.TemporaryDirectory(prefix="dstl-backpressure-") as tmp:
        base_path = faulty_base_path(Path(tmp) / "dfs", plan)
        config = ChangelogConfig(base_path=base_path, max_in_flight_bytes=limit_bytes)
        storage = StateChangelogStorage(config)
        op = _Operator(storage)
        for i in range(20_000):  # warm-up without faults: the writer's and uploader's steady state
            op.writer.append(i % 128, os.urandom(PAYLOAD))
        op.writer.persist_durably(0).result(60)
        base = rss_mb()
        fault = plan.add(Fault(op="put", action=FAULTS[name])) if name in FAULTS else None
        samples: list[tuple[float, float, float]] = []
        metrics = storage.metrics

        def counted() -> float:
            return (metrics.bytes_in_flight + metrics.bytes_encoded) / MiB

        start = time.monotonic()
        op.thread.start()
        while (now := time.monotonic() - start) < fault_s:
            samples.append((now, rss_mb(), counted()))
            time.sleep(SAMPLE_S)
        blocked_at = op.appended
        peak = max(rss for _, rss, _ in samples)
        counted_peak = max(f for _, _, f in samples)
        waits = metrics.backpressure_waits
        lifted = time.monotonic() - start
        plan.release()
        if fault is not None:
            plan.remove(fault)
        while metrics.bytes_in_flight > config.max_in_flight_bytes or op.appended == blocked_at:
            samples.append((time.monotonic() - start, rss_mb(), counted()))
            if time.monotonic() - start > lifted + 120 or op.error is not None:
                break
            time.sleep(SAMPLE_S)
        resumed_s = time.monotonic() - start - lifted
        op.stop.set()
        op.thread.join(60)
        handle = op.writer.persist_durably(0).result(120)
        durable = sum(seg.records for seg in handle.segments)
        storage.close()
        plan.close()
    return {
        "scenario": name,
        "base_mb": round(base, 1),
        "peak_mb": round(peak, 1),
        "peak_over_base_mb": round(peak - base, 1),
        "counted_peak_mb": round(counted_peak, 1),
        "appended_under_fault_mb": round(blocked_at * PAYLOAD / MiB, 1),
        "backpressure_waits": waits,
        "failed_uploads": metrics.upload_failures,
        "background_retries": metrics.background_retries,
        "resumed_after_s": round(resumed_s, 2),
        "all_durable": durable == op.appended + 20_000 and op.error is None,
        "samples": [[round(t, 3), round(r, 1), round(f, 2)] for t, r, f in samples],
    }


def _run_child(name: str, limit_bytes: int, fault_s: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.backpressure", "--scenario", name]
    cmd += ["--limit-bytes", str(limit_bytes), "--fault-s", str(fault_s)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=fault_s + 600)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _plot(runs: dict[str, dict[str, Any]], limit_mb: int, bound_mb: float, path: Path) -> bool:
    """RSS and bytes counted against the limit over time, one panel per scenario; False without
    matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4.2), sharey=True)
    for ax, (name, run) in zip(axes, runs.items(), strict=True):
        t = [s[0] for s in run["samples"]]
        ax.plot(t, [s[1] - run["base_mb"] for s in run["samples"]], label="RSS over base (MiB)")
        ax.plot(t, [s[2] for s in run["samples"]], label="bytes counted against the limit (MiB)")
        if name in FAULTS:
            ax.axhline(limit_mb, color="grey", linestyle=":", label="in-flight limit")
            ax.axhline(bound_mb, color="red", linestyle="--", label="limit + baseline overhead")
        ax.set_title(f"{name} DFS" if name in FAULTS else "baseline: healthy DFS, limit 1 byte")
        ax.set_xlabel("seconds (fault lifted at the end)")
        ax.grid(True, linewidth=0.3)
    axes[0].set_ylabel("MiB")
    axes[-1].legend()
    save_figure(fig, path)
    return True


def run(quick: bool, out_dir: Path) -> BenchResult:
    limit_mb = 32 if quick else 100  # 100 MiB: ChangelogConfig's default (Flink's upload.max-in-flight)
    fault_s = 6.0 if quick else 30.0
    runs: dict[str, dict[str, Any]] = {}
    for name in SCENARIOS:
        limit = 1 if name == "baseline" else limit_mb * MiB
        what = "healthy DFS, limit 1 byte" if name == "baseline" else f"{name} DFS, limit {limit_mb} MiB"
        progress(f"backpressure: {what}, {fault_s:.0f} s")
        runs[name] = _run_child(name, limit, fault_s)
    overhead = runs["baseline"]["peak_over_base_mb"]
    bound = round(limit_mb + overhead, 1)
    within = {name: runs[name]["peak_over_base_mb"] <= bound for name in FAULTS}
    metrics: dict[str, Any] = {
        "rss_peak_over_base_mb_stalled": runs["stalled"]["peak_over_base_mb"],
        "rss_peak_over_base_mb_refusing": runs["refusing"]["peak_over_base_mb"],
        "in_flight_limit_mb": limit_mb,
        "rss_overhead_mb": overhead,
        "rss_bound_mb": bound,
    }
    for name in FAULTS:
        metrics[f"within_bound_{name}"] = within[name]
    for name, r in runs.items():
        for key in ("counted_peak_mb", "appended_under_fault_mb", "resumed_after_s", "all_durable"):
            metrics[f"{key}_{name}"] = r[key]
    plot = out_dir / "backpressure.png"
    plotted = _plot(runs, limit_mb, bound, plot)
    b = runs["baseline"]
    table = [
        ("in-flight limit", f"{limit_mb} MiB; {fault_s:.0f} s under each fault"),
        (
            "fixed overhead",
            f"{overhead} MiB: RSS growth of the same run on a healthy DFS with the limit at 1 byte "
            f"(RSS {b['base_mb']} -> {b['peak_mb']} MiB, counted peak {b['counted_peak_mb']} MiB, "
            f"appended {b['appended_under_fault_mb']} MiB)",
        ),
        ("bound checked", f"RSS growth <= limit + overhead = {limit_mb} + {overhead} = {bound} MiB"),
        *(
            (
                f"{name} DFS",
                f"{'PASS' if within[name] else 'FAIL'}: RSS {r['base_mb']} -> {r['peak_mb']} MiB "
                f"(+{r['peak_over_base_mb']} of {bound}), counted peak {r['counted_peak_mb']} MiB, "
                f"appended {r['appended_under_fault_mb']} MiB, {r['backpressure_waits']} waits, "
                f"{r['failed_uploads']} failed uploads, resumed {r['resumed_after_s']} s after the fault, "
                f"all durable: {r['all_durable']}",
            )
            for name, r in runs.items()
            if name in FAULTS
        ),
    ]
    return BenchResult(
        name="backpressure",
        metrics=metrics,
        table=table,
        plots=[str(plot)] if plotted else [],
        details={name: {k: v for k, v in r.items() if k != "samples"} for name, r in runs.items()},
    )


def main(argv: list[str] | None = None) -> int:
    """The child process of one scenario: prints its result as one JSON line."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.backpressure")
    parser.add_argument("--scenario", choices=SCENARIOS, required=True)
    parser.add_argument("--limit-bytes", type=int, required=True)
    parser.add_argument("--fault-s", type=float, required=True)
    args = parser.parse_args(argv)
    print(json.dumps(scenario(args.scenario, args.limit_bytes, args.fault_s)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
