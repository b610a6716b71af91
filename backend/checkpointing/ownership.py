"""Who owns a job directory: one run at a time, by epochs; and, under Spark, which query it serves.

Why: two processes recovering one job directory (a second ``LocalJob`` on the same root and job
id, a Spark driver started while another still runs) each delete the files the other is writing,
and both go on committing checkpoints; a restart then resumes whichever wrote last, or is refused
for good because a checkpoint names files the other deleted. Flink settles this with leader
election and fencing tokens in ZooKeeper or Kubernetes. An object store offers no lock, and our
uploader protocol no conditional write, so ownership here is a *compare-and-check* over objects
that nobody but their writer ever overwrites (put, list, get, delete: S3, fsspec stores, a local
directory, any store whose listing shows every completed write, as S3 has since 2020):

- **A run claims the directory with the next epoch.** A run (one ``LocalJob``, one Spark driver's
  ``DriverCoordinator``: a random id) writes ``_owner/<epoch>.run.<run>`` with an epoch one above
  every claim listed, then lists ``_owner/`` again. Another run's claim at the same or a higher
  epoch means two runs claimed at once: it withdraws (deletes its claim) and is refused with
  ``DirectoryOwnedError`` naming the other. Of two claims at one epoch, the one written second
  sees the first, so at most one stands per epoch. A claim that stands carries forward the Spark
  query bound to the directory; once its recovery went through, it deletes the claims below it.
- **The newest epoch fences every older one.** An owner lists ``_owner/`` before and after each
  ``_metadata`` put (``Ownership.check``, from ``CheckpointCoordinator.complete``) and before its
  recovery deletes anything: a run claim with a higher epoch means it was taken over, and it raises
  ``OwnershipLostError`` naming the new owner; its uploader (``Ownership.guard``) refuses every
  write and deletion from then on, whatever its storage and backends release (no commit, no
  subsumption, no discard on cancel). If the check after a put saw no newer claim, the ``_metadata``
  was in place before the newer claim was written, so before the new owner's recovery listed the
  directory: the new owner resumes from it or from a later one. A checkpoint reported complete is
  never lost to a takeover, and one written after it is never reported complete. A check after a
  put that cannot be made leaves the outcome unknown: the run stops writing the same way
  (``relinquish``), and its next start settles it.
- **What a fenced run puts late is void.** A put started before the takeover may land after the new
  owner listed the directory (a slow PUT, one a client gave up on). Recovery voids every checkpoint
  id above the one it resumes from up to the highest id it saw in use or reserved, with one object
  ``_void/<first>-<last>`` written before it deletes anything (``backend.checkpointing.store``): a
  ``_metadata`` of such an id, landing whenever, is treated as fenced, never resumed from, and never
  refuses a restart for the files recovery deleted. The fenced run could not have used a later id:
  a reservation landing after that listing comes before the fenced run's next check, which fails.
- **No lock to expire.** A run killed with SIGKILL holds nothing: the next run takes the next epoch.
  The price: a run started by mistake next to a live one takes over rather than being refused; the
  live one then fails its next checkpoint with an error naming the newcomer (host, pid, start).
- **Spark binds a query** (``bind_identity``, from ``backend.spark.committed``): the state belongs
  to one streaming query, whatever drivers run it. A task of query ``q`` binds a directory not yet
  bound with ``_owner/<epoch>.bind.<hash of q>.<nonce>`` at the current run's epoch (so it fences
  no run), lists, withdraws if a binding of another query at that epoch (or a newer run) exists,
  and otherwise confirms it, then checks again for a newer run. Two queries binding at once: at
  most one is confirmed; the other waits a random moment and finds the directory bound to the first
  (``DirectoryOwnedError`` naming it), or, if both withdrew, tries again. A claim left by a process
  that died mid-binding is ignored from the next run's epoch on. A run's claim inherits the bound
  query, so a restarted query keeps its directory and another query is refused by every run.
- **A claim says who made it** (``holder``: host, pid, start; ``details``: what the caller adds,
  such as the Spark Connect session a run's query runs in). The next run may read the newest
  claim (``last_run``) and the bound query (``bound_identity``) before it claims anything, to
  refuse a start while that query still runs (``backend.spark.live_runs``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import socket
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from backend.checkpointing.errors import DirectoryOwnedError, OwnershipLostError
from backend.checkpointing.metadata import OWNER_DIR
from backend.core.errors import CheckpointError
from dstl.api import DfsFiles
from dstl.uploaders.base import Uploader

__all__ = [
    "BIND_ATTEMPTS",
    "LEGACY_OWNER_FILE",
    "Ownership",
    "bind_identity",
    "bound_identity",
    "is_ownership_file",
    "last_run",
]

_log = logging.getLogger(__name__)

#: where earlier versions named the Spark query owning a directory: read as its binding, never written
LEGACY_OWNER_FILE = "_query.json"
#: rounds a query binding a directory tries while other queries' bindings race with it
BIND_ATTEMPTS = 8
#: the random wait between two rounds, seconds (times the round's number)
_BACKOFF_S = (0.02, 0.2)
#: reads of a claim's body before it counts as unreadable (a short body from a misbehaving store)
_READS = 3
_CLAIM = re.compile(rf"^{OWNER_DIR}/(\d+)\.(run|bind)\.([0-9a-f]+)(?:\.([0-9a-f]+))?$")


def is_ownership_file(path: str) -> bool:
    """Whether ``path`` (relative to the job directory) is this module's: recovery leaves it alone."""
    return path.startswith(f"{OWNER_DIR}/") or path == LEGACY_OWNER_FILE


@dataclass(frozen=True)
class _Claim:
    path: str
    epoch: int
    kind: str  # "run" or "bind"
    key: str  # the run's id, or the hash of the bound identity


def _claims(files: DfsFiles) -> list[_Claim]:
    """Every claim under ``_owner/``, by epoch (runs after bindings at one epoch)."""
    found = []
    for path in files.list(OWNER_DIR):
        match = _CLAIM.match(path)
        if match is not None:
            found.append(_Claim(path, int(match.group(1)), match.group(2), match.group(3)))
    return sorted(found, key=lambda c: (c.epoch, c.kind == "run", c.path))


def _claim_path(epoch: int, kind: str, key: str, nonce: str = "") -> str:
    return f"{OWNER_DIR}/{epoch:012d}.{kind}.{key}" + (f".{nonce}" if nonce else "")


def _holder() -> str:
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return f"host {socket.gethostname()}, pid {os.getpid()}, started {started}"


def _read(files: DfsFiles, path: str) -> dict[str, Any] | None:
    """A claim's body, or None if it is gone; read again while it does not parse (a short body),
    ``CheckpointError`` naming it if it never does."""
    problem = ""
    for _ in range(_READS):
        try:
            value = json.loads(files.get(path))
        except FileNotFoundError:
            return None
        except ValueError as exc:
            problem = str(exc)
            continue
        if isinstance(value, dict):
            return value
        problem = "not a JSON object"
    raise CheckpointError(f"the ownership claim {path} cannot be read ({problem}, on each of {_READS} reads)")


def _describe(files: DfsFiles, claim: _Claim) -> str:
    """Who holds ``claim``, for messages (never raises)."""
    try:
        body = _read(files, claim.path) or {}
    except CheckpointError:
        body = {}
    who = body.get("holder") or "holder unknown"
    return f"epoch {claim.epoch}, {who} ({claim.path})"


def _put(files: DfsFiles, path: str, body: dict[str, Any]) -> None:
    files.put(path, json.dumps(body, sort_keys=True).encode())


def _withdraw(files: DfsFiles, path: str) -> None:
    try:
        files.delete(path)
    except Exception as exc:  # a claim left behind loses to the next epoch; the caller's error says more
        _log.warning("withdrawing the ownership claim %s failed: %s", path, exc)


def _bound(files: DfsFiles, claims: Sequence[_Claim]) -> tuple[str, str] | None:
    """``(identity, where it is recorded)`` the directory is bound to, or None: the newest
    confirmed binding or identity a run claim carries forward, else an earlier version's file."""
    for claim in reversed(claims):
        body = _read(files, claim.path)
        if body is None:
            continue
        identity = body.get("identity")
        if isinstance(identity, str) and identity and (claim.kind == "run" or body.get("confirmed") is True):
            return identity, claim.path
    try:
        legacy = json.loads(files.get(LEGACY_OWNER_FILE))
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise CheckpointError(f"{LEGACY_OWNER_FILE} in the state directory is not valid JSON: {exc}") from exc
    query = legacy.get("query_id") if isinstance(legacy, dict) else None
    return (str(query), LEGACY_OWNER_FILE) if query else None


def last_run(files: DfsFiles) -> dict[str, Any] | None:
    """The claim of the newest run of the directory (its body: ``run``, ``holder``, ``details``),
    or None if no run claimed it; read only, it claims nothing."""
    for claim in reversed(_claims(files)):
        if claim.kind == "run":
            body = _read(files, claim.path)
            if body is not None:
                return body
    return None


def bound_identity(files: DfsFiles) -> str | None:
    """The identity (under Spark, the streaming query's id) the directory is bound to, or None."""
    bound = _bound(files, _claims(files))
    return None if bound is None else bound[0]


class Ownership:
    """A run's ownership of one job directory: ``claim`` it, ``check`` it before anything a newer
    owner must not see, ``guard`` the run's uploader so that nothing is written or deleted once a
    check found the directory taken over (a fenced run's storage and backends go on releasing files
    otherwise: files a checkpoint names that the new owner may have resumed from)."""

    def __init__(self, where: str, details: Mapping[str, str] | None = None) -> None:
        self.where = where
        self.run = uuid.uuid4().hex
        self.holder = _holder()
        #: what else the claim records of the run, for the next run to read (``last_run``)
        self.details = dict(details or {})
        self.epoch = 0  # not claimed yet
        self._files: DfsFiles | None = None
        #: why this run writes no more, once known (a newer run's claim, or ``relinquish``): from
        #: then on every check fails at once and the guarded uploader refuses writes and deletions
        self.lost_to: str | None = None

    @property
    def lost(self) -> bool:
        return self.lost_to is not None

    def claim(self, files: DfsFiles) -> None:
        """Claim the directory of ``files`` (their base path) with the next epoch; ``DirectoryOwnedError``
        if another run claimed it at the same time."""
        epoch = max((c.epoch for c in _claims(files)), default=0) + 1
        path = _claim_path(epoch, "run", self.run)
        body: dict[str, Any] = {"kind": "run", "epoch": epoch, "run": self.run, "holder": self.holder, "identity": ""}
        if self.details:
            body["details"] = self.details
        _put(files, path, body)
        claims = _claims(files)
        rivals = [c for c in claims if c.kind == "run" and c.epoch >= epoch and c.path != path]
        if rivals:
            _withdraw(files, path)
            raise DirectoryOwnedError(
                f"{self.where}: another run claimed this job directory at the same time "
                f"({_describe(files, rivals[-1])}); this one withdrew: a job directory has one owner at a time. "
                "Start again once the other is stopped (a run started later takes the directory over and "
                "fences the earlier one)"
            )
        bound = _bound(files, [c for c in claims if c.epoch < epoch])
        if bound is not None:
            _put(files, path, {**body, "identity": bound[0]})
        self._files, self.epoch = files, epoch
        _log.info("%s: owned by this run from epoch %d (%s)", self.where, epoch, self.holder)

    def follow(self, files: DfsFiles, run: str) -> None:
        """Act under the claim another process of the same run made (``run``: its ``Ownership.run``):
        a process that completes checkpoints for a run whose start-up (claim, recovery) happened
        elsewhere (under Spark Connect, the server-side listener of a client's query). It claims
        nothing and is fenced exactly when that run is; ``OwnershipLostError`` if it already is
        (also when its claim is gone while another run's stands: a newer run's recovery deleted it),
        ``CheckpointError`` if no run claimed the directory."""
        claims = _claims(files)
        mine = [c for c in claims if c.kind == "run" and c.path == _claim_path(c.epoch, "run", run)]
        runs = [c for c in claims if c.kind == "run"]
        if not mine and runs:  # a newer run's recovery compacted the claim away: that run took over
            self.lost_to = f"taken over by a newer run ({_describe(files, runs[-1])})"
            raise OwnershipLostError(f"{self.where}: no claim of run {run} to act under: it was {self.lost_to}")
        if not mine:
            raise CheckpointError(f"{self.where}: no claim of run {run} to act under")
        self._files, self.epoch, self.run = files, mine[0].epoch, run
        self.check("following the run that claimed the directory")

    def compact(self) -> None:
        """Delete the claims below this run's epoch (fenced already; this run's claim carries the
        bound identity on): after a recovery that went through, so that a refused start deletes
        nothing. Best effort: a claim left is ignored, and deleted by the next run."""
        if self._files is not None and not self.lost:
            for older in (c for c in _claims(self._files) if c.epoch < self.epoch):
                _withdraw(self._files, older.path)

    def check(self, operation: str) -> None:
        """Raise ``OwnershipLostError`` if a newer run has claimed the directory."""
        if self.lost_to is None:
            if self._files is None:
                raise CheckpointError(f"{operation}: {self.where} is not claimed by this run (claim it first)")
            newer = [c for c in _claims(self._files) if c.kind == "run" and c.epoch > self.epoch]
            if not newer:
                return
            self.lost_to = f"taken over by a newer run ({_describe(self._files, newer[-1])})"
        raise OwnershipLostError(
            f"{operation}: {self.where} was {self.lost_to}; this run (epoch {self.epoch}, {self.holder}) "
            "writes nothing more there: stop it"
        )

    def relinquish(self, reason: str) -> None:
        """Stop writing as if taken over (``reason`` says why, e.g. a commit whose check failed):
        the run fails over, and its next start settles what is on the DFS."""
        if self.lost_to is None:
            self.lost_to = reason

    def guard(self, uploader: Uploader) -> Uploader:
        """``uploader``, refusing every write and deletion once the directory is known to be lost."""
        return _GuardedUploader(uploader, self)


class _GuardedUploader:
    """An uploader that refuses puts and deletes once its run's ownership is lost; reads, listings
    and whatever else the wrapped uploader offers (``getattr``) pass through."""

    def __init__(self, inner: Uploader, ownership: Ownership) -> None:
        self._inner = inner
        self._ownership = ownership

    def _refuse(self, what: str) -> None:
        if self._ownership.lost_to is not None:
            raise OwnershipLostError(f"{what}: refused, {self._ownership.where} was {self._ownership.lost_to}")

    async def put(self, path: str, data: bytes) -> None:
        self._refuse(f"writing {path}")
        await self._inner.put(path, data)

    async def get(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        return await self._inner.get(path, offset, length)

    async def delete(self, path: str) -> None:
        self._refuse(f"deleting {path}")
        await self._inner.delete(path)

    def remove_empty_directory(self, path: str) -> bool:  # an empty directory holds nothing to guard
        return self._inner.remove_empty_directory(path)

    async def list(self, prefix: str = "") -> list[str]:
        return await self._inner.list(prefix)

    async def close(self) -> None:
        await self._inner.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def bind_identity(files: DfsFiles, identity: str, where: str, *, what: str, hint: str = "") -> None:
    """Make sure the directory's state belongs to ``identity`` (a ``what``, e.g. "streaming query"):
    bind it if nothing is bound yet; ``DirectoryOwnedError`` naming the owner if another is."""
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    for attempt in range(1, BIND_ATTEMPTS + 1):
        claims = _claims(files)
        bound = _bound(files, claims)
        if bound is not None:
            if bound[0] == identity:
                return
            raise DirectoryOwnedError(
                f"the state directory {where} belongs to another {what} (id {bound[0]}), not to this one "
                f"(id {identity}){': ' + hint if hint else ''}"
            )
        epoch = max((c.epoch for c in claims if c.kind == "run"), default=0)
        path = _claim_path(epoch, "bind", key, uuid.uuid4().hex[:16])
        body = {"kind": "bind", "epoch": epoch, "identity": identity, "holder": _holder(), "confirmed": False}
        _put(files, path, body)
        if not _contested(_claims(files), path, epoch, key):
            _put(files, path, {**body, "confirmed": True})
            if not any(c.kind == "run" and c.epoch > epoch for c in _claims(files)):
                return
        _withdraw(files, path)  # another query is binding it, or a new run came: look again
        time.sleep(random.uniform(*_BACKOFF_S) * attempt)
    rivals = [c.path for c in _claims(files) if c.kind == "bind" and c.key != key]
    raise DirectoryOwnedError(
        f"the state directory {where}: binding it to {what} {identity} failed on each of {BIND_ATTEMPTS} "
        f"attempts, other {what}s binding it at the same time ({', '.join(rivals) or 'none left'}); if no "
        "other one runs, restart this one (a claim left by a process that died while binding counts no more "
        "once a new run starts)"
    )


def _contested(claims: Sequence[_Claim], mine: str, epoch: int, key: str) -> bool:
    """Whether a binding of another identity at ``epoch``, or a newer run, competes with ``mine``."""
    return any(
        c.path != mine
        and ((c.kind == "bind" and c.epoch == epoch and c.key != key) or (c.kind == "run" and c.epoch > epoch))
        for c in claims
    )
