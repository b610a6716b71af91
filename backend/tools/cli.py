"""``dstl``: inspect, verify, convert and read checkpoints and savepoints from the command line.

    dstl checkpoints list JOB_DIR [--json]
    dstl checkpoints inspect PATH
    dstl checkpoints verify PATH [--progress | --no-progress]
    dstl savepoint trigger --from PATH --to DIR [--format canonical|native]
    dstl savepoint dispose SAVEPOINT_DIR
    dstl state read PATH [--operator UID] [--state NAME] [--format jsonl|parquet] [--output FILE]

PATH is a ``chk-<n>`` directory, a savepoint directory or either's ``_metadata`` file (a local
path or a URL such as ``s3://bucket/job/chk-3``). Exit codes: 0 success, 1 an error or a failed
check, 2 a usage error. Errors are one line, ``dstl: error: ...``; set ``DSTL_DEBUG=1`` for the
traceback of an unexpected one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from tqdm import tqdm  # type: ignore[import-untyped, unused-ignore]

from backend.checkpointing.metadata import METADATA_NAME, checkpoint_dir
from backend.checkpointing.savepoints import dispose_savepoint, write_canonical_savepoint, write_native_savepoint
from backend.state.restore import merge_metadata
from backend.tools.errors import CliError
from backend.tools.inspect_state import (
    check_savepoint_target,
    list_checkpoints,
    normalize,
    open_snapshot,
    open_storage,
    remove_partial,
    restore_all,
    restore_subtask,
    summarize,
)
from backend.tools.state_rows import TIMERS_STATE, jsonl_writer, parquet_writer, readers, state_rows
from backend.tools.verify import verify
from dstl import ChangelogError
from dstl.paths import is_local

PROG = "dstl"


class Progress:
    """A ``backend.checkpointing.metadata.Progress`` drawn by tqdm on stderr; silent unless enabled.

    One bar per step (a new total, or a count that starts again): ``what`` is the bar's label.
    """

    def __init__(self, enabled: bool | None) -> None:
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._bar: Any = None

    def __call__(self, what: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        bar = self._bar
        if bar is None or bar.total != total or done <= bar.n:
            self.clear()
            bar = self._bar = tqdm(total=total, file=sys.stderr, leave=False, dynamic_ncols=True)
        bar.set_description_str(what, refresh=False)
        bar.update(done - bar.n)
        if done >= total:
            bar.refresh()  # the last count is drawn even when it came within tqdm's redraw interval

    def clear(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _warn(message: str) -> None:
    print(f"{PROG}: warning: {message}", file=sys.stderr)


# -- checkpoints -----------------------------------------------------------------------------


def cmd_list(args: argparse.Namespace) -> int:
    entries = list_checkpoints(args.job_dir)
    if args.json:
        print(json.dumps(entries, indent=1))
    elif not entries:
        print(f"{PROG}: no completed checkpoints in {normalize(args.job_dir)}", file=sys.stderr)
    for e in [] if args.json else entries:
        if "error" in e:
            print(f"{checkpoint_dir(e['id'])}  ERROR {e['error']}")
            continue
        operators = ",".join(f"{uid}[{p}]" for uid, p in e["operators"].items())
        missing = f"  missing={len(e['missing'])}" if e["missing"] else ""
        print(
            f"{checkpoint_dir(e['id'])}  {e['time']}  {e['kind']}/{e['format']}  operators={operators}  "
            f"files={e['files']}  bytes={e['bytes']}{missing}"
        )
    bad = [e for e in entries if "error" in e]
    for e in bad:
        print(f"{PROG}: error: {checkpoint_dir(e['id'])}: {e['error']}", file=sys.stderr)
    return 1 if bad else 0


def cmd_inspect(args: argparse.Namespace) -> int:
    with open_snapshot(args.path) as snapshot:
        print(json.dumps(summarize(snapshot), indent=1))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    progress = Progress(args.progress)
    with open_snapshot(args.path) as snapshot:
        try:
            result = verify(snapshot, progress)
        finally:
            progress.clear()
    for path, problem in result.problems:
        print(f"BAD {path}: {problem}")
    if not result.ok:
        bad = len({p for p, _ in result.problems})
        print(f"FAILED: {bad} bad or missing files; {result.files} files, {result.bytes} bytes read")
        return 1
    print(f"OK: {result.files} files, {result.bytes} bytes verified")
    return 0


# -- savepoints ------------------------------------------------------------------------------


def cmd_trigger(args: argparse.Namespace) -> int:
    target = normalize(args.to)
    progress = Progress(args.progress)
    with open_snapshot(args.source) as snapshot:
        check_savepoint_target(target, snapshot.base)
        if args.format == "native" and snapshot.meta.format != "native":
            raise CliError(f"{snapshot.metadata_url} is a canonical savepoint: only --format canonical can copy it")
        created = not os.path.exists(target) if is_local(target) else False
        try:
            with open_storage(target) as out, contextlib.ExitStack() as stack:
                if args.format == "native":
                    meta = write_native_savepoint(snapshot.meta, snapshot.storage.files, out.files, progress)
                else:
                    scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="dstl-", dir=args.tmp_dir)))
                    source = snapshot.meta
                    meta = write_canonical_savepoint(
                        restore_all(snapshot, scratch, stack, progress), out.files, checkpoint_id=source.checkpoint_id,
                        job_id=source.job_id, timestamp_ms=source.timestamp_ms, progress=progress,
                    )  # fmt: skip
        except BaseException:
            progress.clear()
            remove_partial(target, created)
            raise
        progress.clear()
    files = len(meta.referenced_files())
    print(f"{args.format} savepoint of {snapshot.meta.kind} {meta.checkpoint_id} written to {target} ({files} files)")
    return 0


def cmd_dispose(args: argparse.Namespace) -> int:
    progress = Progress(args.progress)
    with open_snapshot(args.savepoint_dir) as snapshot:
        if snapshot.where != METADATA_NAME:
            raise CliError(f"{snapshot.metadata_url} is a checkpoint (chk-<n>), not a savepoint: not disposing it")
        if snapshot.meta.kind != "savepoint":
            raise CliError(f"{snapshot.metadata_url} is a {snapshot.meta.kind}, not a savepoint: not disposing it")
        try:
            deleted = dispose_savepoint(snapshot.storage.files, progress)
        finally:
            progress.clear()
    print(f"disposed savepoint {snapshot.base}: {deleted} files deleted")
    return 0


# -- state -----------------------------------------------------------------------------------


def _pick(what: str, wanted: str | None, available: list[str]) -> str | None:
    if wanted is not None and wanted not in available:
        raise CliError(f"{what} {wanted!r} is not in the snapshot; it has: {', '.join(available) or 'none'}", 2)
    return wanted


@contextlib.contextmanager
def _output(path: str | None, binary: bool) -> Iterator[IO[Any]]:
    if path is None:
        yield sys.stdout.buffer if binary else sys.stdout
        return
    try:
        with open(path, "wb" if binary else "w", encoding=None if binary else "utf-8") as f:
            yield f
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise


def cmd_read(args: argparse.Namespace) -> int:
    if args.format == "parquet" and args.output is None:
        raise CliError("--format parquet needs --output FILE", 2)
    with open_snapshot(args.path) as snapshot:
        operators = sorted(snapshot.meta.operators)
        uid = _pick("operator", args.operator, operators)
        if uid is None and len(operators) != 1:
            raise CliError(
                f"the snapshot has operators {', '.join(operators) or 'none'}: choose one with --operator", 2
            )
        uid = uid or operators[0]
        handles = snapshot.handles(uid)
        metadata: dict[str, dict[str, Any]] = {}
        for handle in handles:  # the union of the subtasks' schema versions, as a restore of all
            merge_metadata(metadata, handle.states)
        names = sorted(n for n, m in metadata.items() if not m.get("dropped"))
        state = _pick("state", args.state, [*names, TIMERS_STATE])
        want = readers(uid, metadata, [state] if state is not None else [*names, TIMERS_STATE], _warn)
        write = parquet_writer if args.format == "parquet" else jsonl_writer
        with (
            tempfile.TemporaryDirectory(prefix="dstl-", dir=args.tmp_dir) as scratch,
            _output(args.output, args.format == "parquet") as out,
            write(out) as emit,
        ):
            for index in range(len(handles)):
                backend = restore_subtask(snapshot, uid, handles, index, Path(scratch))
                try:
                    for row in state_rows(backend, want):
                        emit(row)
                finally:
                    backend.close()
                    shutil.rmtree(backend.tables.path, ignore_errors=True)
    return 0


# -- the parser ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Inspect, verify, convert and read checkpoints and savepoints of the changelog state backend.",
        epilog="PATH: a chk-<n> directory, a savepoint directory or a _metadata file (local path or URL). "
        "Exit codes: 0 ok, 1 error or failed check, 2 usage error.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    groups = parser.add_subparsers(dest="group", metavar="{checkpoints,savepoint,state}")

    def command(sub: Any, name: str, summary: str, detail: str, run: Callable[[argparse.Namespace], int]) -> Any:
        p = sub.add_parser(name, help=summary, description=f"{summary} {detail}".strip())
        p.set_defaults(run=run)
        return p

    def progress_flag(p: argparse.ArgumentParser) -> None:
        p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                       help="show a progress bar on stderr (default: only when stderr is a terminal)")  # fmt: skip

    chk = groups.add_parser("checkpoints", help="list, inspect and verify checkpoints").add_subparsers(
        dest="command", metavar="{list,inspect,verify}", required=True
    )
    p = command(chk, "list", "List the completed checkpoints of a job directory, oldest first.",
                "One line per chk-<n>/_metadata: id, time (UTC), kind/format, operators[parallelism], "
                "number of referenced files and their total bytes.", cmd_list)  # fmt: skip
    p.add_argument("job_dir", metavar="JOB_DIR", help="the job directory (<root>/<job>)")
    p.add_argument("--json", action="store_true", help="print a JSON list instead")
    p = command(chk, "inspect", "Print a JSON summary of a checkpoint or savepoint.",
                "Id, kind, format, job, per operator its max parallelism and per subtask its key groups, states, "
                "materialized chunks and changelog; every referenced file with its size.", cmd_inspect)  # fmt: skip
    p.add_argument("path", metavar="PATH")
    p = command(chk, "verify", "Read and check every file a checkpoint or savepoint references.",
                "Log files and chunks are fully decoded and checksummed, every referenced segment is checked "
                "against its file; every bad or missing file is reported. Exit 1 if any.", cmd_verify)  # fmt: skip
    p.add_argument("path", metavar="PATH")
    progress_flag(p)

    sp = groups.add_parser("savepoint", help="make savepoints from checkpoints offline, dispose of them")
    sp_sub = sp.add_subparsers(dest="command", metavar="{trigger,dispose}", required=True)
    p = command(sp_sub, "trigger", "Write a savepoint from a completed checkpoint, without a running job.",
                "native: the checkpoint's files copied with its handles; canonical: every subtask restored and "
                "dumped as one chunk of all its state (restorable at any parallelism by any reader of the "
                "chunk format). The target must be new or empty.", cmd_trigger)  # fmt: skip
    p.add_argument("--from", dest="source", metavar="PATH", required=True, help="the checkpoint (or savepoint)")
    p.add_argument("--to", metavar="DIR", required=True, help="the new savepoint directory")
    p.add_argument("--format", choices=("canonical", "native"), default="canonical", help="default: canonical")
    p.add_argument("--tmp-dir", metavar="DIR", help="scratch space for the canonical restore (default: system temp)")
    progress_flag(p)
    p = command(sp_sub, "dispose", "Delete a savepoint: its _metadata first, then every file it references.",
                "Refuses a checkpoint directory.", cmd_dispose)  # fmt: skip
    p.add_argument("savepoint_dir", metavar="SAVEPOINT_DIR")
    progress_flag(p)

    st = groups.add_parser("state", help="read the keyed state of a snapshot")
    st_sub = st.add_subparsers(dest="command", metavar="{read}", required=True)
    p = command(st_sub, "read", "Dump the keyed state of one operator of a checkpoint or savepoint, one row per entry.",
                "Columns: operator, state, kind, key_group, key, user_key (map states; the time domain of a "
                "timer), value (list states: the list), ttl_expiry_ms. Values are decoded with the serializers "
                "recorded in the snapshot; pickle and unknown serializers are never run: their bytes are shown "
                'as {"$raw": hex} (bytes values as {"$bytes": hex}). Timers are the state "_timers". '
                "In parquet, key, user_key and value hold JSON text.", cmd_read)  # fmt: skip
    p.add_argument("path", metavar="PATH")
    p.add_argument("--operator", metavar="UID", help="the operator uid (optional if the snapshot has only one)")
    p.add_argument("--state", metavar="NAME", help=f"only this state ({TIMERS_STATE} for the timers)")
    p.add_argument("--format", choices=("jsonl", "parquet"), default="jsonl", help="default: jsonl")
    p.add_argument("--output", metavar="FILE", help="write here instead of stdout (required for parquet)")
    p.add_argument("--tmp-dir", metavar="DIR", help="scratch space for the restore (default: system temp)")
    return parser


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("dstl-state-backend")
    except Exception:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, usage errors (2)
        return exc.code if isinstance(exc.code, int) else 2
    if getattr(args, "run", None) is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        code: int = args.run(args)
        return code
    except CliError as exc:
        message, code = str(exc), exc.code
    except ChangelogError as exc:  # every error we raise on purpose: checkpoint, restore, log, chunk
        message, code = str(exc), 1
    except BrokenPipeError:  # stdout closed early (| head): not an error
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:  # FileNotFoundError, permissions, a full disk
        if exc.filename is not None and exc.strerror:
            message = f"{exc.filename}: {exc.strerror.lower()}"
        else:
            message = str(exc) or type(exc).__name__
        code = 1
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if os.environ.get("DSTL_DEBUG"):
            raise
        message, code = f"unexpected {type(exc).__name__}: {exc} (DSTL_DEBUG=1 shows the traceback)", 1
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
