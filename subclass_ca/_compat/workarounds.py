"""Torch-side workarounds: the inventory, their probes and their scopes.

Note [Workaround scopes]
------------------------
A workaround changes torch's behaviour, so it must apply only to the compilation it is
about; anything else compiled at the same time (a user's ``torch.compile``-d optimizer step,
a forward recompile) must see stock torch.  Each :class:`Workaround` therefore names its
``scope`` and owns a resident :class:`PatchSet` whose replacements act only there and call
torch's original everywhere else (Note [Resident patches] in ``_patch.py``):

* ``"ca-graph-run"`` (the ``CA_GRAPH_RUN`` scope): while one of subclass_ca's compiled CA
  graphs runs (Dynamo compiles and fakeifies the CA graph's inputs on its first call;
  nothing else compiles there).
* ``"ca-capture-and-graph-run"``: the above, and while compiled autograd lifts a backward's
  inputs to fake tensors inside a block (``CA_CAPTURE``: torch's ``begin_capture``), for a
  fakeification bug that both the capture and the CA graph's compile meet.

A workaround is installed at all only where its ``probe`` says this torch needs it.
"""

from __future__ import annotations

import importlib
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ._lookup import lookup
from ._patch import CA_CAPTURE, CA_GRAPH_RUN, AnyScope, AttributeSwap, PatchSet, Scope, gated
from .dynamo import outside_tracing
from .optimizer_tracing import optimizer_tracing_available, optimizer_tracing_swaps

__all__ = [
    "Workaround",
    "WORKAROUNDS",
    "GRAD_CONTEXT",
    "GRAD_STATIC_CONTEXT",
    "needed_workarounds",
    "ca_graph_run_patches",
    "ca_capture_patches",
    "compiled_step_on_subclass_grads_is_wrong",
    "steps_compile_in",
]

SCOPES: dict[str, Scope | AnyScope] = {
    "ca-graph-run": CA_GRAPH_RUN,
    "ca-capture-and-graph-run": AnyScope(CA_CAPTURE, CA_GRAPH_RUN),
}


def _acts_in(scope_name: str, scope: Scope) -> bool:
    gate = SCOPES[scope_name]
    return gate is scope or scope in getattr(gate, "scopes", ())


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
    stock_error: str
    """A regex of the error stock compiled autograd raises where this workaround applies."""

    def __post_init__(self) -> None:
        if self.scope not in SCOPES:
            raise ValueError(f"Workaround.scope: got {self.scope!r}, allowed values are {sorted(SCOPES)}")

    @property
    def needed(self) -> bool:
        return self.probe()


_META_UTILS = "torch._subclasses.meta_utils"
_probe_results: dict[int, tuple[Any, bool]] = {}


def _probed(function: Any, probe: Callable[[Any], bool]) -> bool:
    """``probe(torch's function)``, cached per identity of that function (our gate around it is looked through)."""
    function = getattr(function, "__subclass_ca_original__", function)
    cached = _probe_results.get(id(function))
    if cached is None or cached[0] is not function:
        cached = _probe_results[id(function)] = (function, probe(function))
    return cached[1]


def _grad_context_bug() -> bool:
    """Whether FakeTensor conversion gives a plain tensor's subclass ``.grad`` the plain tensor's symbolic context.

    Two forms, both probed on this torch, neither by version: a ``_grad_context_compatible`` check
    that lets such a context through (:func:`_grad_context_check_bug`, torch 2.13), or no check at
    all, the ``.grad`` always recycling its parent's context (:func:`_grad_context_recycled`, up to
    torch 2.12).
    """
    return _grad_context_check_bug() or _grad_context_recycled()


def _grad_context_check_bug() -> bool:
    """Cached :func:`_probe_grad_context_bug` of this torch's ``_grad_context_compatible`` (False: none)."""
    try:
        compatible = lookup(_META_UTILS + ":_grad_context_compatible")
    except (ImportError, AttributeError):
        return False
    return _probed(compatible, _probe_grad_context_bug)


def _grad_context_recycled() -> bool:
    """True where there is no ``_grad_context_compatible`` and a subclass ``.grad`` fails to fakeify for it.

    Without the check, ``MetaConverter.meta_tensor`` hands the ``.grad`` its parent's symbolic
    context unconditionally ("TODO: Use a valid grad-specific symbolic context"), which a wrapper
    subclass refuses.  Probed by doing it: a plain parameter with a TwoTensor ``.grad`` fakeified
    under a ShapeEnv with a stateful context, as Dynamo does (cached: once per process).
    """
    try:
        lookup(_META_UTILS + ":_grad_context_compatible")
        return False
    except (ImportError, AttributeError):
        pass
    return _probed(lookup(_META_UTILS + ":MetaConverter.meta_tensor"), _probe_grad_context_recycled)


def _probe_grad_context_recycled(_meta_tensor: Any) -> bool:
    try:
        fake_tensor = importlib.import_module("torch._subclasses.fake_tensor")
        symbolic_shapes = importlib.import_module("torch.fx.experimental.symbolic_shapes")
        source = lookup("torch._dynamo.source:LocalSource")("subclass_ca_probe")
        two_tensor = lookup("torch.testing._internal.two_tensor:TwoTensor")
        parameter = torch.nn.Parameter(torch.zeros(2, 2))
        parameter.grad = two_tensor(torch.zeros(2, 2), torch.zeros(2, 2))
        context = symbolic_shapes.StatefulSymbolicContext(
            dynamic_sizes=[symbolic_shapes.DimDynamic.STATIC] * 2, constraint_sizes=[None] * 2,
            tensor_source=source, shape_env_to_source_to_symbol_cache={},
        )
        mode = fake_tensor.FakeTensorMode(shape_env=symbolic_shapes.ShapeEnv())
    except Exception:  # noqa: BLE001 - the probe's pieces differ on this torch: nothing known to fix
        return False
    try:
        with outside_tracing(), mode:
            mode.from_tensor(parameter, source=source, symbolic_context=context)
    except AssertionError as error:
        return "SubclassSymbolicContext" in str(error)
    except Exception:  # noqa: BLE001 - another failure: not the bug this fixes
        return False
    return False


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


def compiled_step_on_subclass_grads_is_wrong() -> bool:
    """Whether a ``torch.compile``-d optimizer step over plain parameters with subclass ``.grad`` computes wrong values.

    Seen on torch 2.14.1 and 2.15.0 (AdamW, TwoTensor grads on plain parameters; with or without
    compiled autograd: a torch bug, see docs/training_styles.md), not a version gate: torch 2.13
    refuses to fakeify such a grad (``Expected SubclassSymbolicContext``, the bug
    :func:`_grad_context_bug` probes) and so never compiles the step; the torch releases that fixed
    that refusal (pytorch#186427) compile it and compute it wrong.  So the step is affected exactly
    where the refusal is gone.  A torch that fixes the wrong values needs this to say False again.
    """
    return not _grad_context_bug()


def _patched_grad_context_compatible(original: Callable[..., bool]) -> Callable[..., bool]:
    symbolic_shapes = importlib.import_module("torch.fx.experimental.symbolic_shapes")

    def _grad_context_compatible(symbolic_context: Any, grad_desc: Any) -> bool:
        # A subclass grad needs a SubclassSymbolicContext: treat any other as incompatible so
        # meta_utils builds a fresh all-dynamic one from the grad (what upstream does since #186427).
        if getattr(grad_desc, "is_traceable_wrapper_subclass", False) and not isinstance(
            symbolic_context, symbolic_shapes.SubclassSymbolicContext
        ):
            return False
        return original(symbolic_context, grad_desc)

    return gated(CA_GRAPH_RUN, original, _grad_context_compatible)


GRAD_CONTEXT = Workaround(
    name="meta_utils._grad_context_compatible",
    fixes=(
        "a plain tensor whose .grad is a wrapper subclass cannot be fakeified "
        "(second backward with retain_graph=True, gradient accumulation into a plain parameter "
        "with a subclass .grad): 'Expected SubclassSymbolicContext or None, got StatefulSymbolicContext'"
    ),
    upstream="pytorch/pytorch#186427",
    scope="ca-graph-run",
    probe=_grad_context_check_bug,
    stock_error="Expected SubclassSymbolicContext or None",
    patches=PatchSet(
        "grad-context workaround",
        lambda: [AttributeSwap(lambda: importlib.import_module(_META_UTILS), "_grad_context_compatible",
                               _patched_grad_context_compatible, own_only=False)],
        resident=True,
    ),
)

def steps_compile_in() -> bool:
    """Whether optimizer steps may be compiled into a CA graph on this torch (Note [Optimizer steps compiled into
    the CA graph], *Which torch*): its Dynamo has the pieces, and AOT's flat layout is the one before per-inner
    symints (with them, torch 2.14 applied an NF4-QLoRA graph's parameter mutations to tensors of the wrong size)."""
    return optimizer_tracing_available() and not _plain_meta_has_inner_symints()


def _plain_meta_has_inner_symints() -> bool:
    """torch >= 2.14: plain inner tensors of a subclass carry their own symints in AOT's flat layout."""
    try:
        plain = lookup("torch._functorch._aot_autograd.schemas:PlainTensorMeta")
    except (ImportError, AttributeError):
        return False
    return "size_symbol_placeholders" in getattr(plain, "__dataclass_fields__", {})


def _grad_dynamic_context_bug() -> bool:
    """True where a subclass ``.grad`` of a plain tensor is fakeified all-dynamic *and* AOT flattens inner symints.

    torch 2.14/2.15 fixed the 2.13 bug by giving such a ``.grad`` a fresh all-dynamic context
    (``all_dynamic_symbolic_context``).  When the CA graph then accumulates in place into that
    ``.grad`` (a mutated subclass input), AOT's output metadata for the mutation counts no inner
    symints while the traced graph returns them, and the generated subclass wrapper raises
    ``expected N wrapped outputs, got M`` (seen through Dynamo as ``Attempt to trace generator``).
    """
    if _grad_context_bug() or not _plain_meta_has_inner_symints():
        return False
    try:
        converter = lookup(_META_UTILS + ":MetaConverter")
        lookup("torch.fx.experimental.symbolic_shapes:SubclassSymbolicContext")
        lookup("torch._dynamo.source:AttrSource")
    except (ImportError, AttributeError):
        return False
    return callable(getattr(converter, "meta_tensor", None))


def _grad_static_context_needed() -> bool:
    """The subclass ``.grad`` of a plain tensor needs a static context of ours: torch 2.14/2.15's all-dynamic one
    breaks accumulation (:func:`_grad_dynamic_context_bug`), or torch up to 2.12 recycles the parent's
    (:func:`_grad_context_recycled`)."""
    return _grad_dynamic_context_bug() or _grad_context_recycled()


_meta_parents = threading.local()


def _static_context(desc: Any, source: Any) -> Any:
    """A symbolic context with every (outer and inner) dim static for the tensor described by ``desc``."""
    symbolic_shapes = importlib.import_module("torch.fx.experimental.symbolic_shapes")
    attr_source = lookup("torch._dynamo.source:AttrSource")
    static = symbolic_shapes.DimDynamic.STATIC
    if getattr(desc, "is_traceable_wrapper_subclass", False):
        inner = {attr: _static_context(d, attr_source(source, attr)) for attr, d in (desc.attrs or {}).items()}
        return symbolic_shapes.SubclassSymbolicContext(
            dynamic_sizes=[static] * desc.ndim, constraint_sizes=[None] * desc.ndim,
            inner_contexts=inner, tensor_source=source,
        )
    return symbolic_shapes.StatelessSymbolicContext(dynamic_sizes=[static] * desc.ndim, constraint_sizes=[None] * desc.ndim)


def _patched_meta_tensor(original: Callable[..., Any]) -> Callable[..., Any]:
    def meta_tensor(self: Any, t: Any, shape_env: Any, callback: Any, source: Any, symbolic_context: Any) -> Any:
        stack = getattr(_meta_parents, "stack", None)
        if stack is None:
            stack = _meta_parents.stack = []
        parent = stack[-1] if stack else None
        if (
            shape_env is not None
            and parent is not None
            and getattr(parent, "grad", None) is t
            and not getattr(parent, "is_traceable_wrapper_subclass", False)
            and getattr(t, "is_traceable_wrapper_subclass", False)
            and getattr(source, "member", None) == "grad"
        ):
            # the subclass .grad of a plain tensor: static like the parameter it belongs to
            symbolic_context = _static_context(t, source)
        stack.append(t)
        try:
            return original(self, t, shape_env, callback, source, symbolic_context)
        finally:
            stack.pop()

    return gated(CA_GRAPH_RUN, original, meta_tensor)


GRAD_STATIC_CONTEXT = Workaround(
    name="meta_utils.MetaConverter.meta_tensor",
    fixes=(
        "on torch 2.14/2.15, accumulating into a plain tensor's subclass .grad (2nd backward with "
        "retain_graph=True, gradient accumulation) fails compiling the CA graph: 'expected N wrapped outputs, "
        "got M' / 'Attempt to trace generator'; up to torch 2.12 such a .grad cannot be fakeified at all "
        "('Expected SubclassSymbolicContext or None'); the workaround gives that .grad a static symbolic context"
    ),
    upstream="pytorch/pytorch#186427 (up to 2.13); none filed yet for the torch 2.14/2.15 regression after it",
    scope="ca-graph-run",
    probe=_grad_static_context_needed,
    stock_error="wrapped outputs|Attempt to trace generator|Expected SubclassSymbolicContext or None",
    patches=PatchSet(
        "grad static-context workaround",
        lambda: [AttributeSwap(lambda: lookup(_META_UTILS + ":MetaConverter"), "meta_tensor", _patched_meta_tensor)],
        resident=True,
    ),
)

# Note [A .grad of another dtype than its leaf]
# ---------------------------------------------
# A leaf may hold a ``.grad`` of another dtype than its own once its ``grad_dtype`` says so: a
# bf16 parameter with ``grad_dtype = torch.float32`` accumulates float32 gradients (what FSDP2's
# ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` sets up from torch 2.15; Note [Gradient
# dtype at accumulation] in ``_accumulate.py``).  Fakeifying such a leaf fails in torch:
# ``MetaConverter.meta_tensor`` assigns the fake ``.grad`` while the fake leaf still has the
# default ``grad_dtype`` (its own dtype), and ``FakeTensorConverter.from_real_tensor`` copies
# ``grad_dtype`` over only afterwards (pytorch/pytorch#180403).  So the *second* backward of a
# gradient accumulation (the first that finds a ``.grad``) fails at compiled autograd's capture
# with "attempting to assign a gradient with dtype 'float' to a tensor with grad_dtype
# 'BFloat16'" -- which compiled autograd re-raises as "Found tensor of type Parameter, which is
# not supported by FakeTensorMode" -- and the CA graph's Dynamo compile would fail the same way.
# The workaround converts such a leaf with its ``.grad`` set aside (the real leaf's ``.grad`` is
# the same object again before anything else runs), gives the fake leaf the real one's
# ``grad_dtype`` where torch did not, then converts the ``.grad`` with the source torch would give
# it (``<leaf>.grad``) and assigns it: the fake leaf torch would have built, in the other order.


def _leaf_grad_of_other_dtype(tensor: Any) -> Any:
    """The ``.grad`` of a leaf that fakeification cannot assign (Note [A .grad of another dtype than its leaf]), or None."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_leaf:
        return None
    grad = tensor.grad
    if grad is None or grad.dtype == tensor.dtype:
        return None
    return grad


def _leaves_with_grads_of_other_dtype(tensor: Any) -> list[tuple[Any, Any]]:
    """(leaf, its ``.grad``) for ``tensor`` itself and, for a view, its base: what converting ``tensor`` fakeifies."""
    found = []
    for leaf in (tensor, tensor._base if isinstance(tensor, torch.Tensor) and tensor._is_view() else None):
        grad = _leaf_grad_of_other_dtype(leaf)
        if grad is not None:
            found.append((leaf, grad))
    return found


def _patched_from_real_tensor(original: Callable[..., Any]) -> Callable[..., Any]:
    attr_source = lookup("torch._dynamo.source:AttrSource")

    def from_real_tensor(self: Any, fake_mode: Any, t: Any, *args: Any, **kwargs: Any) -> Any:
        set_aside = _leaves_with_grads_of_other_dtype(t)
        if not set_aside:
            return original(self, fake_mode, t, *args, **kwargs)
        for leaf, _grad in set_aside:
            leaf.grad = None
        try:
            fake = original(self, fake_mode, t, *args, **kwargs)
        finally:
            for leaf, grad in set_aside:
                leaf.grad = grad
        source = kwargs.get("source")
        grad_kwargs = {key: value for key, value in kwargs.items() if key != "symbolic_context"}  # the .grad's own
        for leaf, grad in set_aside:
            fake_leaf, leaf_source = (fake, source) if leaf is t else (fake._base, attr_source(source, "_base") if source else None)
            if fake_leaf is None or not fake_leaf.is_leaf or fake_leaf.grad is not None:
                continue
            if fake_leaf.grad_dtype != leaf.grad_dtype:
                fake_leaf.grad_dtype = leaf.grad_dtype
            grad_kwargs["source"] = attr_source(leaf_source, "grad") if leaf_source is not None else None
            fake_leaf.grad = original(self, fake_mode, grad, *args, **grad_kwargs)
        return fake

    return gated(SCOPES["ca-capture-and-graph-run"], original, from_real_tensor)


def _grad_dtype_fakeify_bug() -> bool:
    """Cached :func:`_probe_grad_dtype_fakeify_bug`."""
    try:
        converter = lookup("torch._subclasses.fake_tensor:FakeTensorConverter")
        lookup("torch._dynamo.source:AttrSource")
    except (ImportError, AttributeError):
        return False
    convert = converter.__dict__.get("from_real_tensor")
    return convert is not None and _probed(convert, _probe_grad_dtype_fakeify_bug)


def _probe_grad_dtype_fakeify_bug(convert: Callable[..., Any]) -> bool:
    """True where torch's ``from_real_tensor`` fails on a bf16 leaf holding a float32 ``.grad`` (``grad_dtype``)."""
    if not hasattr(torch.Tensor, "grad_dtype"):
        return False
    try:
        fake_tensor = importlib.import_module("torch._subclasses.fake_tensor")
        leaf = torch.zeros(2, dtype=torch.bfloat16, requires_grad=True)
        leaf.grad_dtype = torch.float32
        leaf.grad = torch.zeros(2, dtype=torch.float32)
        mode = fake_tensor.FakeTensorMode()
    except Exception:  # noqa: BLE001 - no grad_dtype rule to meet: nothing to fix
        return False
    try:
        with outside_tracing():  # probed on a capture's first call, before its modes are entered
            convert(mode.fake_tensor_converter, mode, leaf)
    except RuntimeError as error:
        return "grad_dtype" in str(error)
    except Exception:  # noqa: BLE001 - a different implementation: leave it alone
        return False
    return False


GRAD_DTYPE_FAKEIFY = Workaround(
    name="fake_tensor.FakeTensorConverter.from_real_tensor",
    fixes=(
        "a leaf holding a .grad of another dtype (grad_dtype: a bf16 parameter accumulating float32 gradients, "
        "FSDP2 bf16 mixed precision with gradient accumulation) cannot be fakeified: the second backward's capture "
        "fails with 'attempting to assign a gradient with dtype 'float' to a tensor with grad_dtype 'BFloat16'' "
        "(re-raised as 'Found tensor of type Parameter, which is not supported by FakeTensorMode')"
    ),
    upstream="none filed yet (pytorch/pytorch#180403 copies grad_dtype only after the fake .grad is assigned)",
    scope="ca-capture-and-graph-run",
    probe=_grad_dtype_fakeify_bug,
    stock_error="not supported by FakeTensorMode|grad_dtype",
    patches=PatchSet(
        "grad-dtype fakeification workaround",
        lambda: [AttributeSwap(lambda: lookup("torch._subclasses.fake_tensor:FakeTensorConverter"), "from_real_tensor",
                               _patched_from_real_tensor)],
        resident=True,
    ),
)

OPTIMIZER_IN_BACKWARD = Workaround(
    name="optimizer_tracing.optimizer_tracing_swaps",
    fixes=(
        "an optimizer step inside a post-accumulate-grad hook (optimizer-in-backward, torchtune's optimizer_in_bwd) "
        "cannot be compiled into the CA graph with fullgraph=True: 'Call to torch._dynamo.graph_break()', "
        "'Optimizer.zero_grad should not be traced', 'optimizer: pending mutation on parameter' "
        "(Note [Optimizer steps compiled into the CA graph])"
    ),
    upstream="pytorch/pytorch#104053 (the graph breaks in _use_grad_for_differentiable)",
    scope="ca-graph-run",
    probe=optimizer_tracing_available,
    stock_error="graph_break|zero_grad|pending mutation",
    patches=PatchSet("optimizer-in-backward tracing", optimizer_tracing_swaps, resident=True),
)

WORKAROUNDS: tuple[Workaround, ...] = (GRAD_CONTEXT, GRAD_STATIC_CONTEXT, GRAD_DTYPE_FAKEIFY, OPTIMIZER_IN_BACKWARD)
"""Every torch-side workaround subclass_ca knows (installed only where its probe says so)."""


def needed_workarounds() -> list[Workaround]:
    """The workarounds this torch needs."""
    return [w for w in WORKAROUNDS if w.needed]


def ca_graph_run_patches() -> list[PatchSet]:
    """Resident patch sets acting while a compiled CA graph runs: install them before its first run."""
    return [w.patches for w in WORKAROUNDS if _acts_in(w.scope, CA_GRAPH_RUN) and w.needed]


def ca_capture_patches() -> list[PatchSet]:
    """Resident patch sets acting while compiled autograd lifts a backward's inputs: install them before."""
    return [w.patches for w in WORKAROUNDS if _acts_in(w.scope, CA_CAPTURE) and w.needed]
