"""Which state a routed operator resumes: the one at its place in the query, as in Spark.

Spark knows a stateful operator of a query by its operator id, its place among the query's
stateful operators, not by its code: a query restarted with its processor class renamed or
replaced (Spark's own schema-evolution tests do exactly this), or with a lambda, resumes the state
of the operator at the same place. A routed operator's state directory is named after a uid
(``routing.routed_uid``: its processor's class or function), so the query's directory of routed
operators keeps a small file, ``operators.json``, listing the uid at each place. A query that
starts resumes, for each place, the uid recorded there; a place not recorded yet (a new
checkpoint, a checkpoint of a release that kept no list, an operator added at the end) takes the
operator's own uid. An ``operator_uid`` the user gave names the operator wherever it is.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace

from dstl import ConfigurationError
from dstl.config import ChangelogConfig
from dstl.paths import check_name
from dstl.storage.storage import StateChangelogStorage

__all__ = ["OPERATORS_FILE", "assign_uids", "parse_uids", "resolve_uids"]

#: the list of uids by place, beside the operators' state directories
OPERATORS_FILE = "operators.json"


def assign_uids(recorded: list[str], wanted: list[tuple[str, bool]]) -> list[str]:
    """The uid of each routed operator of a query, in plan order: ``wanted`` holds each one's own
    uid and whether it was derived (True) or given by the user; a derived one takes the uid
    recorded at its place. Two derived uids that meet get their place as a suffix; two given ones
    that meet are refused (their state directories would be one)."""
    uids = [recorded[i] if derived and i < len(recorded) else uid for i, (uid, derived) in enumerate(wanted)]
    fresh = [derived and i >= len(recorded) for i, (_, derived) in enumerate(wanted)]
    kept = [uid for uid, new in zip(uids, fresh, strict=True) if not new]
    twice = sorted(uid for uid, n in Counter(kept).items() if n > 1)
    inherited = [i for i, (_, derived) in enumerate(wanted) if derived and i < len(recorded) and uids[i] in twice]
    if twice and inherited:
        place = inherited[0]
        raise ConfigurationError(
            f"the routed stateful operator at place {place} of this query resumes the state recorded there, "
            f"{recorded[place]!r}, which another operator of the query names as its operator_uid: give this one "
            "an operator_uid too, or another to the other"
        )
    if twice:
        raise ConfigurationError(
            f"this query has more than one routed stateful operator with uid {twice}: pass operator_uid=... to "
            "tell them apart (their state directories would be one)"
        )
    taken = set(kept)
    for i, new in enumerate(fresh):
        if new:
            uids[i] = _free(uids[i], i, taken)
            taken.add(uids[i])
    return uids


def _free(uid: str, place: int, taken: set[str]) -> str:
    """``uid``, or with its place (and a count) as a suffix where it is taken."""
    candidate, n = uid, 0
    while candidate in taken:
        candidate, n = f"{uid}-{place}" + (f"-{n}" if n else ""), n + 1
    return candidate


def resolve_uids(changelog: ChangelogConfig, directory: str, wanted: list[tuple[str, bool]]) -> list[str]:
    """``assign_uids`` against the list recorded in ``directory`` (the query's directory of routed
    operators, on the storage ``changelog`` names), recording the places it adds."""
    with StateChangelogStorage(replace(changelog, base_path=directory), owns_files=False) as storage:
        try:
            data = storage.files.get(OPERATORS_FILE)
        except FileNotFoundError:
            recorded: list[str] = []
        else:
            recorded = parse_uids(data, f"{directory.rstrip('/')}/{OPERATORS_FILE}")
        uids = assign_uids(recorded, wanted)
        kept = uids + recorded[len(uids) :]
        if kept != recorded:
            storage.files.put(OPERATORS_FILE, json.dumps(kept).encode())
    return uids


def parse_uids(data: bytes, where: str) -> list[str]:
    """The uids by place an ``operators.json`` (at ``where``, for errors) holds; a damaged one raises
    ``ConfigurationError`` naming it."""
    try:
        uids = json.loads(data)
    except ValueError as exc:
        raise ConfigurationError(f"{where} is corrupt: not JSON ({exc})") from None
    if not isinstance(uids, list) or not all(isinstance(uid, str) for uid in uids):
        raise ConfigurationError(f"{where} is corrupt: not a list of operator uids")
    for uid in uids:
        check_name(uid, f"the operator uid in {where}")
    return uids
