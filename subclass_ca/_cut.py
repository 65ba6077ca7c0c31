"""Cutting a CA graph into pieces run from an eager top level: the scaffold the split and regional paths share.

``_split.py`` cuts at hooks Dynamo must not trace, ``_regional.py`` at the pasted AOT backwards; each decides
which piece a node belongs to, and this module does the rest the same way for both (Note [Cutting a CA graph]).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.fx.passes.split_module import split_module

from . import _compat

__all__ = ["Cut", "cut", "is_input_index", "is_input_read"]

# Note [Cutting a CA graph]
# -------------------------
# ``torch.fx.passes.split_module`` (``keep_original_order=True``) builds a top-level GraphModule
# that calls one child module per piece number, in graph order; a child is named ``submod_<n>``.
# Each piece then becomes a plain attribute of the top level (the child module is detached, so
# nothing goes through ``nn.Module.__call__``: the top level's generated code calls
# ``self.submod_<n>(...)``, which finds the callable set with ``object.__setattr__``): a bound
# ``forward`` for a piece that runs eagerly, a compiled callable for the others.
#
# What reads a graph input: compiled autograd's graph takes ``inputs``, ``sizes``, ``scalars``,
# ``hooks`` and ``packed_inputs`` as lists and indexes them (``inputs[i]``: a getitem of a
# placeholder), and reads a size through ``unwrap_maybe_dynamic_int``.  The two paths place those
# reads differently, on purpose:
# * an *input index* (a getitem of a placeholder) is all the regional path moves into its eager
#   reads piece: a size's ``unwrap_maybe_dynamic_int`` must stay in the compiled piece that uses
#   it, where Dynamo sees the size as the (possibly dynamic) size of a tensor, not as a constant int;
# * an *input read* (an index, or a ``getitem`` / ``unwrap_maybe_dynamic_int`` of input reads) is
#   what the split path moves to its first user's piece, unwrap included: it stays compiled there.

_INPUT_READS = ("getitem", "unwrap_maybe_dynamic_int")
"""Names of the side-effect-free reads of graph inputs (Note [Cutting a CA graph])."""


def is_input_index(node: torch.fx.Node) -> bool:
    """``inputs[i]``, ``sizes[i]``, ...: a getitem of a graph input (Note [Cutting a CA graph])."""
    return (
        node.op == "call_function"
        and node.target is operator.getitem
        and isinstance(node.args[0], torch.fx.Node)
        and node.args[0].op == "placeholder"
    )


def is_input_read(node: torch.fx.Node, reads: set[torch.fx.Node]) -> bool:
    """An input index, or a pure read of ``reads`` (earlier input reads) or inputs (Note [Cutting a CA graph])."""
    return (
        node.op == "call_function"
        and getattr(node.target, "__name__", None) in _INPUT_READS
        and all(arg.op == "placeholder" or arg in reads for arg in node.all_input_nodes)
    )


@dataclass(frozen=True)
class Cut:
    """A graph cut into numbered pieces: the top level, and each piece's attribute name and module."""

    top: torch.fx.GraphModule
    pieces: Mapping[int, tuple[str, torch.fx.GraphModule]]
    """Piece number -> (the top level's attribute that calls it, its module), in the order the top level calls them."""

    def __iter__(self) -> Iterator[tuple[int, torch.fx.GraphModule]]:
        return ((number, module) for number, (_, module) in self.pieces.items())

    def detach(self) -> None:
        """Take the piece modules off the top level; each is then called through :meth:`install` (Note [Cutting a CA graph])."""
        for name, _ in self.pieces.values():
            delattr(self.top, name)

    def install(self, number: int, run: Callable[..., Any]) -> None:
        """What the top level calls for piece ``number``."""
        object.__setattr__(self.top, self.pieces[number][0], run)


def cut(graph_module: torch.fx.GraphModule, piece_of: Mapping[torch.fx.Node, int], *, deferred_codegen: bool = False) -> Cut:
    """``graph_module`` cut into the pieces ``piece_of`` numbers (every node but placeholders and the output).

    ``deferred_codegen``: leave generating the modules' code to the caller (``_compat.generate_code``), once each,
    after it has looked at them (split_module would generate each twice).
    """
    if deferred_codegen:
        with _compat.deferred_codegen():
            top = split_module(graph_module, graph_module, piece_of.__getitem__, keep_original_order=True)  # root_m: unused
    else:
        top = split_module(graph_module, graph_module, piece_of.__getitem__, keep_original_order=True)
    pieces = {int(name.rsplit("_", 1)[1]): (name, cast(torch.fx.GraphModule, module)) for name, module in top.named_children()}
    return Cut(top, pieces)
