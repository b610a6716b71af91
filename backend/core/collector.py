"""Pausing CPython's cyclic garbage collector for a bounded bulk step.

CPython runs a collection of the youngest generation every 700 allocations of container objects
(tuples, lists, dicts, instances), and an older one every 10 of those, scanning what survived. A
step that builds tens of thousands of small containers that all live until it ends (a lazy load
of a batch's keys: a plan, a tuple and a list per key and per block) gains nothing from those
scans: none of its objects is garbage before the step ends, yet each scan walks them again, and
the larger the state the more blocks a batch's keys touch (docs/benchmarks.md, the lazy first
batch). Mercurial pauses the collector around its parsers for the same reason (``util.nogc``).

The pause is for the step only, restored in every case; a collector already paused by the caller
stays paused. Garbage made meanwhile (cycles) is collected at the first collection after it. The
switch is per process: another thread's paused step ending first turns the collector back on,
which only lets it run again.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["collector_paused"]


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Run the ``with`` body with the cyclic garbage collector paused (module doc)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
