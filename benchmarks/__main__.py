"""``python -m benchmarks NAME [--quick] [--json PATH]``; NAME ``all`` runs every benchmark."""

from __future__ import annotations

import argparse
import importlib
import time
from pathlib import Path

from benchmarks.common import RESULTS_DIR, print_table, progress, write_json

BENCHMARKS = {
    "append": "benchmarks.append",
    "batching": "benchmarks.batching",
    "throughput": "benchmarks.throughput",
    "hedging": "benchmarks.hedging",
    "state": "benchmarks.state",
    "recovery": "benchmarks.recovery",
    "recovery-spark": "benchmarks.recovery_spark",
    "state-source": "benchmarks.state_source",
    "space": "benchmarks.space",
    "incremental": "benchmarks.incremental",
    "spark": "benchmarks.spark",
    "executors": "benchmarks.executors",
    "backpressure": "benchmarks.backpressure",
    "soak": "benchmarks.soak",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("name", choices=[*BENCHMARKS, "all"])
    parser.add_argument("--quick", action="store_true", help="smaller sizes; a minute or two at most")
    parser.add_argument("--json", type=Path, help="where to write the JSON result (default results/NAME.json)")
    args = parser.parse_args(argv)
    names = list(BENCHMARKS) if args.name == "all" else [args.name]
    for name in names:
        module = importlib.import_module(BENCHMARKS[name])
        progress(f"benchmark {name} ({'quick' if args.quick else 'full'})")
        start = time.perf_counter()
        result = module.run(quick=args.quick, out_dir=RESULTS_DIR)
        seconds = time.perf_counter() - start
        print_table(result)
        path = args.json if args.json and len(names) == 1 else RESULTS_DIR / f"{name}.json"
        write_json(result, path, args.quick, seconds)
        print(f"  json: {path}  ({seconds:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
