"""An fsspec file system ("faulty://") over a local directory that injects the faults of a plan.

Tests reach a store's failure modes (refused, stalled, slow or trickled calls, a write that lands
after its client gave up) without patching our code: ``faulty_base_path`` gives a base path any
``ChangelogConfig`` accepts, and our ``FsspecUploader`` goes through it like through any remote
fsspec store (its protocol is not "file", so writes go through ``pipe_file``).

The URL is ``faulty://<token>/<absolute dir>``; the token names a live plan in a registry of weak
references, so a plan lives exactly as long as the test keeps it. Paths keep the token, which lets
one cached file system instance serve every plan. Object-store semantics are kept where tests
count on them: a write appears whole or not at all (``dstl.atomic``; its temporaries are
never listed) and deleting a file removes the directories it leaves empty.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import os
import secrets
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

import fsspec
from fsspec.spec import AbstractFileSystem

from benchmarks.support.fault_plan import Action, Fault, FaultPlan, Op, StallEnded, close_all_plans
from dstl.atomic import is_temporary, write_atomically

__all__ = [
    "PROTOCOL",
    "Action",
    "Fault",
    "FaultPlan",
    "FaultyFileSystem",
    "Op",
    "StallEnded",
    "close_all_plans",
    "faulty_base_path",
]

PROTOCOL = "faulty"
_PREFIX = f"{PROTOCOL}://"
#: pacing granularity of trickled transfers
_TRICKLE_STEP_S = 0.05

T = TypeVar("T")

_registry: dict[str, tuple[weakref.ref[FaultPlan], str]] = {}
_registry_lock = threading.Lock()


def faulty_base_path(directory: str | os.PathLike[str], plan: FaultPlan) -> str:
    """A ``faulty://`` base path over ``directory`` whose calls get ``plan``'s faults."""
    base = str(Path(directory).resolve())
    os.makedirs(base, exist_ok=True)
    token = secrets.token_hex(8)
    with _registry_lock:
        _registry[token] = (weakref.ref(plan), base)
    weakref.finalize(plan, _forget, token)
    return f"{_PREFIX}{token}{base}"


def _forget(token: str) -> None:
    with _registry_lock:
        _registry.pop(token, None)


def _write_atomically(local: str, data: bytes) -> None:
    # a concurrent delete may remove the fresh directory (it prunes empty ones): write again
    for attempt in range(5):
        os.makedirs(os.path.dirname(local), exist_ok=True)
        try:
            write_atomically(local, data)
            return
        except FileNotFoundError:
            if attempt == 4:
                raise


def _delete_and_prune(local: str, base: str) -> None:
    os.unlink(local)
    parent = os.path.dirname(local)
    while parent.startswith(base + os.sep):
        try:
            os.rmdir(parent)
        except OSError:
            return
        parent = os.path.dirname(parent)


class FaultyFileSystem(AbstractFileSystem):  # type: ignore[misc]
    """``faulty://`` paths: ``put``/``get``/``delete``/``exists``/``list`` calls get the plan's faults.

    Faulted operations: ``pipe_file`` (put), ``cat_file`` (get), ``rm_file`` (delete), ``exists``,
    ``find`` (list). ``ls``, ``info`` and ``_open`` pass through untouched (our uploader does not
    use them). "trickle" paces the bytes of put and get; on the other operations it passes.
    "truncate" returns the first half of what a get read.
    """

    protocol = PROTOCOL
    root_marker = ""

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        text = str(path)
        if text.startswith(_PREFIX):
            text = text[len(_PREFIX) :]
        return text.rstrip("/")

    # --- path mapping ----------------------------------------------------------------------
    def _resolve(self, path: str) -> tuple[FaultPlan, str, str, str]:
        """``(plan, token, base, local path)`` of a stripped ``<token>/<abs path>``."""
        path = self._strip_protocol(path)
        token, _, rest = path.partition("/")
        with _registry_lock:
            entry = _registry.get(token)
        plan = entry[0]() if entry is not None else None
        if entry is None or plan is None:
            raise OSError(errno.ENODEV, f"faulty fs: no live fault plan for {path!r}")
        base = entry[1]
        local = os.path.normpath("/" + rest)
        if local != base and not local.startswith(base + os.sep):
            raise PermissionError(errno.EACCES, f"faulty fs: {local!r} is outside {base!r}")
        return plan, token, base, local

    @staticmethod
    def _relative(base: str, local: str) -> str:
        return "" if local == base else local[len(base) + 1 :]

    # --- fault execution -------------------------------------------------------------------
    def _call(
        self,
        op: str,
        path: str,
        run: Callable[[str, str], T],
        data_len: Callable[[], int] | None = None,
        late: Callable[[str, str], Callable[[], None]] | None = None,
    ) -> T:
        """Run ``run(base, local)`` under the fault the plan picks for ``op`` on ``path``."""
        plan, _, base, local = self._resolve(path)
        rel = self._relative(base, local)
        fault = plan.decide(op, rel)
        gate = plan.gate
        what = f"{op} {rel or '.'}"
        if fault is None:
            del plan  # nothing below may keep the plan alive
            return self._passthrough(gate, op, rel, what, run, base, local, recorder=_recorder(path))
        action: Action = fault.action
        if action == "fail" or action == "reset":
            raise _injected_error(fault, what)
        if action == "late":
            assert late is not None, f"'late' is not supported for {op}"
            plan.hold_late(op, rel, late(base, local))
            raise TimeoutError(errno.ETIMEDOUT, f"injected late {what}: the client gave up, it lands later")
        del plan
        if action == "lag":
            return cast(T, _lagging(cast(list[str], run(base, local)), base, fault.hide))
        if action == "stall":
            gate.stall(what)
        elif action == "delay":
            gate.sleep(fault.delay_s, what)
        elif action == "trickle" and data_len is not None:
            # a write lands once its last byte is sent; a read returns once its last byte arrives
            _trickle(gate, data_len(), fault.bytes_per_s, what)
        result = run(base, local)
        if action == "truncate" and isinstance(result, bytes):
            return cast(T, result[: len(result) // 2])
        if action == "trickle" and isinstance(result, bytes):
            _trickle(gate, len(result), fault.bytes_per_s, what)
        return result

    @staticmethod
    def _passthrough(
        gate: Any,
        op: str,
        rel: str,
        what: str,
        run: Callable[[str, str], T],
        base: str,
        local: str,
        recorder: Callable[[str, str, str], None],
    ) -> T:
        try:
            result = run(base, local)
        except BaseException as exc:
            recorder(op, rel, f"error:{type(exc).__name__}")
            raise
        recorder(op, rel, "ok")
        return result

    # --- faulted operations ----------------------------------------------------------------
    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        data = bytes(value)

        def late(base: str, local: str) -> Callable[[], None]:
            return lambda: _write_atomically(local, data)

        self._call("put", path, lambda _b, local: _write_atomically(local, data), lambda: len(data), late)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        def read(_base: str, local: str) -> bytes:
            with open(local, "rb") as f:
                if start:
                    f.seek(start if start >= 0 else max(0, os.path.getsize(local) + start))
                if end is None:
                    return f.read()
                stop = end if end >= 0 else os.path.getsize(local) + end
                return f.read(max(0, stop - f.tell()))

        return self._call("get", path, read)

    def rm_file(self, path: str) -> None:
        def late(base: str, local: str) -> Callable[[], None]:
            def land() -> None:
                with contextlib.suppress(FileNotFoundError):
                    _delete_and_prune(local, base)

            return land

        self._call("delete", path, lambda base, local: _delete_and_prune(local, base), None, late)

    def _rm(self, path: str) -> None:
        self.rm_file(path)

    def exists(self, path: str, **kwargs: Any) -> bool:
        return self._call("exists", path, lambda _b, local: os.path.exists(local))

    def find(
        self, path: str, maxdepth: int | None = None, withdirs: bool = False, detail: bool = False, **kwargs: Any
    ) -> Any:
        stripped = self._strip_protocol(path)
        token = stripped.partition("/")[0]

        def walk(_base: str, local: str) -> list[str]:
            if os.path.isfile(local):
                return [f"{token}{local}"] if not is_temporary(local) else []
            names: list[str] = []
            top_depth = local.rstrip(os.sep).count(os.sep)
            for root, dirs, files in os.walk(local):
                depth = root.rstrip(os.sep).count(os.sep) - top_depth
                if maxdepth is not None and depth >= maxdepth:
                    dirs[:] = []
                if withdirs and root != local:
                    names.append(f"{token}{root}")
                names.extend(f"{token}{os.path.join(root, f)}" for f in files if not is_temporary(f))
            return sorted(names)

        names = self._call("list", path, walk)
        if detail:
            return {n: self.info(n) for n in names}
        return names

    # --- untouched helpers -----------------------------------------------------------------
    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        _, token, _, local = self._resolve(path)
        names = [f"{token}{os.path.join(local, n)}" for n in sorted(os.listdir(local)) if not is_temporary(n)]
        return [self.info(n) for n in names] if detail else names

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        _, _, _, local = self._resolve(path)
        st = os.stat(local)
        kind = "directory" if os.path.isdir(local) else "file"
        return {"name": self._strip_protocol(path), "size": st.st_size, "type": kind}

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        _, _, _, local = self._resolve(path)
        os.makedirs(local, exist_ok=True)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        _, _, _, local = self._resolve(path)
        os.makedirs(local, exist_ok=exist_ok)

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        _, _, _, local = self._resolve(path)
        if "w" in mode or "a" in mode:
            os.makedirs(os.path.dirname(local), exist_ok=True)
        return open(local, mode)


def _lagging(names: list[str], base: str, hide: str) -> list[str]:
    """A listing without the names whose path relative to ``base`` matches ``hide``."""
    kept = []
    for name in names:
        at = name.find(base)
        rel = name[at + len(base) + 1 :] if at >= 0 else name
        if not fnmatch.fnmatchcase(rel, hide):
            kept.append(name)
    return kept


def _recorder(path: str) -> Callable[[str, str, str], None]:
    """Log to the plan of ``path`` without holding the plan while the call runs."""
    token = FaultyFileSystem._strip_protocol(path).partition("/")[0]

    def record(op: str, rel: str, outcome: str) -> None:
        with _registry_lock:
            entry = _registry.get(token)
        plan = entry[0]() if entry is not None else None
        if plan is not None:
            plan.record(op, rel, outcome)

    return record


def _injected_error(fault: Fault, what: str) -> BaseException:
    if fault.error is None:
        if fault.action == "reset":
            return ConnectionResetError(errno.ECONNRESET, f"injected connection reset: {what}")
        return OSError(errno.EIO, f"injected failure: {what}")
    return fault.error() if isinstance(fault.error, type) else fault.error


def _trickle(gate: Any, size: int, bytes_per_s: float, what: str) -> None:
    """Take as long as moving ``size`` bytes at ``bytes_per_s`` would (interruptible by close)."""
    total = size / bytes_per_s
    end = time.monotonic() + total
    while (left := end - time.monotonic()) > 0:
        gate.sleep(min(left, _TRICKLE_STEP_S), what)


fsspec.register_implementation(PROTOCOL, FaultyFileSystem, clobber=True)
