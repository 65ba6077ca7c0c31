"""Dynamo tracing ``torch.optim`` steps called from a post-accumulate-grad hook inside a CA graph.

Note [Optimizer steps compiled into the CA graph]
-------------------------------------------------
Optimizer-in-backward (torchtune's ``optimizer_in_bwd``, torch's ``_apply_optimizer_in_backward``)
steps one optimizer per parameter in a post-accumulate-grad hook.  Compiled autograd puts the hook
call in the CA graph and Dynamo inlines it when the graph is compiled; three things in torch then
stop a ``fullgraph=True`` compile, none of which means anything inside a backward:

* ``_use_grad_for_differentiable`` (around every ``torch.optim`` ``step``) calls
  ``torch._dynamo.graph_break()`` on entry and exit, so that AOTAutograd sees the step's ``no_grad``
  when a *forward* graph holds it.  A backward already runs without grad mode, and the step's own
  ``set_grad_enabled`` is traced.  Inside the CA graph the two calls are no-ops.
* ``Optimizer.zero_grad`` is ``torch._disable_dynamo``-d.  Inside the CA graph Dynamo inlines
  :func:`zero_grad_traceable` instead: the same loop for the ``set_to_none`` and in-place cases,
  without the profiler's ``record_function`` (which Dynamo ignores anyway).
* Dynamo runs ``_init_group`` in Python at trace time (to create the optimizer state once, not to
  trace it), and refuses while a parameter has a pending attribute mutation: compiled autograd's
  AccumulateGrad has just set ``param.grad`` in the graph, which Python cannot see yet.  Inside the
  CA graph, when the pending mutations are ``.grad`` assignments, ``_init_group`` runs with each such
  parameter's ``.grad`` standing in as ``param.detach()`` (same type, shape, dtype, device; nothing
  allocated) -- so the state is created as eager would create it -- and every stand-in that lands in
  the step's lists is replaced by the gradient the graph computed.  The stand-ins are removed before
  anything else runs; no guard is installed on them.

*Which backend.*  Compiled in, the steps are functional code to AOTAutograd: it applies each in-place
update of a parameter or optimizer state at the end of the graph, so every updated tensor stays
alive until then.  inductor writes them in place and frees each gradient after its step (an MLP of 16
AdamW-in-backward layers: 0.52x compile-only's step, 0.24x eager's peak memory); ``aot_eager`` keeps
them all (2.0x the step, 10x the memory: ``benchmarks/OPTIMIZER_IN_BACKWARD.md``), which defeats the
reason people step in the backward.  So only a CA graph compiled with inductor takes the steps in;
with any other backend ``CompiledCAGraph`` splits the graph at the hooks handed a parameter, which
run eagerly between pieces compiled with ``fullgraph=True`` (compile-only's memory and speed).

*Which graphs.*  A step Dynamo compiles over a wrapper-subclass parameter (TwoTensor, AdamW) came out
6e-3 off eager, ``_optimizer_step.py`` records wrong compiled steps over plain parameters with subclass
gradients, and torch 2.14 fails an NF4-QLoRA graph with the steps in ("Attempt to trace generator",
after part of it ran: a retry then double-steps).  So the steps are compiled in only into a graph that
holds no wrapper subclass (none among its inputs, no gradient it rebuilds); elsewhere every parameter
hook runs eagerly between compiled pieces, under every backend.  NF4-QLoRA compiled in was right on
torch 2.13; a probe of the 2.14 failure would give it back there.

*Which torch.*  The three replacements are feature-detected (:func:`optimizer_tracing_available`):
torch 2.11-2.13 have them; torch 2.15 dispatches ``_init_group`` through a ``tp_methods`` table
instead of ``call_method``.  And torch 2.14's AOT (per-inner symints in its flat layout, probed by
``workarounds.steps_compile_in``) applied an NF4-QLoRA graph's parameter mutations to tensors of the
wrong size, after part of the graph ran.  So the steps compile in on 2.11-2.13 only; elsewhere every
parameter hook runs eagerly between compiled pieces, under inductor too (correct, not compiled in).

All three act only while one of subclass_ca's CA graphs runs (the ``ca-graph-run`` scope, Note
[Workaround scopes]): a user's own ``torch.compile``-d step keeps torch's graph breaks.  Optimizers
outside ``torch.optim`` are traced as Dynamo traces them; where that needs a graph break,
``GraphBreakError`` names the hook (and ``fullgraph=False`` is then correct: Note [Hooks run after
every read of the tensor they are given]).  One torch limitation remains: AOTAutograd refuses an
in-place update of an input that another input aliases when a wrapper subclass is among the graph's
inputs (a TwoTensor parameter whose transposed view the forward saved).  The CA graph's first
compile then fails before anything ran; ``CompiledCAGraph`` splits the graph at the hooks handed a
parameter, which then run eagerly (plain Python, as eager autograd runs them) between pieces compiled
with ``fullgraph=True``, and the capture report says so.  Not a graph break with Dynamo resuming
inside the step: a step Dynamo compiles over TwoTensor parameters computed Adam 6e-3 off eager.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from ._lookup import lookup
from ._patch import CA_GRAPH_RUN, AttributeSwap, Swap, gated

__all__ = ["optimizer_tracing_swaps", "optimizer_tracing_available", "zero_grad_traceable"]

_FUNCTIONS = "torch._dynamo.variables.functions"
_OPTIMIZER_VARIABLE = "torch._dynamo.variables.optimizer:OptimizerVariable"
_CONSTANT_VARIABLE = "torch._dynamo.variables.constant:ConstantVariable"
_TENSOR_VARIABLE = "torch._dynamo.variables.tensor:TensorVariable"
_VARIABLE_TRACKER = "torch._dynamo.variables.base:VariableTracker"


def zero_grad_traceable(self: torch.optim.Optimizer, set_to_none: bool = True) -> None:
    """``Optimizer.zero_grad`` as Dynamo can inline it (Note [Optimizer steps compiled into the CA graph])."""
    for group in self.param_groups:
        for param in group["params"]:
            if param.grad is not None:
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.requires_grad_(False)
                    param.grad.zero_()


def _use_grad_code() -> Any:
    """The code object of ``_use_grad_for_differentiable``'s wrapper (one for every decorated step)."""
    return lookup("torch.optim.optimizer:_use_grad_for_differentiable")(lambda *args, **kwargs: None).__code__


def optimizer_tracing_available() -> bool:
    """Whether this torch has every piece the three replacements stand in for (feature-detected, never by version)."""
    try:
        functions = importlib.import_module(_FUNCTIONS)
        optimizer_variable = lookup(_OPTIMIZER_VARIABLE)
        for name in (_CONSTANT_VARIABLE, _TENSOR_VARIABLE, _VARIABLE_TRACKER):
            lookup(name)
        _use_grad_code()
        skip, method = functions.SkipFunctionVariable, functions.UserMethodVariable
    except (ImportError, AttributeError, TypeError):
        return False
    return (
        "call_function" in vars(skip) and "call_function" in vars(method) and "call_method" in vars(optimizer_variable)
        and "wrap_tensor" in vars(optimizer_variable) and "graph_break_if_pending_mutation" in vars(optimizer_variable)
        and callable(getattr(torch._dynamo, "graph_break", None))
    )


def _skip_call(original: Callable[..., Any]) -> Callable[..., Any]:
    code = _use_grad_code()
    constant = lookup(_CONSTANT_VARIABLE)

    def call_function(self: Any, tx: Any, args: Any, kwargs: Any) -> Any:
        if self.value is torch._dynamo.graph_break and getattr(tx, "f_code", None) is code:
            return constant.create(None)
        return original(self, tx, args, kwargs)

    return gated(CA_GRAPH_RUN, original, call_function)


def _method_call(original: Callable[..., Any]) -> Callable[..., Any]:
    optimizer_variable = lookup(_OPTIMIZER_VARIABLE)
    variable_tracker = lookup(_VARIABLE_TRACKER)
    zero_grad = torch.optim.Optimizer.zero_grad

    def call_function(self: Any, tx: Any, args: Any, kwargs: Any) -> Any:
        if getattr(self, "fn", None) is zero_grad and isinstance(getattr(self, "obj", None), optimizer_variable):
            traceable = variable_tracker.build(tx, zero_grad_traceable)
            return tx.inline_user_function_return(traceable, [self.obj, *args], kwargs)
        return original(self, tx, args, kwargs)

    return gated(CA_GRAPH_RUN, original, call_function)


def _pending_grads(tx: Any, optimizer: torch.optim.Optimizer) -> dict[torch.Tensor, Any] | None:
    """Each parameter's pending ``.grad`` variable; None where one is neither a tensor nor None (left to torch)."""
    constant, tensor = lookup(_CONSTANT_VARIABLE), lookup(_TENSOR_VARIABLE)
    side_effects = tx.output.side_effects
    pending: dict[torch.Tensor, Any] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            variable = side_effects.id_to_variable.get(id(param))
            if variable is None or not side_effects.has_pending_mutation(variable):
                continue
            if not side_effects.has_pending_mutation_of_attr(variable, "grad"):
                return None
            grad = side_effects.load_attr(variable, "grad", deleted_ok=True)
            if not (isinstance(grad, tensor) or (isinstance(grad, constant) and grad.value is None)):
                return None
            pending[param] = grad
    return pending


def _init_group_call(original: Callable[..., Any]) -> Callable[..., Any]:
    constant = lookup(_CONSTANT_VARIABLE)

    def call_method(self: Any, tx: Any, name: str, args: Any, kwargs: Any) -> Any:
        pending = _pending_grads(tx, self.value) if name == "_init_group" else None
        if not pending:
            return original(self, tx, name, args, kwargs)
        saved = {param: param.grad for param in pending}
        stand_ins: dict[int, tuple[torch.Tensor, Any]] = {}
        wrap_tensor = self.wrap_tensor

        def wrap(tx_: Any, value: torch.Tensor) -> Any:
            found = stand_ins.get(id(value))
            if found is not None and found[0] is value:
                return found[1]
            return wrap_tensor(tx_, value)

        try:
            for param, grad in pending.items():
                if isinstance(grad, constant):
                    param.grad = None
                else:
                    param.grad = stand_in = param.detach()
                    stand_ins[id(stand_in)] = (stand_in, grad)
            object.__setattr__(self, "wrap_tensor", wrap)
            object.__setattr__(self, "graph_break_if_pending_mutation", lambda tx_: None)
            return original(self, tx, name, args, kwargs)
        finally:
            for attribute in ("wrap_tensor", "graph_break_if_pending_mutation"):
                if attribute in vars(self):
                    object.__delattr__(self, attribute)
            for param, grad in saved.items():
                param.grad = grad

    return gated(CA_GRAPH_RUN, original, call_method)


def optimizer_tracing_swaps() -> list[Swap]:
    """The three replacements of Note [Optimizer steps compiled into the CA graph]."""

    def functions() -> ModuleType:  # located lazily, once
        return importlib.import_module(_FUNCTIONS)

    return [
        AttributeSwap(lambda: functions().SkipFunctionVariable, "call_function", _skip_call),
        AttributeSwap(lambda: functions().UserMethodVariable, "call_function", _method_call),
        AttributeSwap(lambda: lookup(_OPTIMIZER_VARIABLE), "call_method", _init_group_call),
    ]
