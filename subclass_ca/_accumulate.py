"""AccumulateGrad under compiled autograd: keep the ``.grad`` type and dtype the way eager does.

See Note [Subclass gradients and AccumulateGrad] and Note [Gradient dtype at accumulation] below.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _compat
from .errors import UnsupportedSubclassError

__all__ = [
    "accumulate_subclass_grad",
    "assign_subclass_grad",
    "steal_subclass_accumulates",
    "accumulation_dtype",
    "grad_placeholder",
    "accumulate_dummy_swap",
]

# Note [Subclass gradients and AccumulateGrad]
# --------------------------------------------
# Eager AccumulateGrad *steals* a fresh gradient (``param.grad = grad``) when nothing else
# holds it and its strides match the parameter's, so a subclass-typed gradient stays
# subclass-typed and costs no copy.  Under compiled autograd the gradient is a graph value that
# is always referenced, so torch's AccumulateGrad (``call_accumulate_grad``) never steals: it
# allocates with ``grad.new_empty_strided(param.size(), param.stride())`` and ``copy_``s
# into it.  A subclass whose ``__torch_dispatch__`` answers ``new_empty_strided`` with a
# plain tensor (it implements compute ops only) therefore ends up with a dense ``.grad``, and
# every other one pays an allocation and a copy that eager does not.
# :func:`steal_subclass_accumulates` retargets the first accumulation (``.grad`` was None at
# capture) of every gradient one of our nodes rebuilds (proxy or inline mode) to
# :func:`accumulate_subclass_grad`, which steals exactly when eager does: nothing reads the
# gradient's values after it (one gradient handed to two parameters is cloned by the first
# AccumulateGrad and stolen by the last, as eager's reference count decides), and its layout matches (matching
# strides; a detached alias, as eager's ``new_grad.detach()``: torch 2.15 cannot fakeify the graph
# output itself as the next capture's ``.grad``) and defers to torch otherwise.  The rule reads
# only the graph, never the capture's fake values: a forward loaded from AOTAutograd's cache has none, and the CA graph captured from it
# must be the one a fresh forward gives (Note [One CA graph for fresh and cached forwards] in
# ``_canonical.py``).  Accumulating into an existing ``.grad`` is left to torch (``grad + new``),
# as in eager; an opaque node's gradient keeps torch's path too.

# Note [Parameters that cannot allocate]
# --------------------------------------
# While capturing, compiled autograd's ``accumulate_grad`` gives the parameter a placeholder
# ``.grad``: ``torch.empty_like(param)`` (``allocate_dummy_like``).  Nothing else needs the
# parameter to allocate -- eager never calls ``empty_like`` on it, the gradient is allocated
# from the gradient -- so a subclass parameter that implements only its compute ops (torchao's
# int8 quantized-training weight: ``NotImplementedError ... aten.empty_like``) trains in eager
# and compile-only but failed the capture with torch's raw error.  Inside ``enable()`` blocks
# :func:`accumulate_dummy_swap` keeps torch's placeholder where ``empty_like`` works and
# otherwise uses a plain ``empty_strided`` with the parameter's size, stride, dtype and device
# (:func:`grad_placeholder`): only a capture-time stand-in, re-traced by Dynamo from the real
# values, so the ``.grad`` type stays whatever the backward produces, as in eager.  Where even
# that cannot be built the capture raises :class:`UnsupportedSubclassError` naming the subclass,
# the op and the fix.

_stock_accumulate: Any = None


def accumulate_subclass_grad(
    variable: torch.Tensor, variable_grad: torch.Tensor | None, grad: torch.Tensor, has_post_hooks: bool | None = None
) -> torch.Tensor | None:
    """AccumulateGrad for a subclass gradient, stealing it the way eager does.

    See Note [Subclass gradients and AccumulateGrad]; Dynamo inlines this function.
    """
    if variable_grad is None and grad.stride() == variable.stride():
        variable.grad = grad.detach()
        return grad
    accumulated: torch.Tensor | None = _stock_accumulate(variable, variable_grad, grad, has_post_hooks)
    return accumulated


def assign_subclass_grad(variable: torch.Tensor, grad: torch.Tensor, has_post_hooks: bool) -> None:
    """:func:`accumulate_subclass_grad` for torch's assigning AccumulateGrad shape (up to torch 2.12).

    That shape's node reads ``variable.grad`` when the graph runs (Note [Two shapes of AccumulateGrad
    under compiled autograd] in ``_compat/accumulate.py``), so "is this the first
    accumulation" is decided here, as eager decides it.
    """
    if variable.grad is None and grad.stride() == variable.stride():
        variable.grad = grad.detach()
        return None
    assigned: None = _stock_accumulate(variable, grad, has_post_hooks)  # torch's assigning shape returns None
    return assigned


def steal_subclass_accumulates(graph_module: torch.fx.GraphModule, *, recompile: bool = True) -> list[str]:
    """Retarget first accumulations of rebuilt subclass grads to eager's steal; returns the subclass names.

    ``recompile=False``: the caller regenerates the graph's code itself (once for all its rewrites: a CA graph of
    64 blocks takes 0.1-0.2 s to generate).
    """
    global _stock_accumulate
    stock = _compat.call_accumulate_grad()
    _stock_accumulate = stock
    retargeted = []
    nodes = list(graph_module.graph.nodes)
    position = {node: index for index, node in enumerate(nodes)}
    for node in nodes:
        if node.op != "call_function" or node.target is not stock:
            continue
        parts = _compat.accumulate_node_parts(node.args)
        if parts is None:
            continue
        _, variable_grad, grad = parts
        meta = grad.meta.get("subclass_ca") if isinstance(grad, torch.fx.Node) else None
        first = variable_grad is None or variable_grad is _compat.NO_GRAD_ARG
        if first and meta is not None and meta["mode"] != "opaque" and not _still_referenced(grad, node, position):
            node.target = assign_subclass_grad if variable_grad is _compat.NO_GRAD_ARG else accumulate_subclass_grad
            retargeted.append(grad.target._subclass_ca_type.__name__)
    if retargeted and recompile:
        graph_module.recompile()
    return retargeted


def _still_referenced(grad: torch.fx.Node, accumulate: torch.fx.Node, position: dict[torch.fx.Node, int]) -> bool:
    """Whether the graph still reads ``grad``'s values after ``accumulate``: eager's AccumulateGrad then clones.

    The values are the rebuilt node's inner tensors, which other rebuilt nodes may wrap too (one
    gradient handed to two parameters: ``W0 + dW``); any read of the rebuilt node, of its inner
    tensors or of another node wrapping them after ``accumulate`` keeps them referenced, as the
    other AccumulateGrad keeps eager's gradient referenced (Note [Subclass gradients and AccumulateGrad]).
    """
    inner = [arg for arg in grad.all_input_nodes]
    aliases = {grad, *inner}
    for value in inner:
        aliases.update(user for user in value.users if user.meta.get("subclass_ca") is not None)
    return any(position[user] > position[accumulate] for alias in aliases for user in alias.users if user is not accumulate)


def grad_placeholder(param: torch.Tensor) -> torch.Tensor | None:
    """The capture-time ``.grad`` placeholder for a subclass parameter that cannot ``empty_like``.

    None for a plain tensor (torch's error stands).  See Note [Parameters that cannot allocate].
    """
    if not _compat.is_traceable_wrapper_subclass(param):
        return None
    try:
        return torch.empty_strided(param.size(), param.stride(), dtype=param.dtype, device=param.device)
    except Exception as error:
        name = type(param).__qualname__
        raise UnsupportedSubclassError(
            f"compiled autograd needs a placeholder for the .grad of a {name} parameter: aten.empty_like on the "
            f"{name} failed and a plain tensor of its size {list(param.size())}, dtype {param.dtype} and device "
            f"{param.device} could not be made either ({type(error).__name__}: {error}). Implement aten.empty_like "
            f"in {name}.__torch_dispatch__ (returning a {name} or a plain tensor of the same size)."
        ) from error


def accumulate_dummy_swap() -> _compat.Swap:
    """The swap giving compiled autograd :func:`grad_placeholder` where ``empty_like`` on a parameter fails."""
    return _compat.accumulate_dummy_swap(grad_placeholder)


# Note [Gradient dtype at accumulation]
# -------------------------------------
# Tensors have a ``grad_dtype`` (torch 2.13 already; default: the tensor's dtype): eager
# AccumulateGrad casts an incoming gradient to it before stealing or adding, and the ``.grad``
# setter refuses any other dtype.  FSDP2 relies on it from torch 2.15 on under
# ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``: its unsharded bf16 parameters get
# ``grad_dtype = reduce_dtype`` (or the original float32), so their gradients arrive in float32.
# Compiled autograd's capture does not apply the rule: ``AutogradCompilerInstance.accumulate_grad``
# allocates the placeholder ``.grad`` like the *parameter* (bf16) and assigns it, which the setter
# refuses ("attempting to assign a gradient with dtype BFloat16 to a tensor with grad_dtype
# 'Float'"), and its graph would hand a gradient of another dtype to ``call_accumulate_grad``.  So
# for every accumulation captured inside a block into a variable whose ``grad_dtype`` differs from
# its own dtype (plain and subclass gradients alike), the placeholder gets ``grad_dtype`` and a
# gradient of another dtype is cast to it first -- the cast eager makes, at the same point, so
# values are bitwise those of eager FSDP2 on aot_eager (``_compat.capture_accumulate_swap``).
# Where ``grad_dtype`` is unset, equal to the variable's dtype (the default) or absent, torch's
# own path runs unchanged: there compiled autograd already matches eager (on torch 2.13, FSDP2's
# bf16 parameters receive float32 gradients through it, and casting those would change values).
# The cast is decided at capture (FSDP2 sets the same ``grad_dtype`` every iteration): after
# changing a parameter's ``grad_dtype`` by hand, call ``subclass_ca.reset()`` so the next backward
# recaptures.  Accumulating over micro-batches then leaves a bf16 parameter holding a float32
# ``.grad``, which torch cannot fakeify for the next capture: a torch-side workaround converts it
# (Note [A .grad of another dtype than its leaf] in ``_compat/workarounds.py``).


def accumulation_dtype(variable: torch.Tensor, grad: Any) -> torch.dtype | None:
    """The dtype ``variable.grad`` must have where ``grad_dtype`` differs from ``variable``'s dtype (None: torch's path)."""
    dtype = _compat.grad_dtype_of(variable)
    if dtype is None or dtype == variable.dtype:
        return None
    return dtype
