"""Write the fixture ``tests/fixtures/12e5607``: a checkpoint of row-schema states made by the code
before state schema changes were supported (commit 12e5607), which today's code restores under an
evolved schema (``tests/test_fixture_schema_change.py``).

How the fixture was made (the code that writes it must be the old one, so run it from a worktree of
that commit, with PYTHONPATH pointing there; it records the commit it ran on)::

    git worktree add /work/wt/old12 12e5607
    cd /work/wt/old12
    PYTHONPATH=/work/wt/old12 /work/main/.venv/bin/python <checkout>/tests/support/write_schema_fixture.py \\
        /tmp/fixture-12e5607 /tmp/fixture-scratch
    cp -r /tmp/fixture-12e5607 <checkout>/tests/fixtures/12e5607
    git worktree remove /work/wt/old12

It uses only what both codes have (``LocalJob``, descriptors, row serializers), so it also runs on
today's code, which is how it is checked to stay runnable; a fixture written by today's code is not
the fixture (``expected.json`` says which commit wrote it).

The job ``fixture-job`` has one operator ``op`` at parallelism 2, max parallelism 8, and three
states of rows: ``acc`` (value state), ``events`` (list state with a TTL far beyond any test) and
``attrs`` (map state, str user keys). Round 1 writes every key, a checkpoint and a materialization
follow; round 2 changes some keys, and checkpoint 2 holds the chunks of round 1 and the log of
round 2. ``expected.json``: each state's values per key, as JSON (rows as lists, in the old
schema's field order), and the old schemas' field names.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import backend
from backend import ListStateDescriptor, MapStateDescriptor, StateTtl, StrSerializer, ValueStateDescriptor
from backend.core.serializers import Int64Serializer, OptionalSerializer, RowSerializer
from backend.job import JobOptions, LocalJob, OperatorSpec
from materializer.options import MaterializationOptions

JOB, UID, PARALLELISM, MAX_PARALLELISM = "fixture-job", "op", 2, 8
T0 = 1_700_000_000_000  # the processing-time clock while writing: TTL expiries derive from it
TTL_MS = 200 * 365 * 24 * 3600 * 1000  # nothing expires when the fixture is read
KEYS = [f"k{i:02d}" for i in range(10)]
OPT_I64, OPT_STR = OptionalSerializer(Int64Serializer()), OptionalSerializer(StrSerializer())
#: the old schemas: a nullable field each test removes (``gone``), a NOT NULL one (``n``)
ACC = ValueStateDescriptor("acc", RowSerializer([("total", OPT_I64), ("label", OPT_STR), ("gone", OPT_I64)]))
EVENTS = ListStateDescriptor(
    "events", RowSerializer([("kind", OPT_STR), ("n", Int64Serializer())]), ttl=StateTtl(TTL_MS)
)
ATTRS = MapStateDescriptor("attrs", RowSerializer([("v", OPT_I64)]), user_key_serializer=StrSerializer())


def commit_of(code: Path) -> str:
    """The commit of the checkout ``code`` is in ("unknown" outside a git checkout)."""
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=code, capture_output=True, text=True, timeout=30)
    except OSError:
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 else "unknown"


def write(out: Path, scratch: Path) -> dict[str, Any]:
    """Write the checkpoint under ``out`` (every path in it relative to ``out``) and return the
    expected state."""
    model: dict[str, dict[str, Any]] = {"acc": {}, "events": {}, "attrs": {}}
    options = JobOptions(materialization=MaterializationOptions(interval_ms=10**12, size_trigger_bytes=None))
    job = LocalJob("checkpoints", JOB, [OperatorSpec(UID, PARALLELISM, MAX_PARALLELISM)], scratch, options)
    try:
        for subtask in job.all_subtasks():
            subtask.backend.now_ms = lambda: T0
        for i, key in enumerate(KEYS):  # round 1: every key
            b = job.backend_for(UID, key)
            acc = (i * 10, f"L{i}", -i if i % 2 else None)
            b.get_state(ACC).update(acc)
            model["acc"][key] = list(acc)
            events = [("start", i), (None, i + 1)]
            b.get_state(EVENTS).update(events)
            model["events"][key] = [list(e) for e in events]
            b.get_state(ATTRS).put_all({"a": (i,), "b": (None,)})
            model["attrs"][key] = {"a": [i], "b": [None]}
        job.checkpoint()
        for subtask in job.all_subtasks():
            subtask.materializer.trigger()
            subtask.materializer.wait(60)
            assert subtask.materializer.metrics.completed == 1
        for i, key in enumerate(KEYS[::3]):  # round 2: only in the log after the materialization
            b = job.backend_for(UID, key)
            b.get_state(ACC).update((i, None, 7))
            model["acc"][key] = [i, None, 7]
            b.get_state(EVENTS).add(("more", -i))
            model["events"][key].append(["more", -i])
            b.get_state(ATTRS).remove("b")
            b.get_state(ATTRS).put("c", (100 + i,))
            model["attrs"][key].pop("b")
            model["attrs"][key]["c"] = [100 + i]
        b = job.backend_for(UID, KEYS[1])
        b.get_state(ACC).clear()
        del model["acc"][KEYS[1]]
        meta = job.checkpoint()
        assert all(handle.materialized and handle.changelog for handle in meta.handles(UID))
    finally:
        job.close()
    return {
        "written_by": commit_of(Path(backend.__file__).parent),
        "job": JOB,
        "operator": {"uid": UID, "parallelism": PARALLELISM, "max_parallelism": MAX_PARALLELISM},
        "checkpoint": f"checkpoints/{JOB}/chk-{meta.checkpoint_id}",
        "clock_ms": T0,
        "ttl_ms": TTL_MS,
        "fields": {"acc": ["total", "label", "gone"], "events": ["kind", "n"], "attrs": ["v"]},
        "state": model,
    }


def main(argv: list[str]) -> int:
    out, scratch = Path(argv[0]).resolve(), Path(argv[1]).resolve()
    print("writing with the code of", backend.__file__, file=sys.stderr)
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(scratch, ignore_errors=True)
    out.mkdir(parents=True)
    os.chdir(out)  # the job's root is given relative: nothing absolute can be recorded
    expected = write(out, scratch)
    shutil.rmtree(scratch)
    (out / "expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
