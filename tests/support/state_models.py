"""Model updates shared by the state-machine tests (backend and materializer)."""

from __future__ import annotations

from typing import Any


def apply_list_op(state: Any, model: dict[Any, list[int]], key: Any, op: str, values: list[int]) -> None:
    """Apply a list-state operation to the backend's ``state`` and to the dict ``model``."""
    if op == "add":
        value = values[0] if values else 0
        state.add(value)
        model.setdefault(key, []).append(value)
    elif op == "add_all":
        state.add_all(values)
        model.setdefault(key, []).extend(values)
    elif op == "update":
        state.update(values)
        model[key] = list(values)
    else:
        state.clear()
        model.pop(key, None)
    if not model.get(key, True):
        del model[key]
