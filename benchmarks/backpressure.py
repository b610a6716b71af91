"""Peak memory of a writer on a stalled and on a refusing DFS, against the in-flight limit.

An operator thread appends distinct, incompressible changes as fast as it can while every PUT to
the DFS stalls (``faulty_fs`` "stall": attempts time out, uploads fail after their retries) or is
refused (``faulty_fs`` "fail"). Appends must block once the bytes not yet durable reach
``max_in_flight_bytes``, so the process' RSS may grow by about that limit plus a fixed overhead
(the active changeset up to the pre-emptive threshold, what is appended between two checks of
the loop thread, the encoded file of each upload) and no more. The fault is then lifted and the
run checks that the appends resume and that every change became durable.

Each scenario runs in a fresh interpreter (``python -m benchmarks.backpressure --scenario ...``),
so one scenario's freed memory does not hide the next one's growth; the base is the RSS after a
warm-up without faults. RSS is read from ``/proc/self/statm`` every ``SAMPLE_S``.

JSON metrics: ``rss_peak_over_base_mb_stalled``, ``rss_peak_over_base_mb_refusing``,
``in_flight_limit_mb``. A PNG of RSS and bytes in flight over time is written when matplotlib
(the ``bench`` extra) is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.common import BenchResult, progress
from benchmarks.support.faulty_fs import Fault, FaultPlan, faulty_base_path
from dstl import ChangelogConfig, KeyGroupRange, StateChangelogStorage

MiB = 1 << 20
SAMPLE_S = 0.02
PAYLOAD = 1000
RANGE = KeyGroupRange(0, 127)
SCENARIOS = ("stalled", "refusing")
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE / MiB
    except OSError:  # not Linux: the peak so far is the best there is
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


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


def scenario(name: str, limit_mb: int, fault_s: float) -> dict[str, Any]:
    """One run in this process: warm up, append under the fault for ``fault_s``, lift it, drain."""
    plan = FaultPlan()
    with tempfile.TemporaryDirectory(prefix="dstl-backpressure-") as tmp:
        base_path = faulty_base_path(Path(tmp) / "dfs", plan)
        config = ChangelogConfig(base_path=base_path, max_in_flight_bytes=limit_mb * MiB)
        storage = StateChangelogStorage(config)
        op = _Operator(storage)
        for i in range(20_000):  # warm-up without faults: the writer's and uploader's steady state
            op.writer.append(i % 128, os.urandom(PAYLOAD))
        op.writer.persist_durably(0).result(60)
        base = _rss_mb()
        fault = plan.add(Fault(op="put", action="stall" if name == "stalled" else "fail"))
        samples: list[tuple[float, float, float]] = []
        metrics = storage.metrics
        start = time.monotonic()
        op.thread.start()
        while (now := time.monotonic() - start) < fault_s:
            samples.append((now, _rss_mb(), metrics.bytes_in_flight / MiB))
            time.sleep(SAMPLE_S)
        blocked_at = op.appended
        peak = max(rss for _, rss, _ in samples)
        in_flight_peak = max(f for _, _, f in samples)
        waits = metrics.backpressure_waits
        lifted = time.monotonic() - start
        plan.release()
        plan.remove(fault)
        while metrics.bytes_in_flight > config.max_in_flight_bytes or op.appended == blocked_at:
            samples.append((time.monotonic() - start, _rss_mb(), metrics.bytes_in_flight / MiB))
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
        "in_flight_peak_mb": round(in_flight_peak, 1),
        "appended_under_fault_mb": round(blocked_at * PAYLOAD / MiB, 1),
        "backpressure_waits": waits,
        "failed_uploads": metrics.upload_failures,
        "background_retries": metrics.background_retries,
        "resumed_after_s": round(resumed_s, 2),
        "all_durable": durable == op.appended + 20_000 and op.error is None,
        "samples": [[round(t, 3), round(r, 1), round(f, 2)] for t, r, f in samples],
    }


def _run_child(name: str, limit_mb: int, fault_s: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.backpressure", "--scenario", name]
    cmd += ["--limit-mb", str(limit_mb), "--fault-s", str(fault_s)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=fault_s + 600)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _plot(runs: dict[str, dict[str, Any]], limit_mb: int, path: Path) -> bool:
    """RSS and bytes in flight over time, one panel per scenario; False without matplotlib."""
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
        ax.plot(t, [s[2] for s in run["samples"]], label="bytes not durable (MiB)")
        ax.axhline(limit_mb, color="grey", linestyle=":", label="in-flight limit")
        ax.set_title(f"{name} DFS")
        ax.set_xlabel("seconds (fault lifted at the end)")
        ax.grid(True, linewidth=0.3)
    axes[0].set_ylabel("MiB")
    axes[0].legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def run(quick: bool, out_dir: Path) -> BenchResult:
    limit_mb = 32 if quick else 100  # 100 MiB: ChangelogConfig's default (Flink's upload.max-in-flight)
    fault_s = 6.0 if quick else 30.0
    runs: dict[str, dict[str, Any]] = {}
    for name in SCENARIOS:
        progress(f"backpressure: {name} DFS for {fault_s:.0f} s, limit {limit_mb} MiB")
        runs[name] = _run_child(name, limit_mb, fault_s)
    metrics: dict[str, Any] = {
        "rss_peak_over_base_mb_stalled": runs["stalled"]["peak_over_base_mb"],
        "rss_peak_over_base_mb_refusing": runs["refusing"]["peak_over_base_mb"],
        "in_flight_limit_mb": limit_mb,
    }
    for name, r in runs.items():
        for key in ("in_flight_peak_mb", "appended_under_fault_mb", "resumed_after_s", "all_durable"):
            metrics[f"{key}_{name}"] = r[key]
    plot = out_dir / "backpressure.png"
    plotted = _plot(runs, limit_mb, plot)
    table = [
        ("in-flight limit", f"{limit_mb} MiB; {fault_s:.0f} s under each fault"),
        *(
            (
                f"{name} DFS",
                f"RSS {r['base_mb']} -> {r['peak_mb']} MiB (+{r['peak_over_base_mb']}), "
                f"not durable peak {r['in_flight_peak_mb']} MiB, appended {r['appended_under_fault_mb']} MiB, "
                f"{r['backpressure_waits']} waits, {r['failed_uploads']} failed uploads, "
                f"resumed {r['resumed_after_s']} s after the fault, all durable: {r['all_durable']}",
            )
            for name, r in runs.items()
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
    parser.add_argument("--limit-mb", type=int, required=True)
    parser.add_argument("--fault-s", type=float, required=True)
    args = parser.parse_args(argv)
    print(json.dumps(scenario(args.scenario, args.limit_mb, args.fault_s)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
