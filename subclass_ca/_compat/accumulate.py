"""torch's AccumulateGrad under compiled autograd: its two shapes, the capture's placeholder ``.grad``, dtype casts."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, cast

import torch

from ._lookup import lookup
from ._patch import BLOCKS, AttributeSwap, gated
from .compiled_autograd import COMPILER_INSTANCE, _untraced

__all__ = [
    "accumulate_dummy_swap",
    "call_accumulate_grad",
    "grad_dtype_of",
    "capture_accumulate_swap",
    "accumulate_grad_is_functional",
    "accumulate_node_parts",
    "NO_GRAD_ARG",
]


def call_accumulate_grad() -> Callable[..., Any]:
    """The function compiled autograd's AccumulateGrad nodes call (``external_utils.call_accumulate_grad``)."""
    return cast(Callable[..., Any], lookup("torch._dynamo.external_utils:call_accumulate_grad"))


def grad_dtype_of(tensor: torch.Tensor) -> torch.dtype | None:
    """The dtype eager AccumulateGrad gives ``tensor``'s gradient (None: any dtype, or a torch without the rule).

    ``Tensor.grad_dtype`` (torch 2.13 has it; from 2.15 FSDP2 sets it to float32 on its unsharded
    bf16 parameters under a ``MixedPrecisionPolicy``); feature-detected, not version-gated.
    """
    return getattr(tensor, "grad_dtype", None)


# Note [Two shapes of AccumulateGrad under compiled autograd]
# -----------------------------------------------------------
# A captured AccumulateGrad becomes a ``call_accumulate_grad`` node.  torch has had two shapes of
# it, told apart by ``call_accumulate_grad``'s parameters (:func:`accumulate_grad_is_functional`):
#
# * functional (torch 2.13 on, pytorch#184082): ``call_accumulate_grad(variable, variable_grad,
#   grad, has_post_hooks)`` returns the new ``.grad``; the capture passes the current ``.grad`` as a
#   graph value and gives the variable a placeholder ``.grad`` (``allocate_dummy_like``);
# * assigning (up to torch 2.12): ``call_accumulate_grad(variable, grad, has_post_hooks)`` assigns
#   ``variable.grad`` itself, reading the current one when the graph runs; the capture gives no
#   placeholder.
#
# :func:`accumulate_node_parts` reads either node the same way.


@functools.cache
def accumulate_grad_is_functional() -> bool:
    """True where ``call_accumulate_grad`` takes the current ``.grad`` and returns the new one.

    Note [Two shapes of AccumulateGrad under compiled autograd].
    """
    return "variable_grad" in inspect.signature(call_accumulate_grad()).parameters


_NO_GRAD_ARG = object()
"""The ``variable_grad`` of an assigning-style node: not a graph value (read when the graph runs)."""


def accumulate_node_parts(args: tuple[Any, ...]) -> tuple[Any, Any, Any] | None:
    """``(variable, variable_grad, grad)`` of a ``call_accumulate_grad`` node's arguments.

    ``variable_grad`` is :data:`NO_GRAD_ARG` for the assigning shape, whose node does not carry it.
    None for arguments of neither shape.
    """
    if accumulate_grad_is_functional():
        return (args[0], args[1], args[2]) if len(args) >= 3 else None
    return (args[0], _NO_GRAD_ARG, args[1]) if len(args) >= 2 else None


NO_GRAD_ARG = _NO_GRAD_ARG


def capture_accumulate_swap(cast_to: Callable[[torch.Tensor, Any], torch.dtype | None]) -> AttributeSwap:
    """``AutogradCompilerInstance.accumulate_grad`` (a capture's AccumulateGrad) casting the gradient first.

    ``cast_to(variable, grad)`` names the dtype ``variable.grad`` must have (None: torch's own
    path); a gradient of another dtype is cast to it before it is accumulated.  The cast becomes
    an ``aten._to_copy`` node in the CA graph ahead of torch's own ``call_accumulate_grad`` node,
    and, where the capture allocates a placeholder ``.grad`` (the functional shape), it gets that
    dtype (torch allocates it like the *variable*, which a ``grad_dtype`` setter refuses).
    See Note [Gradient dtype at accumulation] in ``_accumulate.py`` and Note [Two shapes of
    AccumulateGrad under compiled autograd].
    """

    def disable() -> AbstractContextManager[object, None]:
        modes_off: AbstractContextManager[object, None] = lookup("torch.fx.experimental.proxy_tensor:disable_proxy_modes_tracing")()
        return modes_off

    def cast(compiler: Any, grad: Any, dtype: torch.dtype) -> Any:
        if not isinstance(grad, torch.Tensor) or grad.dtype == dtype:
            return grad
        with disable():
            cast = grad.to(dtype)
        proxy = compiler.fx_tracer.create_proxy(
            "call_function", torch.ops.aten._to_copy.default, (compiler.to_proxy(grad),), {"dtype": dtype}
        )
        compiler.bind_objects_to_proxies([cast], [proxy])
        return cast

    def make_functional(original: Any) -> Any:
        @functools.wraps(original)
        def accumulate_grad(compiler: Any, variable: Any, variable_grad: Any, grad: Any, has_post_hooks: Any = None) -> Any:
            dtype = cast_to(variable, grad) if has_post_hooks is not None else None
            if dtype is None:
                return original(compiler, variable, variable_grad, grad, has_post_hooks)
            grad = cast(compiler, grad, dtype)
            allocate = compiler.allocate_dummy_like

            def allocate_dummy_like(x: torch.Tensor) -> torch.Tensor:
                dummy: torch.Tensor = allocate(x)
                if x is not variable:
                    return dummy
                with disable():
                    return dummy.to(dtype)

            compiler.allocate_dummy_like = allocate_dummy_like  # this call only: the instance attribute is removed below
            try:
                return original(compiler, variable, variable_grad, grad, has_post_hooks)
            finally:
                del compiler.allocate_dummy_like

        return _untraced(gated(BLOCKS, original, accumulate_grad))

    def make_assigning(original: Any) -> Any:
        @functools.wraps(original)
        def accumulate_grad(compiler: Any, variable: Any, grad: Any, has_post_hooks: Any) -> Any:
            dtype = cast_to(variable, grad)
            if dtype is not None:
                grad = cast(compiler, grad, dtype)
            return original(compiler, variable, grad, has_post_hooks)

        return _untraced(gated(BLOCKS, original, accumulate_grad))

    def make(original: Any) -> Any:
        return (make_functional if accumulate_grad_is_functional() else make_assigning)(original)

    return AttributeSwap(lambda: lookup(COMPILER_INSTANCE), "accumulate_grad", make)


def accumulate_dummy_swap(fallback: Callable[[torch.Tensor], torch.Tensor | None]) -> AttributeSwap:
    """``AutogradCompilerInstance.allocate_dummy_like`` with ``fallback(x)`` where torch's raises.

    Torch calls it from ``accumulate_grad`` only, on the parameter, for the placeholder value of
    its new ``.grad`` (``torch.empty_like(param)``, proxy modes off).  ``fallback`` returns another
    placeholder, or None to let torch's error stand.
    """

    def make(original: Any) -> Any:
        @functools.wraps(original)
        def allocate_dummy_like(compiler: Any, x: torch.Tensor) -> torch.Tensor:
            try:
                return cast(torch.Tensor, original(compiler, x))
            except Exception:
                with lookup("torch.fx.experimental.proxy_tensor:disable_proxy_modes_tracing")():
                    dummy = fallback(x)
                if dummy is None:
                    raise
                return dummy

        return _untraced(gated(BLOCKS, original, allocate_dummy_like))

    return AttributeSwap(lambda: lookup(COMPILER_INSTANCE), "allocate_dummy_like", make)
