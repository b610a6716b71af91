"""The append buffer of a writer: changes not yet cut, and the two-append path that adds them.

Every writer, local (``dstl.writer.ChangelogWriter``) or remote (``dstl.service.client``), owns
one ``AppendBuffer``; whoever drives it (the storage's loop thread for a local writer, the
connection's sender for a remote one) calls only the public methods below. Why it is shaped so:

- *The hot path is two list appends and a countdown.* ``append`` appends the key group, then the
  payload, to a list: two ``list.append`` calls, which CPython runs inline without a call of their
  own (a pair appended as ``+= (key_group, data)`` builds a tuple and takes the generic in-place
  path: half again the cost of the whole append). No size check, lock or validation runs per
  call (each would cost as much as the append itself). A writer's ``append`` and ``append_many``
  are closures the buffer gives it (``Appender``), which find the list in their cell: CPython
  calls a plain function kept in an instance attribute and reads a cell faster than it calls a
  method and reads ``self._records`` (and a bound method kept in an attribute, such as the
  buffer's own, is slower still).
- *The bound holds without the driver.* The driver measures and gates every few milliseconds,
  but only when it runs: a loop thread that a loaded machine does not schedule, or that a slow
  call holds, let an operator append tens of megabytes past every bound. So every
  ``LOOK_EVERY`` changes (a countdown of small ints, the one per-change cost the bound adds:
  its decrement is tested as it is stored, fewer bytecodes than a decrement and a comparison,
  and the look itself is a few attribute reads), and before every ``append_many``, the
  appending thread looks itself: it adds ``LOOK_EVERY`` times the
  length of the change in hand to ``estimate`` (the bytes appended since the last cut) and calls
  its owner's ``look``, which cuts or waits as the driver would. Measuring every change there
  would double the append's cost; one length per look is exact for changes of one size and close
  for changes of similar sizes, and the driver's measure and the cut stay exact. Whether the
  driver runs or not, a buffer holds about its owner's bound plus ``LOOK_EVERY`` changes.
- *Pairs, even when cut halfway.* The list holds ``key_group, data, key_group, data, ...``. A
  thread switch may fall between the two appends of one change, so whoever reads the list takes
  an even number of items: ``cut`` and ``measure`` leave a lone key group for the next time, when
  its payload has followed. A stand-in (below) sees the same halves: the gate waits before a key
  group only (a change is held back whole, never split around a wait), the waker wakes its
  driver after a payload only. Each append reads the cell anew, so a swap between the two sends
  the key group to one target and the payload to the next; both lead to the same list, and the
  rules above keep the pair whole.
- *Everything else swaps what appends extend.* The buffer points the appenders' cell (and the
  writer's ``_records``, which mirrors it) at its list or at a stand-in whose ``append`` and
  ``+=`` do more: the *gate* (backpressure: the appending thread waits in the owner's ``wait``,
  then appends), the *waker* (the driver sleeps: append, then ``wake`` it), or the *refusal*
  (the buffer is failed, fenced, lost or closed: raise that status's error). Only this module
  points them. Swapping is a store, so the driver can gate, park or kill a writer between two
  appends without the appending thread taking a lock.
- *Cut-then-delete.* ``cut`` copies the first ``n`` items and deletes exactly those, atomic list
  operations, so an append racing with it lands in the next cut: nothing is lost or duplicated,
  and the list ``append`` extends never changes.
- *Measured, then checked, once per cut.* ``measure`` adds up the bytes appended since it last
  looked (the driver's bound on memory; a change without a length counts as past every bound,
  so the next cut fails the writer instead of the driver). ``cut`` checks payload types
  (``bytes``), key groups (integers in the writer's range) and lengths (32 bits), vectorized, and
  a bad change fails the buffer: status ``FAILED``, its next append or SQN request raises an
  error naming the writer and the change. What the check computes (the key groups as an array,
  their bounds, the payloads' lengths) goes with the cut, so the encoder never computes it again.
- *One status.* ``OPEN``, then at most one of ``FAILED`` (a bad change; control calls still
  work), ``FENCED`` (a newer attempt took the writer over), ``LOST`` (its changelog service is
  gone), ``CLOSED``. A failed buffer may still be fenced, lost or closed; a fenced or lost one
  stays so when closed, so that its calls keep saying why it died. ``error(op)`` is what a call
  raises in each status.

``data`` must be immutable ``bytes``: the buffer keeps a reference, not a copy. Appends come from
one thread (the operator's). The buffer's lock guards cuts, measuring and status changes; on a
free-threaded CPython build, where list operations are not atomic, ``append`` takes it too (and
drops it before a stand-in waits).
"""

from __future__ import annotations

import enum
import sys
import threading
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dstl.errors import ChangelogError, ConfigurationError, WriterClosedError
from dstl.types import KeyGroupRange

__all__ = ["LOOK_EVERY", "AppendBuffer", "Appender", "BufferStatus", "Cut", "check_changes"]

_GIL_ENABLED = getattr(sys, "_is_gil_enabled", lambda: True)()
#: the measured size of a buffer holding a change without a length: past every bound
UNMEASURABLE = 1 << 62
#: the appending thread looks at its owner's bounds itself every this many changes (module doc);
#: at most 256, so that the countdown stays among CPython's cached small ints (no allocation)
LOOK_EVERY = 255


class BufferStatus(enum.Enum):
    """Whether a buffer takes appends, and if not, why (module doc)."""

    OPEN = "open"
    FAILED = "failed"
    FENCED = "fenced"
    LOST = "lost"
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class Cut:
    """The changes of one cut, checked: key groups and payloads as columns, the payloads' lengths,
    their bytes and the smallest and largest key group."""

    key_groups: array[int]
    payloads: list[bytes]
    lengths: array[int]
    size: int
    min_key_group: int
    max_key_group: int


def check_changes(pairs: list[Any]) -> tuple[array[int], list[bytes]]:
    """``[key_group, data, ...]`` as columns; ``ConfigurationError`` saying what is wrong with a
    payload that is not ``bytes`` or a key group that is not an integer in [0, 65535]."""
    payloads = pairs[1::2]
    return _check_payloads_and_key_groups(pairs[0::2], payloads), payloads


def _check_payloads_and_key_groups(key_groups: list[Any], payloads: list[Any]) -> array[int]:
    if list(map(type, payloads)).count(bytes) != len(payloads):  # cheaper than a set of the types
        bad = next(p for p in payloads if type(p) is not bytes)
        raise ConfigurationError(f"changes must be bytes, got {type(bad).__name__}")
    column = array("H")
    try:
        column.fromlist(key_groups)  # a little cheaper than the constructor
        return column
    except (TypeError, OverflowError) as exc:
        bad = next((k for k in key_groups if type(k) is not int or not 0 <= k <= 0xFFFF), None)
        raise ConfigurationError(f"key group {bad!r} is not an integer in [0, 65535] ({exc})") from None


def _lengths(lengths: list[int]) -> array[int]:
    """The payloads' ``lengths`` as ``array('I')`` (the changelog format's 32-bit lengths)."""
    column = array("I")
    try:
        column.fromlist(lengths)  # a little cheaper than the constructor
        return column
    except OverflowError:
        longest = max(lengths)
        raise ConfigurationError(f"a change of {longest} bytes is longer than a change may be (4 GiB - 1)") from None


class Appender:
    """The hot path of a writer that owns an ``AppendBuffer``: its ``append`` and ``append_many``
    are functions the buffer gives it, closures over what the buffer points ``_records`` at
    (module doc). Only the buffer sets them and ``_records``."""

    _records: Any
    #: append one change of a key group; in memory, never does I/O
    append: Callable[[int, bytes], None]
    #: append many changes at once: ``[key_group, data, key_group, data, ...]``, in order
    append_many: Callable[[list[Any]], None]


def _appenders(
    look: Callable[[Any, int], None],
) -> tuple[Callable[[int, bytes], None], Callable[[list[Any]], None], Callable[[Any], None]]:
    """``append`` and ``append_many`` of one writer, and ``point``, which re-points both at another
    list or stand-in: a closure's cell is read faster than an attribute of ``self`` (module doc).
    Every ``LOOK_EVERY`` changes, and for every ``append_many``, before appending, they call
    ``look(sample, changes)``: a payload of the changes appended since the last look, and how many
    there were (module doc, the bound)."""
    records: Any = None
    left = LOOK_EVERY

    def append(key_group: int, data: bytes) -> None:
        """Append one change of ``key_group``; in memory, never does I/O, may wait for room
        (``dstl.append_buffer``)."""
        nonlocal left
        if not (left := left - 1):  # one decrement, its result tested as it is stored
            left = 1  # if the look raises, this change is not appended and the next call looks
            look(data, LOOK_EVERY)  # may wait, or raise
            left = LOOK_EVERY
        records.append(key_group)  # the cell read twice: cheaper than a local, and re-pointing
        records.append(data)  # between the two is safe (module doc, pairs)

    def append_many(pairs: list[Any]) -> None:
        """Append many changes at once: ``[key_group, data, key_group, data, ...]``, in order."""
        nonlocal left
        if len(pairs) % 2:
            raise ConfigurationError(f"append_many(pairs): {len(pairs)} items are not key group and data pairs")
        if pairs:
            look(pairs[-1], LOOK_EVERY - left + len(pairs) // 2)
            left = LOOK_EVERY
        target = records
        target += pairs

    def point(target: Any) -> None:
        nonlocal records
        records = target

    return append, append_many, point


class AppendBuffer:
    """A writer's changes not yet cut, and its status (module doc).

    ``wait``: called by an append at the gate, on the appending thread; returns once the append
    may go on (or raises, e.g. ``WriterClosedError`` when the owner closes meanwhile). ``wake``:
    called after an append at the waker, to wake a sleeping driver (``park``). ``look``: called
    by the appending thread every ``LOOK_EVERY`` changes and before every ``append_many`` with
    ``estimate`` (module doc, the bound), to hold the owner's bounds without the driver; it may
    cut, or wait as ``wait`` does."""

    def __init__(
        self,
        owner: Appender,
        log_id: str,
        key_group_range: KeyGroupRange,
        *,
        wait: Callable[[], None],
        wake: Callable[[], None] = lambda: None,
        look: Callable[[int], None] = lambda estimate: None,
    ) -> None:
        self.log_id = log_id
        self.key_group_range = key_group_range
        self._wait = wait
        self._wake = wake
        self._lock = threading.Lock()
        #: key group, payload, key group, payload, ...
        self._active: list[Any] = []
        #: whose ``append`` extends ``_records``: ``_active`` or one of the stand-ins
        self._owner = owner
        self._look = look
        #: the bytes appended since the last cut, as the appending thread's looks estimate them
        self.estimate = 0
        owner.append, owner.append_many, self._point_appenders = _appenders(self._estimate)
        self._point(self._active)
        self._gate = _Gate(self)
        self._waker = _Waker(self)
        self._refusal = _Refusal(self)
        self._measured = 0  # items of _active whose bytes are counted in _measured_bytes
        self._measured_bytes = 0
        #: the lengths of the payloads measured, for the cut (complete unless UNMEASURABLE)
        self._measured_lengths: list[int] = []
        self._status = BufferStatus.OPEN
        self._failure: ChangelogError | None = None
        self._death: Callable[[str], ChangelogError] | None = None
        if not _GIL_ENABLED:  # pragma: no cover - free-threaded builds only
            owner.append = self._append_locked
            owner.append_many = self._append_many_locked

    def _point(self, target: Any) -> None:
        """Make appends go to ``target``: the list, or a stand-in (module doc)."""
        self._owner._records = target
        self._point_appenders(target)

    # -- the appending thread: stand-ins and free-threaded builds ------------------------------

    def _append_locked(self, key_group: int, data: bytes) -> None:  # pragma: no cover
        self._append_many_locked([key_group, data])

    def _append_many_locked(self, pairs: list[Any]) -> None:  # pragma: no cover
        if len(pairs) % 2:
            raise ConfigurationError(f"append_many(pairs): {len(pairs)} items are not key group and data pairs")
        with self._lock:
            records = self._owner._records
            if records is self._active:
                records += pairs
                return
        records += pairs  # a stand-in: it may wait, and takes the lock itself to append

    def _estimate(self, sample: Any, changes: int) -> None:
        """The appending thread's look: ``changes`` more changes of about ``sample``'s length."""
        try:  # not with contextlib.suppress: a context manager costs more than the rest of the look
            size = len(sample)
        except TypeError:  # not bytes: the next cut fails the writer
            size = 0
        self.estimate += changes * size
        self._look(self.estimate)

    def _extend(self, items: list[Any]) -> list[Any]:
        """A stand-in's append, once it may go on: raises if the buffer stopped taking changes
        meanwhile (failed, fenced, lost or closed while the append waited)."""
        with self._lock:
            if self._status is BufferStatus.OPEN:
                self._active += items
                return self._active
        raise self._refused("append")

    def _completes_a_pair(self) -> bool:
        """Whether the next item appended is the payload of a key group appended already (the
        appending thread asks: only it appends, and cuts take pairs, so the parity is its own)."""
        return len(self._active) % 2 == 1

    def _refused(self, op: str) -> ChangelogError:
        error = self.error(op)
        assert error is not None, "only a buffer that is not open refuses"
        return error

    # -- status ------------------------------------------------------------------------------

    @property
    def status(self) -> BufferStatus:
        return self._status

    def error(self, op: str) -> ChangelogError | None:
        """What a call ``op`` of the writer raises in the current status (None while open)."""
        status = self._status
        if status is BufferStatus.OPEN:
            return None
        if status is BufferStatus.FAILED:
            return self._failure
        if status is BufferStatus.CLOSED:
            return WriterClosedError(f"changelog writer {self.log_id} is closed: cannot {op}")
        assert self._death is not None
        return self._death(op)

    def check(self, op: str) -> None:
        """Raise ``error(op)``, if there is one."""
        error = self.error(op)
        if error is not None:
            raise error

    def fail(self, error: ChangelogError) -> None:
        """A bad change: appends and SQN requests raise ``error`` from now on (if still open)."""
        with self._lock:
            if self._status is BufferStatus.OPEN:
                self._failure = error
                self._end_locked(BufferStatus.FAILED)

    def kill(self, status: BufferStatus, error: Callable[[str], ChangelogError]) -> None:
        """The writer can never ship again (``FENCED`` or ``LOST``): its calls raise ``error(op)``.
        A closed buffer stays closed."""
        if status is not BufferStatus.FENCED and status is not BufferStatus.LOST:
            raise ValueError(f"kill(status={status}): only FENCED or LOST")
        with self._lock:
            if self._status is BufferStatus.OPEN or self._status is BufferStatus.FAILED:
                self._death = error
                self._end_locked(status)

    def close(self) -> bool:
        """Drop every change; appends raise ``WriterClosedError`` from now on. True if the buffer
        was open or failed (False: closed already, or fenced or lost, which it stays)."""
        with self._lock:
            if self._status is not BufferStatus.OPEN and self._status is not BufferStatus.FAILED:
                return False
            self._end_locked(BufferStatus.CLOSED)
            return True

    def _end_locked(self, status: BufferStatus) -> None:
        self._status = status
        self._point(self._refusal)
        del self._active[:]
        self._measured = self._measured_bytes = 0
        self._measured_lengths = []

    # -- the driver: measure, cut, gate, park ------------------------------------------------

    @property
    def empty(self) -> bool:
        """Whether no whole change is waiting to be cut."""
        return len(self._active) < 2

    def measure(self) -> int:
        """The bytes of the changes waiting to be cut; counts only what was appended since the
        last call (``UNMEASURABLE`` once a change has no length). The lengths it takes are kept
        for the cut, which then takes only those of the changes appended since."""
        if len(self._active) & ~1 == self._measured:  # nothing new: the common case, without the lock
            return self._measured_bytes
        with self._lock:
            active = self._active
            n = len(active) & ~1  # whole pairs only (module doc)
            if n > self._measured:
                if self._measured_bytes < UNMEASURABLE:
                    try:
                        lengths = list(map(len, active[self._measured + 1 : n : 2]))
                    except TypeError:  # not bytes: the next cut fails the writer
                        self._measured_bytes = UNMEASURABLE
                    else:
                        self._measured_lengths += lengths
                        self._measured_bytes += sum(lengths)
                self._measured = n
            return self._measured_bytes

    def cut(self) -> Cut | None:
        """Take every change appended so far, checked. None if there is none, or if the buffer
        is not open (its changes are dropped), or if one is bad: that fails the buffer (module
        doc). A caller that numbers cuts serializes its calls with the numbering."""
        with self._lock:
            active = self._active
            n = len(active) & ~1  # a key group whose payload is still coming stays (module doc)
            if not n:
                return None
            key_groups = active[0:n:2]
            payloads = active[1:n:2]
            del active[:n]
            lengths, self._measured_lengths = self._measured_lengths, []
            size = self._measured_bytes  # of the lengths measured: the cut adds those of the rest
            self._measured = self._measured_bytes = self.estimate = 0
            if self._status is not BufferStatus.OPEN:
                return None
        try:
            kgs = _check_payloads_and_key_groups(key_groups, payloads)
            rest = list(map(len, payloads[len(lengths) :]))  # all bytes now: the measured ones are whole
            size += sum(rest)
            lengths += rest
            lengths_column = _lengths(lengths)
        except ConfigurationError as exc:
            self.fail(ConfigurationError(f"changelog writer {self.log_id}: bad change appended: {exc}"))
            return None
        rng = self.key_group_range
        distinct = set(key_groups)  # a few per changeset: cheaper than min and max of every change
        lo, hi = min(distinct), max(distinct)
        if lo < rng.start or hi > rng.end:
            self.fail(
                ConfigurationError(
                    f"changelog writer {self.log_id} owns key groups [{rng.start}, {rng.end}] "
                    f"but key group {lo if lo < rng.start else hi} was appended"
                )
            )
            return None
        return Cut(kgs, payloads, lengths_column, size, lo, hi)

    @property
    def gated(self) -> bool:
        """Whether the next append waits (``gate``)."""
        return self._owner._records is self._gate

    def gate(self) -> None:
        """Make the next append wait in ``wait`` (if the buffer is open and not gated already)."""
        owner = self._owner
        if owner._records is self._gate:  # the driver gates every round: no lock when it is
            return
        with self._lock:
            if owner._records is self._active or owner._records is self._waker:
                self._point(self._gate)

    def ungate(self) -> bool:
        """Let appends go straight to the list again; True if they were gated."""
        owner = self._owner
        if owner._records is not self._gate:  # the driver ungates every round: no lock when not gated
            return False
        with self._lock:
            if owner._records is not self._gate:
                return False
            self._point(self._active)
            return True

    def park(self) -> None:
        """The driver sleeps: the next append wakes it (``wake``), if the buffer is open and not gated."""
        with self._lock:
            if self._owner._records is self._active:
                self._point(self._waker)

    def unpark(self) -> None:
        """The driver is awake: appends go straight to the list again (unless gated)."""
        if self._owner._records is not self._waker:
            return
        with self._lock:
            if self._owner._records is self._waker:
                self._point(self._active)


class _Gate:
    """Stands in for the list while the driver holds appends back (module doc)."""

    def __init__(self, buffer: AppendBuffer) -> None:
        self._buffer = buffer

    def append(self, item: Any) -> None:
        buffer = self._buffer
        if not buffer._completes_a_pair():  # a payload follows its key group without waiting
            buffer._wait()
        buffer._extend([item])

    def __iadd__(self, items: list[Any]) -> list[Any]:
        buffer = self._buffer
        buffer._wait()
        return buffer._extend(items)


class _Waker:
    """Stands in for the list while the driver sleeps: appends, then wakes it (module doc)."""

    def __init__(self, buffer: AppendBuffer) -> None:
        self._buffer = buffer

    def append(self, item: Any) -> None:
        buffer = self._buffer
        whole = buffer._completes_a_pair()
        buffer._extend([item])
        if whole:
            buffer._wake()

    def __iadd__(self, items: list[Any]) -> list[Any]:
        buffer = self._buffer
        active = buffer._extend(items)
        buffer._wake()
        return active


class _Refusal:
    """Stands in for the list once the buffer takes no more changes: raises its status's error."""

    def __init__(self, buffer: AppendBuffer) -> None:
        self._buffer = buffer

    def append(self, item: object) -> None:
        raise self._buffer._refused("append")

    def __iadd__(self, items: object) -> Any:
        raise self._buffer._refused("append")
