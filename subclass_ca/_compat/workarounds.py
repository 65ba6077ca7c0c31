"""Torch-side workarounds: the inventory, their probes and their scopes.

Note [Workaround scopes]
------------------------
A workaround changes torch's behaviour, so it must apply only to the compilation it is
about; anything else compiled at the same time (a user's ``torch.compile``-d optimizer step,
a forward recompile) must see stock torch.  Each :class:`Workaround` therefore names its
``scope`` and owns a :class:`PatchSet` that the runtime acquires only there:

* ``"ca-graph-run"``: while one of subclass_ca's compiled CA graphs runs (Dynamo compiles
  and fakeifies the CA graph's inputs on its first call; nothing else compiles there).

A workaround is installed at all only where its ``probe`` says this torch needs it.
"""

from __future__ import annotations

import functools
import importlib
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._lookup import lookup
from ._patch import AttributeSwap, PatchSet

__all__ = ["Workaround", "WORKAROUNDS", "GRAD_CONTEXT", "needed_workarounds", "ca_graph_run_patches"]

SCOPES = ("ca-graph-run",)


@dataclass(frozen=True, kw_only=True)
class Workaround:
    """One torch-side fix subclass_ca applies, where and when."""

    name: str
    fixes: str
    """The torch misbehaviour it fixes, as a user sees it."""
    upstream: str
    """The upstream issue or pull request."""
    scope: str
    """Where it applies (Note [Workaround scopes])."""
    probe: Callable[[], bool]
    """True when this torch has the bug (the workaround is installed only then)."""
    patches: PatchSet

    def __post_init__(self) -> None:
        if self.scope not in SCOPES:
            raise ValueError(f"Workaround.scope: got {self.scope!r}, allowed values are {SCOPES}")

    @property
    def needed(self) -> bool:
        return self.probe()


_META_UTILS = "torch._subclasses.meta_utils"
_probe_results: dict[int, tuple[Any, bool]] = {}


def _grad_context_bug() -> bool:
    """Cached :func:`_probe_grad_context_bug`, per identity of torch's function."""
    try:
        compatible = lookup(_META_UTILS + ":_grad_context_compatible")
    except (ImportError, AttributeError):
        return False
    compatible = getattr(compatible, "__subclass_ca_original__", compatible)
    cached = _probe_results.get(id(compatible))
    if cached is None or cached[0] is not compatible:
        cached = _probe_results[id(compatible)] = (compatible, _probe_grad_context_bug(compatible))
    return cached[1]


def _probe_grad_context_bug(compatible: Callable[..., bool]) -> bool:
    """True where FakeTensor conversion reuses a plain tensor's symbolic context for its subclass ``.grad``.

    torch 2.13's ``meta_utils._grad_context_compatible`` only compares view-base structure,
    so a plain ``nn.Parameter`` whose ``.grad`` is a wrapper subclass (a TwoTensor grad
    flowing into a plain Linear) asserts ``Expected SubclassSymbolicContext or None, got
    StatefulSymbolicContext`` the first time Dynamo fakeifies it with that grad.
    """
    try:
        symbolic_shapes = importlib.import_module("torch.fx.experimental.symbolic_shapes")
        context = symbolic_shapes.StatelessSymbolicContext(dynamic_sizes=[symbolic_shapes.DimDynamic.STATIC])
    except (ImportError, AttributeError, TypeError):
        return False
    probe = types.SimpleNamespace(is_view=False, base=None, attrs={"a": None}, is_traceable_wrapper_subclass=True)
    try:
        return bool(compatible(context, probe))
    except Exception:  # noqa: BLE001 - a different implementation: leave it alone
        return False


def _patched_grad_context_compatible(original: Callable[..., bool]) -> Callable[..., bool]:
    symbolic_shapes = importlib.import_module("torch.fx.experimental.symbolic_shapes")

    @functools.wraps(original)
    def _grad_context_compatible(symbolic_context: Any, grad_desc: Any) -> bool:
        # A subclass grad needs a SubclassSymbolicContext: treat any other as incompatible so
        # meta_utils builds a fresh all-dynamic one from the grad (what upstream does since #186427).
        if getattr(grad_desc, "is_traceable_wrapper_subclass", False) and not isinstance(
            symbolic_context, symbolic_shapes.SubclassSymbolicContext
        ):
            return False
        return original(symbolic_context, grad_desc)

    _grad_context_compatible.__subclass_ca_original__ = original  # type: ignore[attr-defined]
    return _grad_context_compatible


GRAD_CONTEXT = Workaround(
    name="meta_utils._grad_context_compatible",
    fixes=(
        "a plain tensor whose .grad is a wrapper subclass cannot be fakeified "
        "(second backward with retain_graph=True, gradient accumulation into a plain parameter "
        "with a subclass .grad): 'Expected SubclassSymbolicContext or None, got StatefulSymbolicContext'"
    ),
    upstream="pytorch/pytorch#186427",
    scope="ca-graph-run",
    probe=_grad_context_bug,
    patches=PatchSet(
        "grad-context workaround",
        lambda: [AttributeSwap(lambda: importlib.import_module(_META_UTILS), "_grad_context_compatible",
                               _patched_grad_context_compatible, own_only=False)],
    ),
)

WORKAROUNDS: tuple[Workaround, ...] = (GRAD_CONTEXT,)
"""Every torch-side workaround subclass_ca knows (installed only where its probe says so)."""


def needed_workarounds() -> list[Workaround]:
    """The workarounds this torch needs."""
    return [w for w in WORKAROUNDS if w.needed]


def ca_graph_run_patches() -> list[PatchSet]:
    """Patch sets to acquire around one run of a compiled CA graph (scope ``"ca-graph-run"``)."""
    return [w.patches for w in WORKAROUNDS if w.scope == "ca-graph-run" and w.needed]
