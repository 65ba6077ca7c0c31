"""The one re-entrant patch mechanism for temporary changes to torch.

Note [One patcher]
------------------
Every change subclass_ca makes to torch's own objects (a method on a class, a function in a
module, a C++ hook) is a :class:`Swap` inside a named :class:`PatchSet`.  A patch set is
*acquired* by each user (an ``enable()`` block, one run of a compiled CA graph) and *released*
by it: the first acquire saves the current values and installs the replacements, the last
release puts the saved objects back, identical (``is``) to what was there.  Replacements are
built once per original and reused, so a re-install costs a few attribute writes.  Acquire and
release are counted under one lock, so blocks may nest, re-enter, run in other threads or
be released in any order; a release without its acquire raises instead of corrupting the
count.  Nothing else in the package assigns to a torch attribute.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = ["Swap", "AttributeSwap", "CallSwap", "PatchSet"]


class Swap:
    """One replaceable value: how to read it, write it, and what to write while patched."""

    def read(self) -> Any:
        raise NotImplementedError

    def write(self, value: Any) -> None:
        raise NotImplementedError

    def replacement(self, original: Any) -> Any:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


@dataclass
class AttributeSwap(Swap):
    """``owner.name`` (owner found lazily by ``locate``, once) replaced by ``make(original)``."""

    locate: Callable[[], Any]
    name: str
    make: Callable[[Any], Any]
    own_only: bool = True
    """Read the owner's own ``__dict__`` entry (a class attribute, not an inherited one)."""
    _owner: Any = None

    def _resolved(self) -> Any:
        if self._owner is None:
            self._owner = self.locate()
        return self._owner

    def read(self) -> Any:
        owner = self._resolved()
        if self.own_only and isinstance(owner, type):
            return owner.__dict__[self.name]
        return getattr(owner, self.name)

    def write(self, value: Any) -> None:
        setattr(self._resolved(), self.name, value)

    def replacement(self, original: Any) -> Any:
        return self.make(original)

    def describe(self) -> str:
        owner = self._resolved()
        return f"{getattr(owner, '__module__', '')}.{getattr(owner, '__qualname__', getattr(owner, '__name__', owner))}.{self.name}"


@dataclass(frozen=True)
class CallSwap(Swap):
    """A value behind a getter/setter pair (e.g. a C++ hook), replaced by ``make(original)``."""

    get: Callable[[], Any]
    set: Callable[[Any], Any]
    make: Callable[[Any], Any]
    label: str

    def read(self) -> Any:
        return self.get()

    def write(self, value: Any) -> None:
        self.set(value)

    def replacement(self, original: Any) -> Any:
        return self.make(original)

    def describe(self) -> str:
        return self.label


class PatchSet:
    """Swaps installed while at least one holder has acquired the set (Note [One patcher])."""

    def __init__(self, name: str, swaps: Callable[[], list[Swap]]) -> None:
        self.name = name
        self._make_swaps = swaps
        self._swaps: list[Swap] | None = None
        self._lock = threading.RLock()
        self._holders = 0
        self._saved: list[tuple[Swap, Any]] = []
        self._replacements: dict[int, tuple[Any, Any]] = {}
        """Per swap: (original, replacement) of the last install, reused while torch's original is unchanged."""

    @property
    def holders(self) -> int:
        return self._holders

    def acquire(self) -> None:
        with self._lock:
            if self._holders == 0:
                self._install()
            self._holders += 1

    def release(self) -> None:
        with self._lock:
            if self._holders == 0:
                raise RuntimeError(f"subclass_ca patch set {self.name!r} released more often than acquired")
            self._holders -= 1
            if self._holders == 0:
                self._restore()

    def _install(self) -> None:
        saved: list[tuple[Swap, Any]] = []
        if self._swaps is None:
            self._swaps = list(self._make_swaps())
        try:
            for index, swap in enumerate(self._swaps):
                original = swap.read()
                cached = self._replacements.get(index)
                if cached is not None and cached[0] is original:
                    replacement = cached[1]
                else:
                    replacement = swap.replacement(original)
                    self._replacements[index] = (original, replacement)
                if replacement is original:
                    continue
                swap.write(replacement)
                saved.append((swap, original))
        except BaseException:
            for swap, original in reversed(saved):
                swap.write(original)
            raise
        self._saved = saved

    def _restore(self) -> None:
        saved, self._saved = self._saved, []
        for swap, original in reversed(saved):
            swap.write(original)

    def original(self, swap_name: str) -> Any:
        """The saved original of the swap described as ``swap_name`` (while installed), else None."""
        with self._lock:
            for swap, original in self._saved:
                if swap.describe().endswith(swap_name):
                    return original
        return None

    def installed(self) -> list[str]:
        """What is replaced right now (for tests and diagnostics)."""
        with self._lock:
            return [swap.describe() for swap, _ in self._saved]

    @contextmanager
    def applied(self) -> Iterator[None]:
        self.acquire()
        try:
            yield
        finally:
            self.release()
