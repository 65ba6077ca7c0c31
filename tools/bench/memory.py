"""Backward memory of a captured CA graph: stock make_subclass nodes vs ours.

Note [Why the epilogue holds memory]
------------------------------------
Stock compiled autograd feeds *every* flat output of the AOT backward to *each*
``make_subclass`` node, so every gradient the AOT backward produced stays referenced
until the last rebuild has run -- even a gradient that was already accumulated into its
``.grad``.  Our node takes only its own inner tensors, so a gradient is released as soon
as its own subclass has been accumulated.

On CUDA we measure it directly (``torch.cuda.max_memory_allocated`` around the
backward).  On CPU there is no allocator counter, so we use a *liveness proxy*: the CA
graph is executed once node by node (``torch.fx.Interpreter``, eager) on the real
inputs of the backward, every node's real output is recorded, and a storage is live from
the node that first produces it until the last node that *uses* a value referencing it
(a rebuilt subclass references its inner tensors, so rebuilding extends their life to
the subclass's own last use).  Graph inputs (parameters, saved activations) are owned by
the caller and left out.  The proxy reports the peak live bytes and the mean live bytes
over the epilogue (the rebuild and accumulate nodes after the first rebuild).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from typing import Any

import torch

from subclass_ca import _compat

__all__ = ["Liveness", "graph_liveness", "recording_compiler", "ca_graph_liveness"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Liveness:
    """Live-tensor bytes of one execution of a CA graph (graph inputs excluded)."""

    peak_bytes: int
    """Largest total size of the storages live after any node."""
    epilogue_mean_bytes: float
    """Mean live bytes over the epilogue (from the first make_subclass node to the end)."""
    make_subclass_nodes: int
    """How many make_subclass nodes (stock or ours) the graph has."""
    make_subclass_args: int
    """Total tensor arguments of those nodes (stock: all flat outputs each)."""


def _storages(value: Any, out: dict[int, int]) -> None:
    """Collect (storage key -> nbytes) of every tensor reachable from ``value``."""
    if isinstance(value, torch.Tensor):
        if _compat.is_traceable_wrapper_subclass(value):
            names, _ = value.__tensor_flatten__()
            for name in names:
                _storages(getattr(value, name), out)
            return
        try:
            storage = value.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        if storage.nbytes():
            out[storage.data_ptr() or id(storage)] = storage.nbytes()
    elif isinstance(value, (list, tuple)):
        for item in value:
            _storages(item, out)
    elif isinstance(value, dict):
        for item in value.values():
            _storages(item, out)


def is_make_subclass_node(node: torch.fx.Node) -> bool:
    """A stock ``make_subclass`` closure or one of our named rebuild callables."""
    if node.op != "call_function":
        return False
    return hasattr(node.target, "_subclass_ca_mode") or _compat.is_stock_make_subclass(node.target)


class _Recorder(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule) -> None:
        # Keep every value until the run ends: no storage address is reused, so data_ptr identifies it.
        super().__init__(gm, garbage_collect_values=False)
        self.outputs: dict[torch.fx.Node, dict[int, int]] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        result = super().run_node(n)
        found: dict[int, int] = {}
        _storages(result, found)
        self.outputs[n] = found
        return result


def graph_liveness(gm: torch.fx.GraphModule, *args: Any) -> tuple[Any, Liveness]:
    """Run ``gm(*args)`` eagerly node by node; return its result and its :class:`Liveness`."""
    recorder = _Recorder(gm)
    result = recorder.run(*args)
    if isinstance(result, (list, tuple)):
        result = list(result)  # compiled autograd wants an exact list, fx returns an immutable_list
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    # Values derived from the graph's inputs by indexing are caller-owned.
    external: set[int] = set()
    for n in nodes:
        if n.op == "placeholder" or (
            n.op == "call_function" and n.target is operator.getitem and n.args and getattr(n.args[0], "op", "") == "placeholder"
        ):
            external.update(recorder.outputs.get(n, {}))
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    size: dict[int, int] = {}
    for n in nodes:
        produced = recorder.outputs.get(n, {})
        end = max((order[u] for u in n.users), default=order[n])
        for key, nbytes in produced.items():
            if key in external:
                continue
            size[key] = max(size.get(key, 0), nbytes)
            first[key] = min(first.get(key, order[n]), order[n])
            last[key] = max(last.get(key, end), end)
    live_after = [0] * len(nodes)
    for key, nbytes in size.items():
        for i in range(first[key], last[key] + 1):
            live_after[i] += nbytes
    makes = [n for n in nodes if is_make_subclass_node(n)]
    start = order[makes[0]] if makes else len(nodes) - 1
    epilogue = live_after[start:] or [0]
    liveness = Liveness(
        peak_bytes=max(live_after, default=0),
        epilogue_mean_bytes=sum(epilogue) / len(epilogue),
        make_subclass_nodes=len(makes),
        make_subclass_args=sum(sum(isinstance(a, torch.fx.Node) for a in n.args) for n in makes),
    )
    return result, liveness


def recording_compiler(backend: str, sink: list[Liveness]) -> Callable[[torch.fx.GraphModule], Any]:
    """A CA ``compiler_fn``: the first call of each captured graph is measured (run eagerly), later calls are compiled."""

    def compiler_fn(gm: torch.fx.GraphModule) -> Any:
        compiled = torch.compile(gm, backend=backend, fullgraph=True)
        measured = False

        def run(*args: Any) -> Any:
            nonlocal measured
            if measured:
                return compiled(*args)
            measured = True
            result, liveness = graph_liveness(gm, *args)
            sink.append(liveness)
            return result

        return run

    return compiler_fn


def ca_graph_liveness(step: Callable[[], None], enter: Callable[[Callable[..., Any]], Any], backend: str = "aot_eager") -> Liveness:
    """Capture one fresh CA graph of ``step()`` under ``enter(compiler_fn)`` and measure it.

    ``enter`` turns a compiler_fn into a context manager (stock: ``_compat.enable_compiled_autograd``;
    ours: ``_runtime.capture_with``).
    """
    sink: list[Liveness] = []
    _compat.reset_compiled_autograd()
    with enter(recording_compiler(backend, sink)):
        step()
    if not sink:
        raise RuntimeError("ca_graph_liveness: the step did not capture a compiled-autograd graph")
    return sink[0]
