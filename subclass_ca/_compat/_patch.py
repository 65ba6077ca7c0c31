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

Note [Resident patches]
-----------------------
Installing and restoring the runtime's patches around every ``enable()`` block (and the
workarounds around every run of a compiled CA graph) cost more than stock compiled
autograd's whole enter+exit.  So those patch sets are *resident*: installed by the first
block (or run) of the process and left in place, and every replacement is *gated* by a
:class:`Scope`, a process-wide counter of the places it is meant to act (``BLOCKS``: an
``enable()`` block is open; ``CA_GRAPH_RUN``: one of our compiled CA graphs runs; ``CA_CAPTURE``:
compiled autograd lifts a backward's inputs inside a block; an :class:`AnyScope` of several).  Outside
its scope a gated replacement calls torch's original with the same arguments and returns
its result, so torch behaves as stock (the parity suite's stock arm runs with the patches
resident).  Entering a scope is one counter increment.  ``uninstall_resident()`` (what
``subclass_ca.reset()`` calls outside every block) restores each attribute to the
identical (``is``) object torch had, and a later block installs again.  One resident set is
installed at import instead and acts outside blocks too: the AOTAutogradCache key wrapper
(``_runtime.KEY_PATCHES``), which leaves torch's key alone except for a forward a cache this user
saved names (Note [Forwards compiled outside a block] in ``subclass_ca/_warm_start/outside.py``).
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Swap", "AttributeSwap", "CallSwap", "PatchSet", "Scope", "AnyScope", "gated",
    "BLOCKS", "CA_GRAPH_RUN", "CA_CAPTURE", "uninstall_resident",
]


class Scope:
    """A process-wide count of the places gated replacements act in (Note [Resident patches])."""

    __slots__ = ("name", "depth", "_lock")

    def __init__(self, name: str) -> None:
        self.name = name
        self.depth = 0
        self._lock = threading.Lock()

    def enter(self) -> None:
        with self._lock:
            self.depth += 1

    def exit(self) -> None:
        with self._lock:
            if self.depth == 0:
                raise RuntimeError(f"subclass_ca scope {self.name!r} exited more often than entered")
            self.depth -= 1

    def __repr__(self) -> str:
        return f"Scope({self.name!r}, depth={self.depth})"


class AnyScope:
    """Inside any of several scopes: a gate for a replacement that acts in more than one place."""

    __slots__ = ("name", "scopes")

    def __init__(self, *scopes: Scope) -> None:
        self.scopes = scopes
        self.name = " or ".join(scope.name for scope in scopes)

    @property
    def depth(self) -> int:
        return sum(scope.depth for scope in self.scopes)

    def __repr__(self) -> str:
        return f"AnyScope({', '.join(map(repr, self.scopes))})"


BLOCKS = Scope("an enable() block is open")
CA_GRAPH_RUN = Scope("a subclass_ca compiled CA graph runs")
CA_CAPTURE = Scope("compiled autograd lifts a backward's inputs to fake tensors inside a block (begin_capture)")


def gated(scope: Scope | AnyScope, original: Callable[..., Any], replacement: Callable[..., Any]) -> Callable[..., Any]:
    """``replacement`` inside ``scope``, torch's ``original`` (same arguments) outside it."""

    @functools.wraps(original)
    def gate(*args: Any, **kwargs: Any) -> Any:
        if scope.depth:
            return replacement(*args, **kwargs)
        return original(*args, **kwargs)

    gate.__subclass_ca_original__ = original  # type: ignore[attr-defined]
    gate.__subclass_ca_gate__ = scope  # type: ignore[attr-defined]
    return gate


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

    def holds(self, replacement: Any) -> bool:
        """Whether ``replacement`` is still what is installed (False: other code patched over it)."""
        return True


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

    def holds(self, replacement: Any) -> bool:
        return self.read() is replacement

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

    def __init__(self, name: str, swaps: Callable[[], list[Swap]], *, resident: bool = False) -> None:
        self.name = name
        self.resident = resident
        """Installed once and left in place, every replacement gated (Note [Resident patches])."""
        self.is_installed = False
        self._make_swaps = swaps
        self._swaps: list[Swap] | None = None
        self._lock = threading.RLock()
        self._holders = 0
        self._saved: list[tuple[Swap, Any, Any]] = []
        """Per installed swap: (swap, torch's original, our replacement)."""
        self._replacements: dict[int, tuple[Any, Any]] = {}
        """Per swap: (original, replacement) of the last install, reused while torch's original is unchanged."""

    @property
    def holders(self) -> int:
        return self._holders

    def install(self) -> None:
        """Install a resident set (a no-op once installed; the fast path of every block)."""
        if self.is_installed:
            return
        if not self.resident:
            raise RuntimeError(f"subclass_ca patch set {self.name!r} is scoped: acquire() and release() it")
        with self._lock:
            if not self.is_installed:
                self._install()
                _RESIDENT.add(self)

    def uninstall(self) -> None:
        """Put every attribute of a resident set back to torch's identical object."""
        with self._lock:
            if self.is_installed:
                self._restore()

    def acquire(self) -> None:
        if self.resident:
            raise RuntimeError(f"subclass_ca patch set {self.name!r} is resident: install() it")
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
        saved: list[tuple[Swap, Any, Any]] = []
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
                saved.append((swap, original, replacement))
        except BaseException:
            for swap, original, _ in reversed(saved):
                swap.write(original)
            raise
        self._saved = saved
        self.is_installed = True

    def _restore(self) -> None:
        saved, self._saved = self._saved, []
        self.is_installed = False
        replaced_since = []
        for swap, original, replacement in reversed(saved):
            if not swap.holds(replacement):
                replaced_since.append(swap.describe())  # someone patched over us: theirs stays
                continue
            swap.write(original)
        if replaced_since:
            raise RuntimeError(
                f"subclass_ca patch set {self.name!r}: {replaced_since} were replaced by other code after subclass_ca "
                "installed its own; they were left as they are (restoring would drop that code's change). Restore "
                "them in reverse order of patching."
            )

    def original(self, swap_name: str) -> Any:
        """The saved original of the swap described as ``swap_name`` (while installed), else None."""
        with self._lock:
            for swap, original, _ in self._saved:
                if swap.describe().endswith(swap_name):
                    return original
        return None

    def installed(self) -> list[str]:
        """What is replaced right now (for tests and diagnostics)."""
        with self._lock:
            return [swap.describe() for swap, _, _ in self._saved]

    @contextmanager
    def applied(self) -> Iterator[None]:
        self.acquire()
        try:
            yield
        finally:
            self.release()


_RESIDENT: weakref.WeakSet[PatchSet] = weakref.WeakSet()


def uninstall_resident() -> list[str]:
    """Restore every installed resident patch set (Note [Resident patches]); the names restored.

    Refused while a scope is active: the patches are in use.
    """
    for scope in (BLOCKS, CA_GRAPH_RUN):
        if scope.depth:
            raise RuntimeError(f"subclass_ca cannot restore torch's attributes while {scope.name}")
    restored = []
    for patches in list(_RESIDENT):
        if patches.is_installed:
            restored.append(patches.name)
            patches.uninstall()
        _RESIDENT.discard(patches)
    return sorted(restored)
