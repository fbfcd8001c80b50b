"""A bounded history indexed by position in the whole stream: what a long-running unit keeps of its records.

A unit that serves for days must not keep every step record, raw step message and outcome. :class:`History`
keeps the last ``maxlen`` items, and its indexes keep counting from the first item ever appended, so the
existing way of taking "what came since a mark" still works::

    mark = len(unit.records)      # how many have been appended so far
    ...                           # the run
    new = unit.records[mark:]     # everything appended since (a list)

A slice clips to what is still kept (:attr:`History.num_dropped` says how much is gone: check
:meth:`History.kept_since` when that matters); an integer index of a dropped item raises ``IndexError``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from itertools import islice
from typing import Generic, TypeVar, overload

T = TypeVar("T")


class History(Generic[T]):
    """The last ``maxlen`` items of an append-only stream; ``len()`` is the number ever appended."""

    def __init__(self, maxlen: int) -> None:
        if maxlen < 1:
            raise ValueError("maxlen must be at least 1")
        self.maxlen = maxlen
        self._items: deque[T] = deque(maxlen=maxlen)
        self._total = 0

    def append(self, item: T) -> None:
        self._items.append(item)
        self._total += 1

    @property
    def num_dropped(self) -> int:
        """Items appended and no longer kept (the oldest)."""
        return self._total - len(self._items)

    def kept_since(self, mark: int) -> bool:
        """True when every item from position ``mark`` on is still kept."""
        return mark >= self.num_dropped

    def __len__(self) -> int:
        return self._total

    def __iter__(self) -> Iterator[T]:
        """The kept items, oldest first."""
        return iter(self._items)

    @overload
    def __getitem__(self, index: int) -> T: ...

    @overload
    def __getitem__(self, index: slice) -> list[T]: ...

    def __getitem__(self, index: int | slice) -> T | list[T]:
        first = self.num_dropped
        if isinstance(index, slice):
            start, stop, step = index.indices(self._total)
            if step != 1:
                raise ValueError("History slices take no step")
            start = max(start, first)
            if stop <= start:
                return []
            return list(islice(self._items, start - first, stop - first))
        position = index + self._total if index < 0 else index
        if not first <= position < self._total:
            raise IndexError(f"position {index} is not kept (kept: {first}..{self._total - 1})")
        return self._items[position - first]

    def __bool__(self) -> bool:
        return self._total > 0

    def __repr__(self) -> str:
        return f"History(maxlen={self.maxlen}, appended={self._total}, kept={len(self._items)})"
