"""Splitting a CA graph at the hooks Dynamo must not trace: compiled pieces, eager hooks between them.

Note [Splitting the CA graph at FSDP2's hooks]
----------------------------------------------
FSDP2's backward hooks are ``dynamo.disable``-d (Note [FSDP2 under compiled autograd] in
``_fsdp2.py``).  Compiling the whole CA graph with ``fullgraph=False`` works, but Dynamo then
breaks the graph at each hook and resumes after it in a new frame: every step pays a Dynamo
frame entry (guard checks, resume-function calls) per break and per resumed piece.

So we split the CA graph ourselves, at FX level, before Dynamo sees it:

* a *split point* is a ``call_function`` node that calls a ``dynamo.disable``-d callable, or
  compiled autograd's ``call_hook`` / ``call_backward`` whose hook object (read from the
  graph's ``hooks`` argument on the first run) is ``dynamo.disable``-d or belongs to FSDP2
  (``_fsdp2.hook_owners``).  The rule is about the kind of hook, not about a backend;
* every contiguous run of other nodes becomes one piece, compiled with
  ``torch.compile(piece, backend=config.backend, fullgraph=True, **compile_kwargs)``; each
  split point (with the ``hooks[i]`` read before it and the ``getitem``s of its result) is a
  piece of its own that runs eagerly;
* reads of the graph's inputs (``inputs[i]``, ``sizes[i]`` and their
  ``unwrap_maybe_dynamic_int``) move to the piece of their first user, so pieces pass each
  other tensors, not sizes: a piece sees its sizes the way the whole graph would;
* ``torch.fx.passes.split_module`` (``keep_original_order=True``) builds a top-level
  GraphModule that calls the pieces in graph order; the top level itself runs as plain
  Python (the wrapper around it is ``dynamo.disable``-d), so a step pays exactly one Dynamo
  frame entry per compiled piece and none for the hooks;
* nothing on that path goes through ``nn.Module.__call__``: the top level's ``forward`` is
  called directly, each eager piece is its GraphModule's bound ``forward`` and each compiled
  piece is ``torch.compile`` of its bound ``forward`` (not of the module), which saves the
  module-call machinery -- two ``_call_impl`` layers per compiled piece, one per eager piece,
  about 0.1 ms of a 2.8 ms backward on the micro MLP of ``bench --fsdp2``.

A piece whose own code needs a graph break (e.g. a user's untraceable tensor hook beside
FSDP2's) fails to compile under ``fullgraph=True`` before any of its code runs (Dynamo traces
the whole frame first); it is then compiled with ``fullgraph=False`` and the capture report
records it -- what the unsplit FSDP2 graph did for the whole graph.  The eager hooks still
queue FSDP2's final callback to the engine: ``CompiledCAGraph`` runs the split graph inside
``_fsdp2.final_callbacks()`` and checks ``_fsdp2.check_finished`` afterwards, as before.

The split is decided once, on the graph's first run: compiled autograd's cache key includes
the autograd nodes (FSDP2's own autograd Functions among them), so a cached graph is run with
hooks of the same kinds at the same positions.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import _compat, _fsdp2, diagnostics
from ._cut import cut, is_input_read
from ._nodes import HOOKS_ARG, hook_object

__all__ = ["split_points", "SplitGraph", "split_graph"]



def split_points(graph_module: torch.fx.GraphModule, hooks: Sequence[Any]) -> list[torch.fx.Node]:
    """The nodes Dynamo must not trace (Note [Splitting the CA graph at FSDP2's hooks]), in graph order."""
    placeholders = [node for node in graph_module.graph.nodes if node.op == "placeholder"]
    hooks_placeholder = placeholders[HOOKS_ARG] if len(placeholders) > HOOKS_ARG else None
    hook_calls = _compat.hook_calls()
    points = []
    for node in graph_module.graph.nodes:
        if node.op != "call_function":
            continue
        if _compat.is_dynamo_disabled(node.target):
            points.append(node)
        elif node.target in hook_calls:
            hook = hook_object(node, hooks, hooks_placeholder)
            if hook is not None and (_compat.is_dynamo_disabled(hook) or _fsdp2.hook_owners([hook])):
                points.append(node)
    return points


def _gather(graph: torch.fx.Graph, points: Sequence[torch.fx.Node]) -> None:
    """Move each read of a graph input to just before its first user, and each unpacking of a split
    point's result to just after it, so that graph order alone decides the pieces (pure reads only)."""
    order: dict[torch.fx.Node, float] = {node: index for index, node in enumerate(graph.nodes)}
    reads: list[torch.fx.Node] = []
    seen: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if is_input_read(node, seen):
            seen.add(node)
            reads.append(node)
    for node in reversed(reads):  # a chain of reads follows its last link
        if node.users:
            first = min(node.users, key=lambda user: order[user])
            first.prepend(node)
            order[node] = order[first] - 0.5
    for point in points:
        unpacks = [u for u in point.users if u.op == "call_function" and u.target is operator.getitem]
        for unpack in sorted(unpacks, key=lambda user: order[user], reverse=True):
            point.append(unpack)


def _partitions(graph: torch.fx.Graph, points: Sequence[torch.fx.Node]) -> tuple[dict[torch.fx.Node, int], set[int]]:
    """Node -> piece number (graph order), and the numbers of the eager (split-point) pieces.

    Call after :func:`_gather`: a split point's piece also holds the reads just before it that
    only it uses (its ``hooks[i]``) and the unpacking of its result just after it.
    """
    point_set = set(points)
    piece: dict[torch.fx.Node, int] = {}
    eager: set[int] = set()
    current = 0
    pending: list[torch.fx.Node] = []  # reads not yet placed: they join their first user's piece
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_input_read(node, set(pending)):
            pending.append(node)
            continue
        if node in point_set:
            current += 1
            eager.add(current)
            number = current
        elif node.op == "call_function" and node.target is operator.getitem and node.args[0] in point_set:
            number = piece[node.args[0]]
        else:
            if current in eager:
                current += 1
            number = current
        for read in pending:
            piece[read] = number
        pending.clear()
        piece[node] = number
    for read in pending:  # reads nobody uses
        piece[read] = current
    return piece, eager


class _Piece:
    """One compiled piece: ``fullgraph=True``; a piece that needs a graph break is recompiled without."""

    def __init__(self, module: torch.fx.GraphModule, name: str, compile_piece: Callable[..., Any], report: Any) -> None:
        self._module = module
        self._name = name
        self._compile_piece = compile_piece
        self._report = report
        self._compiled = compile_piece(module.forward, fullgraph=True)
        self._set_aside: Any = None
        """The compiled callable while :meth:`use_compiled` (False) runs the FX graph instead."""
        self._first = True

    def __call__(self, *args: Any) -> Any:
        if not self._first:
            return self._compiled(*args)
        try:
            result = self._compiled(*args)
        except Exception as error:
            # fullgraph=True fails while tracing, before any of this piece's code ran
            if not _compat.is_graph_break(error):
                raise
            self._compiled = self._compile_piece(self._module.forward, fullgraph=False)
            self._report.fallbacks.append(
                f"split piece {self._name}: needs a graph break ({_compat.graph_break_type(error)}); "
                "compiled with fullgraph=False"
            )
            result = self._compiled(*args)
        self._first = False
        return result

    def use_compiled(self, compiled: bool) -> None:
        """Run the compiled piece (the default) or its FX graph uncompiled: a measurement of what
        the compile adds to a piece (``fsdp2-cost``); only after the first run, which compiles."""
        if self._first:
            raise RuntimeError(f"split piece {self._name}: use_compiled() before its first run, which compiles it")
        if compiled and self._set_aside is not None:
            self._compiled, self._set_aside = self._set_aside, None
        elif not compiled and self._set_aside is None:
            self._compiled, self._set_aside = self._module.forward, self._compiled


class SplitGraph:
    """The CA graph split at its hook nodes: compiled pieces and eager hook calls, run in graph order."""

    def __init__(self, top: torch.fx.GraphModule, pieces: Sequence[_Piece], hooks: int) -> None:
        self.top = top
        self._forward = top.forward
        self._pieces = tuple(pieces)
        self.pieces = len(self._pieces)
        """Compiled pieces (one Dynamo frame entry each per run)."""
        self.hooks = hooks
        """Split points run eagerly between the pieces."""

    def use_compiled(self, compiled: bool) -> None:
        """Every piece compiled (the default) or run as its FX graph: see :meth:`_Piece.use_compiled`."""
        for piece in self._pieces:
            piece.use_compiled(compiled)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward(*args, **kwargs)


def split_graph(
    graph_module: torch.fx.GraphModule,
    points: Sequence[torch.fx.Node],
    compile_piece: Callable[..., Any],
    report: diagnostics.CaptureReport,
) -> SplitGraph:
    """Split ``graph_module`` at ``points``; ``compile_piece(forward, fullgraph=...)`` compiles each other
    piece's bound ``forward``."""
    _gather(graph_module.graph, points)
    graph_module.recompile()
    piece, eager = _partitions(graph_module.graph, points)
    pieces = cut(graph_module, piece)
    pieces.detach()
    compiled = []
    for number, module in pieces:
        if number in eager:
            pieces.install(number, module.forward)
            continue
        compiled.append(_Piece(module, pieces.pieces[number][0], compile_piece, report))
        pieces.install(number, compiled[-1])
    return SplitGraph(pieces.top, compiled, len(points))
