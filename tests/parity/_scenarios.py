"""The parity scenarios: small plain-tensor training snippets, one function each.

Every scenario takes an :class:`~tests.parity._harness.Env` and returns what it observed.
Forwards go through ``env.compile`` (AOT-compiled backward nodes in the autograd graph);
every backward runs inside ``env.ca()``.  Hooks are module-level functions (lambdas would
only add Dynamo recompiles).  The table :data:`SCENARIOS` at the bottom is the single
place the parity test is parametrized from.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import subclass_ca
from subclass_ca.testing.subclasses import PairTensor, make_pair

from ._harness import Case, Env

# --- hooks ---------------------------------------------------------------------------


def _double(grad: torch.Tensor) -> torch.Tensor:
    return grad * 2


def _add_one(grad: torch.Tensor) -> torch.Tensor:
    return grad + 1


def _prehook_scale(grad_outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return (grad_outputs[0] * 3,)


def _posthook_sin(grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(None if g is None else torch.sin(g) + 1 for g in grad_inputs)


def _sgd_in_hook(param: torch.Tensor) -> None:
    with torch.no_grad():
        param.add_(param.grad, alpha=-0.1)


class HookRefused(RuntimeError):
    """Raised by :func:`_raising_hook`."""


def _raising_hook(grad: torch.Tensor) -> torch.Tensor:
    raise HookRefused("hook refused this gradient")


# --- shared pieces ---------------------------------------------------------------------


def _inputs(*shapes: tuple[int, ...]) -> list[torch.Tensor]:
    return [torch.randn(*shape, requires_grad=True) for shape in shapes]


def _matmul_tanh(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x @ w).tanh().sum()


def _backward(env: Env, loss: torch.Tensor, **kwargs: Any) -> None:
    with env.ca():
        loss.backward(**kwargs)


def _grads(**tensors: torch.Tensor) -> dict[str, Any]:
    return {f"{name}.grad": t.grad for name, t in tensors.items()}


# --- tensor hooks ------------------------------------------------------------------------


def leaf_tensor_hooks(env: Env) -> dict[str, Any]:
    x, w = _inputs((4, 3), (3, 2))
    x.register_hook(_double)
    w.register_hook(_add_one)
    _backward(env, env.compile(_matmul_tanh)(x, w))
    return _grads(x=x, w=w)


def _hooked_forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = x @ w
    y.register_hook(_double)
    return y.relu().sum()


def intermediate_hook_in_compiled_forward(env: Env, *, forward_in_ca: bool) -> dict[str, Any]:
    """A hook on an intermediate created inside the compiled region (Dynamo defers it under CA)."""
    x, w = _inputs((4, 3), (3, 3))
    forward = env.compile(_hooked_forward)
    if forward_in_ca:
        with env.ca():
            forward(x, w).backward()
    else:
        _backward(env, forward(x, w))
    return _grads(x=x, w=w)


def intermediate_hook_between_regions(env: Env) -> dict[str, Any]:
    """A hook on the output of one compiled region that feeds a second one."""
    x, w = _inputs((4, 3), (3, 3))
    y = env.compile(lambda x, w: (x @ w).sin())(x, w)
    y.register_hook(_add_one)
    _backward(env, env.compile(lambda y: (y * y).sum())(y))
    return _grads(x=x, w=w)


# --- grad_fn hooks ------------------------------------------------------------------------


def grad_fn_prehooks(env: Env) -> dict[str, Any]:
    """``register_prehook`` on the compiled region's backward node and on an eager node after it."""
    x, w = _inputs((4, 3), (3, 2))
    y = env.compile(lambda x, w: (x @ w).sin())(x, w)
    y.grad_fn.register_prehook(_prehook_scale)
    z = y * y
    z.grad_fn.register_prehook(_prehook_scale)
    _backward(env, z.sum())
    return _grads(x=x, w=w)


def _mul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * w


def grad_fn_posthooks(env: Env, *, one_op_region: bool) -> dict[str, Any]:
    """``grad_fn.register_hook`` (grad_inputs, grad_outputs) on the compiled region's node and an eager node.

    With ``one_op_region`` the compiled region is a single ``mul``, so its backward node has the
    same grad_inputs as eager's ``MulBackward0``; otherwise the region (``mm`` + ``sin``) is one
    node whose grad_inputs are the region's inputs, where eager hooks ``SinBackward0``.
    """
    x, w = _inputs((4, 3), (4, 3) if one_op_region else (3, 3))
    y = env.compile(_mul if one_op_region else (lambda x, w: (x @ w).sin()))(x, w)
    y.grad_fn.register_hook(_posthook_sin)
    z = y.exp()
    z.grad_fn.register_hook(_posthook_sin)
    _backward(env, z.sum())
    return _grads(x=x, w=w)


# --- accumulation ------------------------------------------------------------------------


def post_accumulate_grad_hooks(env: Env) -> dict[str, Any]:
    """An in-place SGD step in a post-accumulate-grad hook on every parameter, two steps."""
    model = torch.nn.Linear(3, 2)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(_sgd_in_hook)
    forward = env.compile(model)
    grads = []
    for _ in range(2):
        _backward(env, forward(torch.randn(4, 3)).pow(2).sum())
        grads.append([p.grad.clone() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
    return {"params": [p.detach().clone() for p in model.parameters()], "grads": grads}


def retain_graph_two_backwards(env: Env) -> dict[str, Any]:
    x, w = _inputs((4, 3), (3, 2))
    loss = env.compile(_matmul_tanh)(x, w)
    with env.ca():
        loss.backward(retain_graph=True)
        first = [x.grad.clone(), w.grad.clone()]
        loss.backward()
    return {"first": first, **_grads(x=x, w=w)}


def accumulate_into_existing_grad(env: Env) -> dict[str, Any]:
    """``.grad`` already set before the first backward, then a second backward on top."""
    x, w = _inputs((4, 3), (3, 2))
    w.grad = torch.full_like(w, 0.5)
    forward = env.compile(_matmul_tanh)
    _backward(env, forward(x, w))
    first = w.grad.clone()
    _backward(env, forward(x, w))
    return {"first": first, **_grads(x=x, w=w)}


def _shared_gradient_forward(x: torch.Tensor, base: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    return (x @ (base + delta)).tanh().sum()


def shared_gradient_inplace_clip(env: Env) -> dict[str, Any]:
    """Two TwoTensor parameters receive one gradient (``W0 + dW``), then an in-place ``clip_grad_norm_`` (issue 45.1)."""
    from subclass_ca import _compat

    two_tensor = _compat.two_tensor_type()
    torch.manual_seed(0)
    base = torch.nn.Parameter(two_tensor(torch.randn(6, 6), torch.randn(6, 6) * 2))
    delta = torch.nn.Parameter(two_tensor(torch.randn(6, 6) * 0.1, torch.randn(6, 6) * 0.2))
    forward = env.compile(_shared_gradient_forward)
    for step in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        _backward(env, forward(x, base, delta))
        torch.nn.utils.clip_grad_norm_([base, delta], max_norm=0.05, foreach=True)
        with torch.no_grad():
            for p in (base, delta):
                p.sub_(p.grad * 0.5)
                p.grad = None
    return {"params": [t.detach().clone() for p in (base, delta) for t in (p.a, p.b)]}


def accumulate_into_existing_subclass_grad(env: Env) -> dict[str, Any]:
    """TwoTensor parameters whose ``.grad`` is already a TwoTensor, then two backwards without zeroing (issue 45.3)."""
    from subclass_ca import _compat

    two_tensor = _compat.two_tensor_type()
    torch.manual_seed(0)
    w = torch.nn.Parameter(two_tensor(torch.randn(3, 2), torch.randn(3, 2) * 2))
    w.grad = two_tensor(torch.full((3, 2), 0.5), torch.full((3, 2), -0.25))
    x = torch.randn(4, 3)
    forward = env.compile(_matmul_tanh)
    _backward(env, forward(x, w).sum())
    first = [w.grad.a.clone(), w.grad.b.clone()]
    _backward(env, forward(x, w).sum())
    return {"first": first, "grad": [w.grad.a.clone(), w.grad.b.clone()], "grad_type": type(w.grad).__name__}


def autograd_grad(env: Env) -> dict[str, Any]:
    """``torch.autograd.grad`` (no accumulation into ``.grad``)."""
    x, w = _inputs((4, 3), (3, 2))
    loss = env.compile(_matmul_tanh)(x, w)
    with env.ca():
        gx, gw = torch.autograd.grad(loss, [x, w])
    return {"gx": gx, "gw": gw, **_grads(x=x, w=w)}


# --- custom autograd -------------------------------------------------------------------------


class _ScaleWithArgmax(torch.autograd.Function):
    """``y = x * w`` plus the (non-differentiable) argmax of each row; saves both inputs."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x * w
        index = y.argmax(dim=-1, keepdim=True)
        ctx.save_for_backward(x, w)
        ctx.mark_non_differentiable(index)
        return y, index

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor, grad_index: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return grad_y * w, (grad_y * x).sum(0)


def _function_forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y, index = _ScaleWithArgmax.apply(x, w)
    return y.gather(-1, index).sum() + y.tanh().sum()


def autograd_function(env: Env, *, compiled: bool) -> dict[str, Any]:
    x, w = _inputs((4, 3), (3,))
    forward = env.compile(_function_forward) if compiled else _function_forward
    _backward(env, forward(x, w))
    return _grads(x=x, w=w)


@torch.library.custom_op("subclass_ca_parity::scaled_sin", mutates_args=())
def scaled_sin(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.sin(x) * scale


@scaled_sin.register_fake
def _scaled_sin_fake(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(x)


def _scaled_sin_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    x, scale = inputs
    ctx.save_for_backward(x)
    ctx.scale = scale


def _scaled_sin_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    (x,) = ctx.saved_tensors
    return grad * torch.cos(x) * ctx.scale, None


scaled_sin.register_autograd(_scaled_sin_backward, setup_context=_scaled_sin_setup)


def _custom_op_forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return scaled_sin(x @ w, 1.5).pow(2).sum()


def custom_op(env: Env, *, compiled: bool) -> dict[str, Any]:
    x, w = _inputs((4, 3), (3, 2))
    forward = env.compile(_custom_op_forward) if compiled else _custom_op_forward
    _backward(env, forward(x, w))
    return _grads(x=x, w=w)


# --- checkpointing, shapes, grad mode -------------------------------------------------------


def activation_checkpoint(env: Env, *, use_reentrant: bool) -> dict[str, Any]:
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    x = torch.randn(4, 3, requires_grad=True)  # reentrant checkpointing needs an input that requires grad

    def forward(x: torch.Tensor) -> torch.Tensor:
        return checkpoint(model, x, use_reentrant=use_reentrant).pow(2).sum()

    _backward(env, env.compile(forward)(x))
    return {"x.grad": x.grad, "grads": [p.grad for p in model.parameters()]}


def dynamic_batch(env: Env) -> dict[str, Any]:
    """Three batch sizes through one compiled model, one backward each."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    forward = env.compile(model)
    out: dict[str, Any] = {}
    for batch in (2, 5, 9):
        _backward(env, forward(torch.randn(batch, 3)).pow(2).mean())
        out[f"batch{batch}"] = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
    return out


def _partly_no_grad(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        scale = (x @ w).abs().mean()
    return ((x @ w).sin() * scale).sum()


def no_grad_inside(env: Env) -> dict[str, Any]:
    """``torch.no_grad`` inside the compiled forward and inside the compiled-autograd block."""
    x, w = _inputs((4, 3), (3, 2))
    forward = env.compile(_partly_no_grad)
    with env.ca():
        with torch.no_grad():
            untracked = forward(x, w)
        loss = forward(x, w)
        with torch.no_grad():
            w_norm = w.norm()
        (loss * w_norm).backward()
    return {"untracked": untracked, "untracked.requires_grad": untracked.requires_grad, **_grads(x=x, w=w)}


# --- failures and recovery ----------------------------------------------------------------


def hook_raises_then_backward(env: Env) -> dict[str, Any]:
    """A tensor hook raises during one backward; after removing it the next backward works."""
    x, w = _inputs((4, 3), (3, 2))
    forward = env.compile(_matmul_tanh)
    handle = w.register_hook(_raising_hook)
    first = env.attempt(lambda: _backward(env, forward(x, w)))
    handle.remove()
    x.grad = w.grad = None
    _backward(env, forward(x, w))
    return {"first": first, **_grads(x=x, w=w)}


def _double_backward(x: torch.Tensor, w: torch.Tensor, forward: Any) -> None:
    (gw,) = torch.autograd.grad(forward(x, w), w, create_graph=True)
    gw.pow(2).sum().backward()


def double_backward(env: Env) -> dict[str, Any]:
    """Double backward through a compiled region: torch refuses (``higher order gradients``)."""
    x, w = _inputs((4, 3), (3, 2))
    forward = env.compile(_matmul_tanh)
    with env.ca():
        _double_backward(x, w, forward)
    return _grads(x=x, w=w)


def refused_double_backward_retry(env: Env) -> dict[str, Any]:
    """Issue 21.1 (1): torch refuses two double backwards in a row, then a plain backward works.

    All in one compiled-autograd block, like a training loop: the retry must get torch's
    refusal again (not an internal assert about a cache node left behind by the refused capture).
    """
    x, w = _inputs((4, 3), (3, 2))
    forward = env.compile(_matmul_tanh)
    with env.ca():
        attempts = [env.attempt(lambda: _double_backward(x, w, forward)) for _ in range(2)]
        x.grad = w.grad = None
        forward(x, w).backward()
    return {"attempts": attempts, **_grads(x=x, w=w)}


def _broken_rebuild(inner: dict[str, Any], ctx: Any, outer_size: Any, outer_stride: Any) -> torch.Tensor:
    raise ValueError("handler bug")


def rebuild_error_then_unregistered(env: Env) -> dict[str, Any]:
    """Issue 21.1 (2): a registered handler's rebuild raises; once unregistered the next backward recaptures.

    Stock compiled autograd never consults the registry: its first backward works.  Under
    subclass_ca the first backward raises RebuildError; after ``unregister_handler`` the next
    backward, in the same block and without ``reset()``, must recapture and equal eager.
    """
    w = torch.nn.Parameter(make_pair(torch.randn(4, 4)))
    x = torch.randn(3, 4)
    forward = env.compile(_pair_forward)
    subclass_ca.register_handler(PairTensor, rebuild=_broken_rebuild)
    try:
        with env.ca():
            first = env.attempt(lambda: forward(x, w).backward())
            subclass_ca.unregister_handler(PairTensor)
            w.grad = None
            forward(x, w).backward()
    finally:
        if PairTensor in subclass_ca.handlers():
            subclass_ca.unregister_handler(PairTensor)
    return {"first": first, "w.grad.type": type(w.grad).__name__, "w.grad": [w.grad.a, w.grad.b]}


def _pair_forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x @ w).sin().sum()


def optimizer_in_backward(env: Env) -> dict[str, Any]:
    """PyTorch's optimizer-in-backward pattern: one SGD per parameter, stepped in its post-accumulate hook."""
    model = torch.nn.Linear(4, 3)
    optimizers = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}

    def step_in_backward(param: torch.Tensor) -> None:
        optimizers[param].step()
        optimizers[param].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step_in_backward)
    forward = env.compile(model)
    for _ in range(2):
        _backward(env, forward(torch.randn(2, 4)).sin().sum())
    return {"params": [p.detach().clone() for p in model.parameters()]}


# --- training --------------------------------------------------------------------------------


def mlp_optimizer(env: Env) -> dict[str, Any]:
    """A plain MLP, compiled forward, SGD with momentum, three steps."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    forward = env.compile(model)
    losses = []
    for _ in range(3):
        x, target = torch.randn(6, 4), torch.randn(6, 2)
        loss = F.mse_loss(forward(x), target)
        optimizer.zero_grad(set_to_none=True)
        _backward(env, loss)
        optimizer.step()
        losses.append(loss.detach())
    return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()]}


# --- the table --------------------------------------------------------------------------------


#: every parity case; ``test_parity.py`` is parametrized from this list only
SCENARIOS: list[Case] = [
    Case("leaf_tensor_hooks", leaf_tensor_hooks),
    Case("intermediate_hook_forward_outside_ca",
         functools.partial(intermediate_hook_in_compiled_forward, forward_in_ca=False)),
    Case("intermediate_hook_forward_inside_ca",
         functools.partial(intermediate_hook_in_compiled_forward, forward_in_ca=True)),
    Case("intermediate_hook_between_regions", intermediate_hook_between_regions),
    Case("grad_fn_prehooks", grad_fn_prehooks),
    Case("grad_fn_posthooks", functools.partial(grad_fn_posthooks, one_op_region=True)),
    # the compiled region is one autograd node: a post hook on it sees the region's input grads
    Case("grad_fn_posthook_on_region", functools.partial(grad_fn_posthooks, one_op_region=False),
         stock_differs_from_eager=("x.grad", "w.grad")),
    # ours runs parameter hooks eagerly between compiled pieces under aot_eager (issue 59): == eager bitwise
    Case("post_accumulate_grad_hooks", post_accumulate_grad_hooks, ours_hooks_run_eagerly=True),
    Case("shared_gradient_inplace_clip", shared_gradient_inplace_clip),
    Case("retain_graph_two_backwards", retain_graph_two_backwards),
    Case("accumulate_into_existing_grad", accumulate_into_existing_grad),
    Case("accumulate_into_existing_subclass_grad", accumulate_into_existing_subclass_grad),
    Case("autograd_grad", autograd_grad),
    Case("autograd_function_eager_forward", functools.partial(autograd_function, compiled=False)),
    Case("autograd_function_compiled_forward", functools.partial(autograd_function, compiled=True)),
    Case("custom_op_eager_forward", functools.partial(custom_op, compiled=False)),
    Case("custom_op_compiled_forward", functools.partial(custom_op, compiled=True)),
    Case("checkpoint_reentrant", functools.partial(activation_checkpoint, use_reentrant=True)),
    Case("checkpoint_non_reentrant", functools.partial(activation_checkpoint, use_reentrant=False)),
    Case("dynamic_batch", dynamic_batch, sizes_change=True),
    Case("no_grad_inside", no_grad_inside),
    # eager raises the hook's own exception; under compiled autograd Dynamo traces the hook
    # (fullgraph) and reports "Unsupported: Observed exception" instead, subclass_ca a
    # GraphBreakError from it (Note [Documented differences from stock] in _harness.py)
    Case("hook_raises_then_backward", hook_raises_then_backward, stock_differs_from_eager=("first",),
         ours_graph_break_error=True),
    Case("hook_raises_then_backward_fullgraph_false", hook_raises_then_backward, fullgraph=False),
    # stock's Dynamo cannot trace an optimizer step in the CA graph (Unsupported); ours compiles it in (issue 59)
    Case("optimizer_in_backward", optimizer_in_backward, ours_trains_where_stock_breaks=True),
    # torch 2.11's stock CA segfaults collecting this run's garbage (2 runs in 3): a fresh process, see conftest.py
    Case("optimizer_in_backward_fullgraph_false", optimizer_in_backward, fullgraph=False, ours_hooks_run_eagerly=True,
         marks=(pytest.mark.isolated(reason="torch 2.11 stock compiled autograd segfaults in gc after it"),)),
    Case("double_backward", double_backward),  # stock raises: the same error, no eager comparison
    # eager supports double backward; a compiled region refuses it (torch's limitation)
    Case("refused_double_backward_retry", refused_double_backward_retry, stock_differs_from_eager=("attempts",)),
    Case("refused_double_backward_retry_report", refused_double_backward_retry,
         stock_differs_from_eager=("attempts",), enable_kwargs={"report": True}),
    Case("mlp_optimizer", mlp_optimizer),
    Case("leaf_tensor_hooks_inductor", leaf_tensor_hooks, backend="inductor", eager_exact=False,
         marks=(pytest.mark.inductor,)),
]
