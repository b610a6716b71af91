"""Memory and DFS files of a ``LocalJob`` running for a long time: does anything grow without bound?

A long-running service leaks slowly: a set of paths that only grows, a buffer kept per failed call,
a reference cycle per checkpoint. None of it shows in a test of a few checkpoints, so this runs one
job under a steady load for a long time (30 minutes in full mode) and watches what should level off:

- one operator (2 subtasks) updates a value and a map state per event over a fixed key space, at a
  fixed event rate, so the live state stops growing once every key was touched;
- the same thread checkpoints every ``checkpoint_s`` (as a Spark micro-batch commits), and the
  periodic materializer snapshots the tables every ``materialize_s``, so log files and chunks are
  written and deleted all the time;
- the DFS is a local directory behind ``faulty://`` with light faults by default: now and then one
  PUT, DELETE or existence check fails or is slowed down, which sends the run through the retry,
  abort and deferred-deletion paths where leaks hide (a failed checkpoint is counted, not fatal);
- a sampler thread records the RSS, the bytes not yet durable (``storage.metrics``), the files on
  the DFS and the files the storage tracks.

Warm-up is the first ``WARMUP_FRACTION`` of the run (the key space filled, the first
materializations done, the allocator's arenas grown). The headline metric
``rss_growth_after_warmup`` is the mean RSS of the last quarter after warm-up over that of the
first quarter: 1.0 is flat. ``dfs_files_first_quarter`` and ``dfs_files_last_quarter`` say the same
of the DFS. The job runs in a fresh interpreter (``python -m benchmarks.soak``), so memory an
earlier benchmark of ``python -m benchmarks all`` left behind neither inflates nor hides the
growth. A PNG of the three series is written when matplotlib (the ``bench`` extra) is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from backend.core.descriptors import MapStateDescriptor, ValueStateDescriptor
from backend.core.serializers import Int64Serializer, StrSerializer
from backend.job import JobOptions, LocalJob, OperatorSpec
from benchmarks.common import BenchResult, MiB, progress, rss_mb, save_figure
from benchmarks.support.faulty_fs import Action, Fault, FaultPlan, Op, faulty_base_path
from dstl import ChangelogError
from dstl.atomic import is_temporary
from materializer.options import MaterializationOptions

__all__ = ["FULL", "QUICK", "SoakSettings", "run", "soak", "summarize"]

WARMUP_FRACTION = 0.2
OPERATOR = "op"
COUNT = ValueStateDescriptor("count", Int64Serializer())
LAST = MapStateDescriptor("last", Int64Serializer(), user_key_serializer=StrSerializer())
#: the map's user keys, taken in turn: each key's map holds at most this many entries, so the state
#: stops growing once every key had a few events (about 14 per key by the end of warm-up)
_SLOTS = tuple(f"s{i}" for i in range(4))
#: events between two looks at the clock (pacing, checkpoints, materializer polls)
_BATCH = 200
#: at most this much lag is made up by running faster; beyond it the schedule moves on
_MAX_LAG_S = 1.0
_FAULT_OPS: tuple[Op, ...] = ("put", "put", "put", "delete", "delete", "exists")


@dataclass(frozen=True)
class SoakSettings:
    seconds: float
    keys: int
    #: events per second (each: a value read and update, a map put)
    rate: int
    checkpoint_s: float
    materialize_s: float
    sample_s: float
    #: one injected fault (a failed or delayed DFS call) per this many seconds; None: no faults
    fault_every_s: float | None
    seed: int = 16


QUICK = SoakSettings(
    seconds=90, keys=5_000, rate=4_000, checkpoint_s=2, materialize_s=10, sample_s=0.25, fault_every_s=2
)
FULL = SoakSettings(
    seconds=1800, keys=100_000, rate=4_000, checkpoint_s=5, materialize_s=60, sample_s=1, fault_every_s=5
)


def _count_files(directory: Path) -> int:
    """The job's files under ``directory`` (a write's temporary is not one)."""
    return sum(1 for _, _, files in os.walk(directory) for name in files if not is_temporary(name))


class _Sampler:
    """Samples ``(t, RSS MiB, bytes not durable MiB, DFS files, tracked files)`` every ``period_s``."""

    def __init__(self, job: LocalJob, dfs_dir: Path, period_s: float, start: float) -> None:
        self.samples: list[tuple[float, float, float, int, int]] = []
        self._job, self._dfs_dir, self._period_s, self._start = job, dfs_dir, period_s, start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        metrics = self._job.storage.metrics
        while not self._stop.wait(self._period_s):
            self.samples.append(
                (
                    time.monotonic() - self._start,
                    rss_mb(),
                    metrics.bytes_in_flight / MiB,
                    _count_files(self._dfs_dir),
                    len(self._job.storage.tracked_files()),
                )
            )

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class _FaultInjector:
    """Adds a single-shot fault every ``every_s`` (a failed or slowed PUT, DELETE or existence check),
    unless a fault of that op is still waiting for its call.

    Spent rules are dropped, and so is ``plan.calls`` (the plan logs every call): both are the
    harness' books, which would otherwise grow with the run and show up as the job's memory.
    """

    def __init__(self, plan: FaultPlan, every_s: float, seed: int) -> None:
        self.plan, self.injected, self.hit = plan, 0, 0
        self._every_s, self._rng = every_s, random.Random(seed)
        self._live: list[tuple[Fault, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-faults", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        rng = self._rng
        while not self._stop.wait(self._every_s):
            now = time.monotonic()
            keep = []
            for fault, added in self._live:
                hits = self.plan.hits(fault)
                if hits or now - added > 60 * self._every_s:  # an op the job stopped making
                    self.plan.remove(fault)
                    self.hit += hits
                else:
                    keep.append((fault, added))
            op = rng.choice(_FAULT_OPS)
            action: Action = "fail" if rng.random() < 0.7 else "delay"
            # One live rule per op: two armed rules would hit consecutive calls, i.e. the retries of
            # one call, and turn a light fault into a call that fails for good.
            if all(f.op != op for f, _ in keep):
                fault = Fault(op=op, action=action, times=1, after=rng.randrange(3), delay_s=0.3)
                keep.append((self.plan.add(fault), now))
                self.injected += 1
            self._live = keep
            self.plan.calls.clear()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.hit += sum(self.plan.hits(f) for f, _ in self._live)  # before clear() forgets them
        self.plan.clear()


def _note(errors: list[str], now: float, exc: BaseException) -> None:
    if len(errors) < 10:  # the first few say what went wrong; the counts say how often
        errors.append(f"{now:.1f} s: {type(exc).__name__}: {exc}")


def soak(settings: SoakSettings, workdir: Path, report_every_s: float = 60.0) -> dict[str, Any]:
    """Run the job for ``settings.seconds`` in this process; the raw run (samples, counts, errors)."""
    plan = FaultPlan()
    dfs_dir = workdir / "dfs"
    root = faulty_base_path(dfs_dir, plan) if settings.fault_every_s else str(dfs_dir)
    options = JobOptions(
        num_retained=2,
        materialization=MaterializationOptions(
            interval_ms=int(settings.materialize_s * 1000), size_trigger_bytes=None, max_failures_allowed=10
        ),
    )
    job = LocalJob(root, "soak", [OperatorSpec(OPERATOR, 2)], workdir / "local", options)
    states = {id(s.backend): (s.backend.get_state(COUNT), s.backend.get_state(LAST)) for s in job.all_subtasks()}
    rng = random.Random(settings.seed)
    errors: list[str] = []
    failed_checkpoints = completed_checkpoints = events = skipped = 0
    start = time.monotonic()
    sampler = _Sampler(job, dfs_dir / "soak", settings.sample_s, start)
    faults = _FaultInjector(plan, settings.fault_every_s, settings.seed) if settings.fault_every_s else None
    next_checkpoint = settings.checkpoint_s
    next_report = report_every_s
    try:
        while (now := time.monotonic() - start) < settings.seconds:
            due = now * settings.rate - events - skipped  # events behind the schedule
            if due > _MAX_LAG_S * settings.rate:  # too far behind: move the schedule on
                skipped += int(due - _MAX_LAG_S * settings.rate)
            elif due < _BATCH:
                time.sleep((_BATCH - due) / settings.rate)
            for _ in range(_BATCH):
                key = rng.randrange(settings.keys)
                backend = job.backend_for(OPERATOR, key)
                count, last = states[id(backend)]
                n = count.value() or 0
                count.update(n + 1)
                last.put(_SLOTS[n & 3], events)  # a key's map is full after its first 4 events
                events += 1
            if now >= next_checkpoint:
                next_checkpoint = now + settings.checkpoint_s
                try:
                    job.checkpoint({"events": events})
                    completed_checkpoints += 1
                except ChangelogError as exc:  # under faults: counted, and the job goes on (as Flink's)
                    failed_checkpoints += 1
                    _note(errors, now, exc)
            try:
                job.poll_materialization()
            except ChangelogError as exc:  # more failed materializations in a row than allowed
                _note(errors, now, exc)
            if now >= next_report:
                next_report += report_every_s
                progress(f"soak: {now:.0f} s, RSS {rss_mb():.1f} MiB, {completed_checkpoints} checkpoints")
    finally:
        elapsed = time.monotonic() - start  # the run itself; closing the job is not part of it
        sampler.stop()
        if faults is not None:
            faults.stop()
        materializations = sum(s.materializer.metrics.completed for s in job.all_subtasks())
        materializations_failed = sum(s.materializer.metrics.failed for s in job.all_subtasks())
        job.close()
        plan.close()
    return {
        "settings": asdict(settings),
        "elapsed_s": round(elapsed, 2),
        "events": events,
        "events_per_s": round(events / elapsed),
        "lag_dropped_s": round(skipped / settings.rate, 2),
        "checkpoints_completed": completed_checkpoints,
        "checkpoints_failed": failed_checkpoints,
        "materializations_completed": materializations,
        "materializations_failed": materializations_failed,
        "faults_injected": faults.injected if faults else 0,
        "faults_hit": faults.hit if faults else 0,
        "errors": errors,
        "samples": [[round(t, 2), round(r, 2), round(f, 3), n, k] for t, r, f, n, k in sampler.samples],
    }


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _quarters(raw: dict[str, Any]) -> tuple[float, list[list[float]], list[list[float]]]:
    """The end of warm-up (s) and the samples of the first and last quarter after it."""
    samples = raw["samples"]
    warm = WARMUP_FRACTION * raw["elapsed_s"]
    after = [s for s in samples if s[0] >= warm] or samples
    n = max(1, len(after) // 4)  # samples are evenly spaced: a quarter by count is a quarter by time
    return warm, after[:n], after[-n:]


def summarize(raw: dict[str, Any], plot: Path | None = None) -> BenchResult:
    """The benchmark's result from a raw run of ``soak``; writes the PNG to ``plot`` if given."""
    samples, cfg = raw["samples"], raw["settings"]
    warm, first, last = _quarters(raw)
    col = {"rss": 1, "in_flight": 2, "dfs": 3, "tracked": 4}
    q1 = {name: _mean([s[i] for s in first]) for name, i in col.items()}
    q4 = {name: _mean([s[i] for s in last]) for name, i in col.items()}
    total = raw["elapsed_s"]
    timeline = []
    for k in range(8):
        lo, hi = k * total / 8, (k + 1) * total / 8
        part = [s for s in samples if lo <= s[0] < hi]
        if part:
            timeline.append({
                "from_s": round(lo), "to_s": round(hi),
                "rss_mean_mb": round(_mean([s[1] for s in part]), 1),
                "in_flight_max_mb": round(max(s[2] for s in part), 2),
                "dfs_files_mean": round(_mean([s[3] for s in part]), 1),
                "tracked_files_mean": round(_mean([s[4] for s in part]), 1),
            })  # fmt: skip
    metrics: dict[str, Any] = {
        "rss_growth_after_warmup": round(q4["rss"] / q1["rss"], 4),
        "rss_first_quarter_mb": round(q1["rss"], 1),
        "rss_last_quarter_mb": round(q4["rss"], 1),
        "rss_start_mb": samples[0][1] if samples else None,
        "rss_peak_mb": max((s[1] for s in samples), default=None),
        "dfs_files_first_quarter": round(q1["dfs"], 1),
        "dfs_files_last_quarter": round(q4["dfs"], 1),
        "tracked_files_first_quarter": round(q1["tracked"], 1),
        "tracked_files_last_quarter": round(q4["tracked"], 1),
        "in_flight_mean_mb": round(_mean([s[2] for s in samples]), 3),
        "in_flight_max_mb": max((s[2] for s in samples), default=None),
        "warmup_s": round(warm, 1),
    }
    for key in ("events_per_s", "checkpoints_completed", "checkpoints_failed", "materializations_completed",
                "materializations_failed", "faults_injected", "faults_hit"):  # fmt: skip
        metrics[key] = raw[key]
    plotted = plot is not None and _plot(raw, warm, metrics["rss_growth_after_warmup"], plot)
    checkpoints = raw["checkpoints_completed"] + raw["checkpoints_failed"]
    faults = (
        f"one every {cfg['fault_every_s']:g} s: {raw['faults_injected']} injected, {raw['faults_hit']} hit; "
        f"{raw['checkpoints_failed']} of {checkpoints} checkpoints and "
        f"{raw['materializations_failed']} materializations failed"
        if cfg["fault_every_s"]
        else "none"
    )
    table = [
        ("run", f"{total:.0f} s, {cfg['keys']:,} keys, {raw['events_per_s']:,} events/s (target {cfg['rate']:,}), "
                f"checkpoint every {cfg['checkpoint_s']:g} s, materialization every {cfg['materialize_s']:g} s"),
        ("work", f"{raw['checkpoints_completed']} checkpoints, {raw['materializations_completed']} materializations"),
        ("faults", faults),
        *((f"{t['from_s']}-{t['to_s']} s",
           f"RSS {t['rss_mean_mb']} MiB, not durable max {t['in_flight_max_mb']} MiB, "
           f"{t['dfs_files_mean']} DFS files, {t['tracked_files_mean']} tracked") for t in timeline),
        ("RSS after warm-up", f"first quarter {q1['rss']:.1f} MiB, last quarter {q4['rss']:.1f} MiB: "
                              f"growth {metrics['rss_growth_after_warmup']} (warm-up: to {warm:.0f} s)"),
        ("DFS files", f"first quarter {q1['dfs']:.1f}, last quarter {q4['dfs']:.1f}; "
                      f"tracked {q1['tracked']:.1f} -> {q4['tracked']:.1f}"),
    ]  # fmt: skip
    step = max(1, -(-len(samples) // 400))  # at most ~400 points in the JSON, enough to plot again
    details = {k: v for k, v in raw.items() if k != "samples"}
    details["timeline"] = timeline
    details["samples"] = {"columns": ["t_s", "rss_mb", "in_flight_mb", "dfs_files", "tracked_files"],
                          "rows": samples[::step]}  # fmt: skip
    return BenchResult(name="soak", metrics=metrics, table=table, details=details,
                       plots=[str(plot)] if plot is not None and plotted else [])  # fmt: skip


def _plot(raw: dict[str, Any], warm: float, growth: float, path: Path) -> bool:
    """RSS, bytes not durable and files over time, warm-up shaded; False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = raw["samples"]
    t = [s[0] for s in samples]
    fig, axes = plt.subplots(3, 1, figsize=(9, 7.5), sharex=True)
    axes[0].plot(t, [s[1] for s in samples], linewidth=0.8)
    axes[0].set_ylabel("RSS (MiB)")
    axes[1].plot(t, [s[2] for s in samples], linewidth=0.8, color="tab:orange")
    axes[1].set_ylabel("not durable (MiB)")
    axes[2].plot(t, [s[3] for s in samples], linewidth=0.8, color="tab:green", label="files on the DFS")
    axes[2].plot(t, [s[4] for s in samples], linewidth=0.8, color="tab:red", label="files tracked")
    axes[2].set_ylabel("files")
    axes[2].legend(loc="upper left")
    axes[2].set_xlabel("seconds")
    for ax in axes:
        ax.axvspan(0, warm, color="grey", alpha=0.15, linewidth=0)
        ax.grid(True, linewidth=0.3)
        ax.set_ylim(bottom=0)
    axes[0].set_title(f"soak: RSS last / first quarter after warm-up (shaded): {growth:.3f}")
    save_figure(fig, path)
    return True


def run(quick: bool, out_dir: Path) -> BenchResult:
    settings = QUICK if quick else FULL
    progress(
        f"soak: {settings.seconds:.0f} s in a fresh interpreter, {settings.rate:,} events/s over "
        f"{settings.keys:,} keys, light faults"
    )
    cmd = [sys.executable, "-m", "benchmarks.soak", *(["--quick"] if quick else [])]
    # stdout carries the raw run as one JSON line; stderr (progress) goes through to the terminal
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True, timeout=settings.seconds + 600)
    raw: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return summarize(raw, out_dir / "soak.png")


def main(argv: list[str] | None = None) -> int:
    """The child process: runs the job and prints the raw run as one JSON line."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.soak", description="The soak benchmark's child: one run, printed as JSON."
    )
    parser.add_argument("--quick", action="store_true", help="the quick settings (about 90 s)")
    parser.add_argument("--seconds", type=float, help="run this long instead")
    parser.add_argument("--no-faults", action="store_true", help="a DFS without injected faults")
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    if args.seconds is not None:
        settings = replace(settings, seconds=args.seconds)
    if args.no_faults:
        settings = replace(settings, fault_every_s=None)
    with tempfile.TemporaryDirectory(prefix="dstl-soak-") as tmp:
        raw = soak(settings, Path(tmp))
    print(json.dumps(raw))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
