"""One CA graph for a backward, whether its forward was compiled fresh or loaded from a cache.

Note [One CA graph for fresh and cached forwards]
-------------------------------------------------
A forward compiled in this process hands compiled autograd its AOT backward graph as AOTAutograd
traced it.  A forward loaded from AOTAutogradCache hands it the graph torch *stored*
(``GraphModule.__reduce__``, rebuilt on load by running its code under FX's symbolic tracer),
which computes the same but is written differently:

* its nodes are named after their overloads (``mul_tensor_1`` where the traced graph says
  ``mul_1``), and Dynamo names the values of its graph after the CA graph's variables;
* every call without tensor inputs (relu's backward ``full([], 0.0)``) ran at trace time and is a
  tensor constant, read by one ``get_attr`` per use (``_tensor_constant0``);
* it has no fake values.

Compiled autograd pastes either into the CA graph, so the two CA graphs had two AOTAutogradCache
keys and the first restart after ``save_cache()`` compiled every CA graph again.  Before the
CA graph is compiled, :func:`canonical_form` rewrites the nodes pasted from AOT backwards
(``aot<id>_...``) into one form that both give:

1. a call without tensor inputs is run once and becomes a constant, as the cache's rebuild does,
   except a random draw, or a value later written in place or returned as it is (it could become
   a ``.grad`` that accumulates in place): freezing those would change what the graph computes,
   so they stay calls (a cached forward then gives another graph: a miss, never a stale hit);
2. each constant is one attribute ``aot<id>_constant<k>`` (k in order of first use), read by one
   ``get_attr`` placed just before its first use;
3. every other pasted node is named after its operation and position (``aot0_mul``,
   ``aot0_mul_1``, ... in graph order); the pasted graph's inputs (slots of the prologue's result)
   keep the names both forms share;
4. the ``aot<id>_`` prefixes, numbered by a per-process count of AOT functions (a process that
   compiled other forwards first, or loaded some from the cache, counts differently), are
   renumbered ``aot0_``, ``aot1_``, ... in the order they first appear in the graph.

And nothing in the graph is decided from fake values: the first accumulation of a rebuilt
subclass gradient always steals like eager (Note [Subclass gradients and AccumulateGrad] in
``_accumulate.py``).  The rewrite runs no tracer (FX's symbolic tracer sets a process-wide flag
that makes every other thread's ``torch.compile``-d call fail while it runs).
"""

from __future__ import annotations

import copy
import operator
from typing import Any, cast

import torch

from . import _compat

__all__ = ["canonical_form"]


def _operation(target: Any) -> str:
    """The name of what a node calls, the same for a traced and a rebuilt graph."""
    packet = getattr(target, "overloadpacket", None)  # aten.mul.Tensor -> mul
    if packet is not None:
        return cast(str, packet.__name__)
    if isinstance(target, str):
        return target.replace(".", "_")
    return getattr(target, "__name__", "node")


def _reads_a_node(node: torch.fx.Node) -> bool:
    found: list[torch.fx.Node] = []
    torch.fx.map_arg((node.args, node.kwargs), found.append)
    return bool(found)


def _writes_or_returns(user: torch.fx.Node) -> bool:
    return user.op != "call_function" or _compat.mutates_an_argument(user.target)


def _foldable(node: torch.fx.Node) -> bool:
    """A pasted call the cache's rebuild would have turned into a constant, and that may be one (rule 1)."""
    if node.op != "call_function" or _compat.pasted_aot_prefix(node.name) is None or _reads_a_node(node):
        return False
    if not _compat.is_op_overload(node.target):
        return False
    if torch.Tag.nondeterministic_seeded in node.target.tags:
        return False
    return not any(_writes_or_returns(user) for user in node.users)


def _constant_of(node: torch.fx.Node, graph_module: torch.fx.GraphModule, folded: dict[torch.fx.Node, Any]) -> Any:
    """The tensor a pasted node stands for when it is a constant (folded or read by ``get_attr``), else None."""
    if node in folded:
        return folded[node]
    if node.op == "get_attr" and _compat.pasted_aot_prefix(node.name) is not None:
        value = getattr(graph_module, str(node.target), None)  # a get_attr node's target is the attribute's name
        return value if isinstance(value, torch.Tensor) else None
    return None


def _node_name(node: torch.fx.Node) -> str | None:
    """Rule 3: the name a pasted node gets, or None where it keeps its own."""
    prefix = _compat.pasted_aot_prefix(node.name)
    if prefix is None or node.op not in ("call_function", "call_method", "call_module"):
        return None
    source = node.args[0] if node.args else None
    if node.target is operator.getitem and isinstance(source, torch.fx.Node) and _compat.pasted_aot_prefix(source.name) is None:
        return None  # an input of the pasted graph (a slot of the prologue's result): named alike in both
    return prefix + _operation(node.target)


def _same_code(left: torch.fx.Graph, right: torch.fx.Graph) -> bool:
    """Whether two graphs read the same: node by node the same name, op, target, type and arguments (no codegen)."""
    if len(left.nodes) != len(right.nodes):
        return False

    def by_name(value: Any) -> Any:
        return torch.fx.map_arg(value, lambda node: ("node", node.name))

    try:
        return all(
            a.name == b.name and a.op == b.op and (a.target is b.target or a.target == b.target) and a.type == b.type
            and by_name(a.args) == by_name(b.args) and by_name(a.kwargs) == by_name(b.kwargs)
            for a, b in zip(left.nodes, right.nodes)
        )
    except RuntimeError:  # an argument that compares element-wise (a tensor): call it different, as code would
        return False


def canonical_form(graph_module: torch.fx.GraphModule) -> bool:
    """Rewrite the nodes pasted from AOT backwards into their canonical form; returns whether anything changed."""
    graph = graph_module.graph
    nodes = list(graph.nodes)
    if not any(_compat.pasted_aot_prefix(node.name) for node in nodes):
        return False
    with _compat.outside_tracing():
        folded = {node: node.target(*node.args, **node.kwargs) for node in nodes if _foldable(node)}
    constants = {node: value for node in nodes if (value := _constant_of(node, graph_module, folded)) is not None}
    rewritten = _compat.empty_graph_like(graph, graph_module)
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    reads: dict[int, torch.fx.Node] = {}  # id(constant) -> its one get_attr
    counts: dict[str, int] = {}
    prefixes: dict[str, str] = {}  # rule 4

    def canonical_prefix(prefix: str) -> str:
        found = prefixes.get(prefix)
        if found is None:
            found = prefixes[prefix] = f"aot{len(prefixes)}_"
        return found

    def canonical_name(name: str) -> str:
        prefix = _compat.pasted_aot_prefix(name)
        return name if prefix is None else canonical_prefix(prefix) + name[len(prefix):]

    def read(node: torch.fx.Node) -> torch.fx.Node:
        value = constants.get(node)
        if value is None:
            return copies[node]
        found = reads.get(id(value))
        if found is None:
            pasted = _compat.pasted_aot_prefix(node.name)
            assert pasted is not None, node.name  # only pasted nodes are constants (_constant_of)
            prefix = canonical_prefix(pasted)
            index = counts[prefix] = counts.get(prefix, -1) + 1
            attribute = f"{prefix}constant{index}"
            setattr(graph_module, attribute, value)
            found = reads[id(value)] = rewritten.create_node("get_attr", attribute, (), {}, attribute)
        return found

    for node in nodes:
        if node in constants:
            continue  # read where first used
        args = torch.fx.map_arg(node.args, read)
        kwargs = torch.fx.map_arg(node.kwargs, read)
        copied = rewritten.create_node(node.op, node.target, args, kwargs, canonical_name(_node_name(node) or node.name), node.type)
        copied.meta = copy.copy(node.meta)
        copies[node] = copied
    if _same_code(rewritten, graph):
        return False  # already canonical
    for node in constants:
        if node.op == "get_attr" and not _compat.pasted_aot_prefix(node.target) and hasattr(graph_module, node.target):
            delattr(graph_module, node.target)  # the rebuilt graph's own name for it
    graph_module.graph = rewritten
    return True
