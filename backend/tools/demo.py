"""The standalone demo of the backend, without Spark (the Spark demo is README command 1).

A keyed operator keeps per-user running totals, event counts and per-category sums (value and map
state) at parallelism 4, on the embedded default DFS (a local directory). It checkpoints every
``--checkpoint-every`` events and materializes when the log since the last materialization passes
a size, so the log stays short. The process is then killed (SIGKILL, mid-stream, after its last
checkpoint); a new process restarts the job at parallelism 2 (rescaled through key groups): the
registry is rebuilt from ``chk-*/_metadata``, orphan files are deleted, state is restored from the
latest checkpoint and compared with a batch computation of the input up to that checkpoint; then
it processes the rest of the input and compares again. Ends with PASS or FAIL.

    python -m backend.tools.demo [--dir DIR] [--events N] [--checkpoint-every N]

The checkpoint directory stays for the command line: ``dstl checkpoints list DIR/demo-job``.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from backend.core.descriptors import MapStateDescriptor, ValueStateDescriptor
from backend.core.serializers import Int64Serializer, StrSerializer
from backend.job import JobOptions, LocalJob, OperatorSpec
from materializer.options import MaterializationOptions

JOB = "demo-job"
UID = "user-totals"
TOTAL = ValueStateDescriptor("total", Int64Serializer())
COUNT = ValueStateDescriptor("count", Int64Serializer())
BY_CATEGORY = MapStateDescriptor("by_category", Int64Serializer(), user_key_serializer=StrSerializer())
CATEGORIES = ("books", "music", "games", "food")
State = dict[str, tuple[int, int, dict[str, int]]]


def events(n: int, seed: int = 1) -> list[tuple[str, str, int]]:
    rng = random.Random(seed)
    return [(f"user-{rng.randrange(2000)}", rng.choice(CATEGORIES), rng.randrange(1, 100)) for _ in range(n)]


def batch_result(stream: list[tuple[str, str, int]]) -> State:
    """The same aggregate computed in one pass over the input: what the state must equal."""
    out: State = {}
    for user, category, amount in stream:
        total, count, by = out.get(user, (0, 0, {}))
        out[user] = (total + amount, count + 1, {**by, category: by.get(category, 0) + amount})
    return out


def process(job: LocalJob, stream: list[tuple[str, str, int]]) -> None:
    for user, category, amount in stream:
        backend = job.backend_for(UID, user)
        total, count, by = backend.get_state(TOTAL), backend.get_state(COUNT), backend.get_state(BY_CATEGORY)
        total.update((total.value() or 0) + amount)
        count.update((count.value() or 0) + 1)
        by.put(category, (by.get(category) or 0) + amount)


def read_state(job: LocalJob, users: set[str]) -> State:
    out: State = {}
    for user in sorted(users):
        backend = job.backend_for(UID, user)
        total = backend.get_state(TOTAL).value()
        if total is not None:
            count = backend.get_state(COUNT).value() or 0
            out[user] = (total, count, dict(backend.get_state(BY_CATEGORY).items()))
    return out


def open_job(root: Path, parallelism: int) -> LocalJob:
    options = JobOptions(num_retained=2, materialization=MaterializationOptions(size_trigger_bytes=256 << 10))
    return LocalJob(root / "dfs", JOB, [OperatorSpec(UID, parallelism)], root / "local", options)


def count_files(directory: Path) -> int:
    """Files under ``directory`` now; os.walk skips a directory that subsumption deletes meanwhile."""
    return sum(len(files) for _, _, files in os.walk(directory))


def run_until_killed(root: Path, n: int, every: int) -> None:
    """Phase 1 (a child process): process, checkpoint, materialize, then die by SIGKILL."""
    stream = events(n)
    crash_at = (n * 3 // 4) // every * every + every // 2  # mid-way between two checkpoints
    job = open_job(root, 4)
    print("ckpt  events latency ms log files chunks so far materializations DFS files")
    uploads = 0
    for start in range(0, crash_at, every):
        process(job, stream[start : min(start + every, crash_at)])
        if start + every > crash_at:
            break
        began = time.perf_counter()
        meta = job.checkpoint({"events": start + every})
        latency = (time.perf_counter() - began) * 1000
        log_files = job.storage.metrics.upload_requests - uploads
        uploads = job.storage.metrics.upload_requests
        mats = sum(s.materializer.metrics.completed for s in job.all_subtasks())
        chunks = sum(s.materializer.metrics.chunks_uploaded for s in job.all_subtasks())
        on_dfs = count_files(root / "dfs" / JOB)
        row = (meta.checkpoint_id, start + every, f"{latency:.1f}", log_files, chunks, mats, on_dfs)
        print("{:>4} {:>7} {:>10} {:>9} {:>13} {:>16} {:>9}".format(*row))
    print(
        f"-- killed (SIGKILL) after {crash_at} events; the last {crash_at % every} were never checkpointed", flush=True
    )
    os.kill(os.getpid(), signal.SIGKILL)


def run(root: Path, n: int, every: int) -> bool:
    print(f"DFS (embedded default, a local directory): {root / 'dfs'}")
    print(f"input: {n} events of 2000 users; operator {UID!r} at parallelism 4; checkpoint every {every} events\n")
    child = subprocess.run(
        [sys.executable, "-m", "backend.tools.demo", "--phase", "child", "--dir", str(root), "--events", str(n),
         "--checkpoint-every", str(every)],
        check=False,
    )  # fmt: skip
    if child.returncode != -signal.SIGKILL:
        print(f"FAIL: the first run ended with exit code {child.returncode}, not by SIGKILL")
        return False
    stream = events(n)
    began = time.perf_counter()
    job = open_job(root, 2)
    latest = job.coordinator.latest()
    done = int(latest.properties["events"]) if latest is not None else 0
    restored = read_state(job, {u for u, _, _ in stream})
    print(
        f"\nrestarted at parallelism 2 in {time.perf_counter() - began:.2f} s from checkpoint "
        f"{latest.checkpoint_id if latest else None} (after {done} events)"
    )
    ok = restored == batch_result(stream[:done])
    verdict = "equal" if ok else "DIFFERENT"
    print(f"restored {len(restored)} users; batch computation of the first {done} events: {verdict}")
    process(job, stream[done:])
    meta = job.checkpoint({"events": n})
    final = read_state(job, {u for u, _, _ in stream})
    job.close()
    ok_final = final == batch_result(stream)
    verdict = "equal" if ok_final else "DIFFERENT"
    print(f"processed the remaining {n - done} events, checkpoint {meta.checkpoint_id}: {verdict}")
    print(f"inspect it: dstl checkpoints list {root / 'dfs' / JOB}")
    passed = ok and ok_final
    print("PASS: state after crash, rescale and replay equals the batch computation" if passed else "FAIL")
    return passed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backend.tools.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, help="working directory (default: a new temporary directory, kept)")
    parser.add_argument("--events", type=int, default=40_000)
    parser.add_argument("--checkpoint-every", type=int, default=4_000)
    parser.add_argument("--phase", choices=["all", "child"], default="all", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.checkpoint_every <= 0 or args.events < 2 * args.checkpoint_every:
        parser.error("--checkpoint-every must be positive and --events at least twice as large")
    root = args.dir or Path(tempfile.mkdtemp(prefix="dstl-demo-"))
    if args.phase == "child":
        run_until_killed(root, args.events, args.checkpoint_every)
    return 0 if run(root, args.events, args.checkpoint_every) else 1


if __name__ == "__main__":
    raise SystemExit(main())
