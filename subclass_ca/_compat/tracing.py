"""Tracing a callable to the aten graph AOTAutograd would bake: fake inputs, wrapper subclasses desugared.

Note [Keys by behaviour] in ``subclass_ca/_warm_start/keys.py`` says why; this module only traces.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree

from ._lookup import lookup

if TYPE_CHECKING:
    from typing_extensions import TypeIs

    from .dynamo import TraceableWrapper

__all__ = ["LAZY_GRAPH_MODULES", "deferred_codegen", "generate_code", "split_defers_codegen", "DesugaredTrace", "trace_desugared", "SymbolicInputs", "is_fake"]


class SymbolicInputs(Exception):
    """An input has symbolic sizes: a static trace would describe another graph."""


@dataclass(frozen=True)
class DesugaredTrace:
    """What :func:`trace_desugared` saw: the aten graph and the subclass structure around its plain tensors."""

    graph_module: torch.fx.GraphModule
    inputs: list[Any]
    """Per input leaf: ``None`` (not a tensor: the value itself is not described) or its tensor structure."""
    outputs: list[Any]
    """Per output leaf, then per leaf input's ``.grad`` after the call: its tensor structure or the value."""
    classes: list[type]
    """Every wrapper subclass type met (inputs, outputs, gradients)."""


def is_fake(value: Any) -> bool:
    """Whether ``value`` is a fake tensor (values unknown: only metadata)."""
    return isinstance(value, lookup("torch._subclasses.fake_tensor:FakeTensor"))


def _is_subclass(value: object) -> TypeIs[TraceableWrapper]:
    return bool(lookup("torch.utils._python_dispatch:is_traceable_wrapper_subclass")(value))


def _has_symbols(t: torch.Tensor) -> bool:
    return any(isinstance(s, torch.SymInt) for s in (*t.shape, *t.stride())) or isinstance(t.storage_offset(), torch.SymInt)


def _flatten_tensor(t: torch.Tensor, plain: list[torch.Tensor], classes: list[type]) -> Any:
    """``t`` as a nested structure (type, ctx, size, stride, requires_grad, parts); plain tensors appended to ``plain``."""
    if _has_symbols(t):
        raise SymbolicInputs(f"a {type(t).__qualname__} with symbolic sizes {tuple(t.shape)}")
    if _is_subclass(t):
        classes.append(type(t))
        names, ctx = t.__tensor_flatten__()
        parts = [(name, _flatten_tensor(getattr(t, name), plain, classes)) for name in names
                 if isinstance(getattr(t, name), torch.Tensor)]
        return (type(t), ctx, tuple(t.shape), tuple(t.stride()), t.requires_grad, parts)
    plain.append(t)
    return (torch.Tensor, None, tuple(t.shape), tuple(t.stride()), t.requires_grad, len(plain) - 1)


def _rebuild(structure: Any, plain: Sequence[torch.Tensor]) -> torch.Tensor:
    cls, ctx, size, stride, requires_grad, parts = structure
    t: torch.Tensor
    if cls is torch.Tensor:
        t = plain[parts]
    else:
        t = cls.__tensor_unflatten__({name: _rebuild(p, plain) for name, p in parts}, ctx, size, stride)
    if requires_grad and not t.requires_grad:
        t.requires_grad_(True)
    return t


def _structure_only(structure: Any) -> Any:
    cls, ctx, size, stride, requires_grad, parts = structure
    if cls is torch.Tensor:
        return ("tensor", size, stride, requires_grad)
    # the type by name: what its code does is in the traced graph, its version in the key (Note [Keys by behaviour])
    return (f"{cls.__module__}.{cls.__qualname__}", ctx, size, stride, requires_grad, [(name, _structure_only(p)) for name, p in parts])


def trace_desugared(fn: Callable[..., Any], args: Sequence[Any]) -> DesugaredTrace:
    """``fn(*args)`` traced with ``make_fx`` on fake *copies* of ``args`` (the args are never touched).

    Wrapper subclasses enter the trace as their plain inner tensors and are rebuilt inside it
    (``__tensor_unflatten__``), so their ``__torch_dispatch__`` and everything it calls is
    traced into aten ops, as AOTAutograd does; outputs and the ``.grad`` of leaf inputs come
    out flattened the same way.  Raises :class:`SymbolicInputs` for inputs with symbolic sizes,
    anything else ``make_fx`` or the subclass raises.
    """
    fake_tensor = lookup("torch._subclasses.fake_tensor")
    make_fx = lookup("torch.fx.experimental.proxy_tensor:make_fx")
    leaves, spec = pytree.tree_flatten(list(args))
    symbolic = next((v for v in leaves if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool))), None)
    if symbolic is not None:
        raise SymbolicInputs(f"a symbolic input ({symbolic})")
    classes: list[type] = []
    plain: list[torch.Tensor] = []
    structures = [_flatten_tensor(v, plain, classes) if isinstance(v, torch.Tensor) else None for v in leaves]
    leaf_inputs = [i for i, (v, s) in enumerate(zip(leaves, structures)) if s is not None and v.is_leaf and v.requires_grad]
    mode = fake_tensor.FakeTensorMode(static_shapes=True, allow_non_fake_inputs=True)  # constants of the graph stay real
    fakes = [mode.from_tensor(t.detach(), static_shapes=True) for t in plain]
    out_structures: list[Any] = []

    def desugared(*flat: torch.Tensor) -> list[torch.Tensor]:
        rebuilt = [v if s is None else _rebuild(s, flat) for v, s in zip(leaves, structures)]
        result = fn(*pytree.tree_unflatten(rebuilt, spec))
        outs = [*pytree.tree_leaves(result), *(rebuilt[i].grad for i in leaf_inputs)]
        flat_out: list[torch.Tensor] = []
        out_structures.clear()
        for value in outs:
            if isinstance(value, torch.Tensor):
                out_structures.append(_structure_only(_flatten_tensor(value, flat_out, classes)))
            else:
                out_structures.append(value)
        return flat_out

    with mode:
        graph_module = make_fx(desugared, tracing_mode="real")(*fakes)
    return DesugaredTrace(graph_module, [None if s is None else _structure_only(s) for s in structures],
                          list(out_structures), classes)


LAZY_GRAPH_MODULES = "torch.fx._lazy_graph_module:_use_lazy_graph_module"


@contextlib.contextmanager
def deferred_codegen() -> Iterator[None]:
    """GraphModules made inside generate their Python code when :func:`generate_code` asks, not when made.

    ``split_module`` generates each piece's code when it makes the piece and again when it makes the
    top level (which regenerates its children's): for the 64 pieces of a regional graph that is
    0.2-0.3 s of a cold backward spent twice.  Without torch's lazy GraphModules, code is generated
    when made, as before.
    """
    try:
        use_lazy = lookup(LAZY_GRAPH_MODULES)
    except (ImportError, AttributeError):
        yield
        return
    with use_lazy(True):
        yield


def generate_code(graph_module: torch.fx.GraphModule) -> None:
    """Generate the code of a GraphModule made under :func:`deferred_codegen` now, once; a no-op for any other."""
    generate = getattr(graph_module, "real_recompile", None)
    if generate is not None:
        generate()


@functools.cache
def split_defers_codegen() -> bool:
    """Whether ``split_module`` under :func:`deferred_codegen` leaves its modules' code to :func:`generate_code`.

    torch 2.12 and later make them with torch's lazy GraphModules; 2.11 makes plain ones, which generate
    their code when made (and the top level its children's again).
    """
    from torch.fx.passes.split_module import split_module

    graph = torch.fx.Graph()
    graph.output(graph.call_function(torch.neg, (graph.placeholder("x"),)))
    module = torch.fx.GraphModule(torch.nn.Module(), graph)
    with deferred_codegen():
        top = split_module(module, module, lambda node: 0)
    return all(hasattr(part, "real_recompile") for part in (top, *top.children()))
