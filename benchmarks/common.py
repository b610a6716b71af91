"""The benchmark runner's shared parts: the result type, printing, JSON and progress."""

from __future__ import annotations

import json
import os
import platform
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RESULTS_DIR = Path("results")
MiB = 1 << 20
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass
class BenchResult:
    name: str
    metrics: dict[str, Any]
    table: list[tuple[str, str]] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    plots: list[str] = field(default_factory=list)

    def to_json(self, quick: bool, seconds: float) -> dict[str, Any]:
        return {
            "benchmark": self.name,
            "quick": quick,
            "seconds": round(seconds, 2),
            "python": sys.version.split()[0],
            "machine": platform.machine(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "metrics": self.metrics,
            "details": self.details,
            "plots": self.plots,
        }


def print_table(result: BenchResult) -> None:
    width = max((len(k) for k, _ in result.table), default=10)
    print(f"\n== {result.name} ==")
    for key, value in result.table:
        print(f"  {key:<{width}}  {value}")
    for plot in result.plots:
        print(f"  plot: {plot}")


def write_json(result: BenchResult, path: Path, quick: bool, seconds: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result.to_json(quick, seconds), indent=2) + "\n")


def progress(message: str) -> None:
    """One line of progress on stderr, so that stdout keeps only the result tables."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default) of unsorted values."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def rss_mb() -> float:
    """This process' resident set size now, MiB (from ``/proc/self/statm``; no psutil needed)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE / MiB
    except OSError:  # not Linux: the peak so far is the best there is
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def save_figure(fig: Any, path: Path) -> None:
    """Write a matplotlib figure as the benchmark's PNG and free it."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt  # only called where matplotlib is installed

    plt.close(fig)


def run_available_now(out: Any, sink: Any, work: Path, output_mode: str = "append") -> Any:
    """Run the streaming DataFrame ``out`` over every input available now (``availableNow``) into
    the ``foreachBatch`` ``sink``, its checkpoint under ``work``; returns the ended query."""
    query = (
        out.writeStream.foreachBatch(sink)
        .outputMode(output_mode)
        .option("checkpointLocation", str(work / "spark-chk"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    return query
