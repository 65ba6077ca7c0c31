"""One CA graph for a backward, whether its forward was compiled fresh or loaded from a cache.

Note [One CA graph for fresh and cached forwards]
-------------------------------------------------
A forward compiled in this process hands compiled autograd its AOT backward graph as AOTAutograd
traced it; a forward loaded from AOTAutogradCache hands it the graph torch serialized, which
does the same but names its nodes differently (``mul_tensor_1`` for ``mul_1``) and carries no
fake values.  Compiled autograd pastes those nodes into the CA graph under their own names
(``aot0_mul_1``), and Dynamo names the values of its graph after the CA graph's variables, so
the two CA graphs had two AOTAutogradCache keys: the first restart after ``save_cache()``
compiled every CA graph again.  Two rules make the graph a function of what the backward
*does*:

1. :func:`canonical_names` renames every pasted node after its operation and its position
   (``aot0_mul``, ``aot0_mul_1``, ... in graph order), keeping the names that both kinds of
   backward share (the CA graph's own nodes and the pasted graph's inputs);
2. nothing in the graph depends on the capture's fake values: the first accumulation of a
   rebuilt subclass gradient always steals like eager (Note [Subclass gradients and
   AccumulateGrad] in ``_accumulate.py``).  What the fake values still decide (the handler
   checks and the traced dummy's metadata) never reaches the graph's code, except a
   ``strict`` recipe's expected dtype and device, which are then left unchecked.

Renaming changes no behaviour: a graph is compiled from its nodes, and the names only reach the
generated code and the cache key.
"""

from __future__ import annotations

import copy
import operator
from typing import Any

import torch

from . import _compat

__all__ = ["canonical_names"]


def _operation(target: Any) -> str:
    """The name of what a node calls, the same for a traced and a deserialized graph."""
    packet = getattr(target, "overloadpacket", None)  # aten.mul.Tensor -> mul
    if packet is not None:
        return packet.__name__
    if isinstance(target, str):
        return target.replace(".", "_")
    return getattr(target, "__name__", "node")


def _canonical(node: torch.fx.Node) -> str | None:
    """The name ``node`` gets, or None where it keeps its own."""
    prefix = _compat.pasted_aot_prefix(node.name)
    if prefix is None or node.op not in ("call_function", "call_method", "call_module", "get_attr"):
        return None
    source = node.args[0] if node.args else None
    if node.target is operator.getitem and isinstance(source, torch.fx.Node) and _compat.pasted_aot_prefix(source.name) is None:
        return None  # an input of the pasted graph (a slot of the prologue's result): named alike in both
    return prefix + _operation(node.target)


def canonical_names(graph_module: torch.fx.GraphModule) -> bool:
    """Give the nodes pasted from AOT backward graphs their canonical names; returns whether any changed."""
    graph = graph_module.graph
    nodes = list(graph.nodes)
    names = [_canonical(node) for node in nodes]
    if all(name is None for name in names):
        return False
    renamed = _compat.empty_graph_like(graph, graph_module)
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    for node, name in zip(nodes, names):
        args = torch.fx.map_arg(node.args, copies.__getitem__)
        kwargs = torch.fx.map_arg(node.kwargs, copies.__getitem__)
        copied = renamed.create_node(node.op, node.target, args, kwargs, name or node.name, node.type)
        copied.meta = copy.copy(node.meta)
        copies[node] = copied
    if all(copies[node].name == node.name for node in nodes):
        return False  # already canonical
    graph_module.graph = renamed
    return True
