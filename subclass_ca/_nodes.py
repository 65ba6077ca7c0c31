"""The named graph callables our make_subclass nodes target: one per (subclass type, mode).

They are created once per process and reused by every capture (nothing grows per
recapture); a node carries ``recipe=<id>`` and its own inner tensors/symints only.
"""

from __future__ import annotations

import itertools
import operator
import re
import threading
from collections.abc import Sequence
from types import CodeType
from typing import Any, Protocol, cast

import torch

from . import _compat
from ._recipe import check_against, rebuild, recipe_by_id

__all__ = ["INPUTS_ARG", "HOOKS_ARG", "hook_arg", "hook_object", "graph_callable", "named_callables", "subclass_nodes", "subclass_type_of", "mode_of", "retarget_to_opaque",
           "raised_in_rebuild", "MODE_PREFIX"]

INPUTS_ARG = 0
"""Position of ``inputs`` among a CA graph's arguments (and placeholders): (inputs, sizes, scalars, hooks, packed_data)."""
HOOKS_ARG = 3
"""Position of ``hooks`` among a CA graph's arguments (and placeholders)."""


def hook_arg(args: Sequence[Any]) -> Any:
    """The hook objects of a CA graph call's arguments (empty when the call has none)."""
    return args[HOOKS_ARG] if len(args) > HOOKS_ARG else ()


def hook_object(node: torch.fx.Node, hooks: Any, hooks_placeholder: torch.fx.Node | None = None) -> Any:
    """The hook object a ``call_hook``/``call_backward`` node calls: ``hooks[i]`` of this run, or None.

    ``hooks_placeholder``: when given, ``i`` must index that placeholder (the graph's ``hooks``).
    """
    source = node.args[0] if node.args else None
    if (
        isinstance(source, torch.fx.Node)
        and source.op == "call_function"
        and source.target is operator.getitem
        and (hooks_placeholder is None or source.args[0] is hooks_placeholder)
        and isinstance(source.args[1], int)
        and source.args[1] < len(hooks)
    ):
        return hooks[source.args[1]]
    return None


class _GraphCallable(Protocol):
    """What :func:`graph_callable` returns: the rebuild, tagged with the (subclass type, mode) it serves."""

    __name__: str
    __code__: CodeType
    _subclass_ca_type: type
    _subclass_ca_mode: str

    def __call__(self, *args: Any, recipe: int) -> torch.Tensor: ...


_callables: dict[tuple[type, str], _GraphCallable] = {}
_callable_names: set[str] = set()
_callables_lock = threading.Lock()
MODE_PREFIX = {"proxy": "make", "inline": "inline", "opaque": "opaque"}


def _safe_name(cls: type) -> str:
    return re.sub(r"\W", "_", cls.__name__)


def graph_callable(cls: type, mode: str) -> _GraphCallable:
    """The one callable per (subclass type, mode) that graph nodes target."""
    with _callables_lock:
        found = _callables.get((cls, mode))
        if found is not None:
            return found
        base = f"{MODE_PREFIX[mode]}_{_safe_name(cls)}"
        name = base
        for suffix in itertools.count(2):
            if name not in _callable_names:
                break
            name = f"{base}_{suffix}"

        def rebuild_subclass(*args: Any, recipe: int) -> torch.Tensor:
            entry = recipe_by_id(recipe)
            result = rebuild(entry, args)
            if entry.expected is not None:
                check_against(entry, result, entry.expected)
            return result

        rebuild_subclass.__name__ = rebuild_subclass.__qualname__ = name
        rebuild_subclass.__module__ = "subclass_ca"
        rebuild_subclass.__doc__ = f"Rebuild a {cls.__qualname__} gradient from its inner tensors ({mode} mode)."
        if mode == "proxy":
            wrapped = _compat.allow_in_graph(rebuild_subclass)
        elif mode == "opaque":
            wrapped = _compat.dynamo_disable(rebuild_subclass)
            wrapped.__name__ = wrapped.__qualname__ = name
            wrapped.__module__ = "subclass_ca"
        else:
            wrapped = rebuild_subclass
        target = cast(_GraphCallable, wrapped)
        target._subclass_ca_type = cls
        target._subclass_ca_mode = mode
        _callables[(cls, mode)] = target
        _callable_names.add(name)
        return target


def named_callables() -> dict[str, Any]:
    """Every graph callable created so far, by its graph name (it must not grow per capture)."""
    with _callables_lock:
        return {f"subclass_ca_{fn.__name__}": fn for fn in _callables.values()}


def subclass_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The make_subclass nodes of ours in a captured CA graph."""
    return [n for n in graph.nodes if n.op == "call_function" and hasattr(n.target, "_subclass_ca_mode")]


def subclass_type_of(node: torch.fx.Node) -> type:
    """The subclass type a make_subclass node of ours (one of :func:`subclass_nodes`) rebuilds."""
    return cast(_GraphCallable, node.target)._subclass_ca_type


def mode_of(node: torch.fx.Node) -> str:
    """The mode of a make_subclass node of ours (one of :func:`subclass_nodes`)."""
    return cast(_GraphCallable, node.target)._subclass_ca_mode


def retarget_to_opaque(graph_module: torch.fx.GraphModule) -> list[type]:
    """Switch every make_subclass node of ours to its opaque callable; returns the subclass types."""
    switched = []
    for node in subclass_nodes(graph_module.graph):
        cls = subclass_type_of(node)
        if mode_of(node) != "opaque":
            node.target = graph_callable(cls, "opaque")
            switched.append(cls)
    graph_module.recompile()
    return switched


def raised_in_rebuild(error: BaseException) -> bool:
    """True when ``error`` (or what caused it) was raised inside one of our rebuild calls."""
    codes = {rebuild.__code__, *(getattr(fn, "__wrapped__", fn).__code__ for fn in _callables.values())}
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        tb = current.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code in codes:
                return True
            tb = tb.tb_next
        current = current.__cause__ or current.__context__
    return False
