"""The CA graph split at hooks Dynamo must not trace (Note [Splitting the CA graph at FSDP2's hooks] in _split.py).

Single process, on a hand-built graph with compiled autograd's signature; the FSDP2 graphs
themselves are split in tests/test_fsdp2.py (2 processes).
"""

from __future__ import annotations

import operator
import types
from collections.abc import Callable

import pytest
import torch

from subclass_ca import _split, diagnostics

EAGER_CALLS: list[bool] = []


@torch.compiler.disable
def _eager_hook(grad: torch.Tensor) -> torch.Tensor:
    EAGER_CALLS.append(torch.compiler.is_compiling())
    return grad * 3


def _plain_hook(grad: torch.Tensor) -> torch.Tensor:
    return grad + 1


def _ca_like_graph(hook_fn: object) -> torch.fx.GraphModule:
    """inputs[0] * 2 -> call_hook(hooks[0], .) -> + inputs[1] -> call_hook(hooks[1], .) -> * sizes[0]."""
    from subclass_ca import _compat

    call_hook = _compat.hook_calls()[0]
    graph = torch.fx.Graph()
    inputs, sizes, _scalars, hooks, _packed = (graph.placeholder(n) for n in ("inputs", "sizes", "scalars", "hooks", "packed"))
    size = graph.call_function(operator.getitem, (sizes, 0))  # read at the top, used at the end
    x = graph.call_function(torch.mul, (graph.call_function(operator.getitem, (inputs, 0)), 2))
    x = graph.call_function(call_hook, (graph.call_function(operator.getitem, (hooks, 0)), x), {"hook_type": "tensor_pre_hook"})
    x = graph.call_function(torch.add, (x, graph.call_function(operator.getitem, (inputs, 1))))
    x = graph.call_function(call_hook, (graph.call_function(operator.getitem, (hooks, 1)), x), {"hook_type": "tensor_pre_hook"})
    graph.output([graph.call_function(torch.mul, (x, size))])
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _args() -> tuple:
    return ([torch.ones(3), torch.full((3,), 2.0)], [5], [], [_eager_hook, _plain_hook], [])


def _reference(args: tuple) -> torch.Tensor:
    (a, b), (size,), _, (h0, h1), _ = args
    return h1(h0(a * 2) + b) * size


def test_only_dynamo_disabled_hooks_are_split_points() -> None:
    graph_module = _ca_like_graph(_eager_hook)
    points = _split.split_points(graph_module, _args()[3])
    assert [p.args[0].args[1] for p in points] == [0]  # hooks[0] is disabled, hooks[1] is traceable
    assert _split.split_points(graph_module, [_plain_hook, _plain_hook]) == []


def test_split_graph_compiles_each_piece_whole_and_runs_the_hook_eagerly() -> None:
    graph_module = _ca_like_graph(_eager_hook)
    compiled_graphs: list[torch.fx.GraphModule] = []
    fullgraph_flags: list[bool] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        compiled_graphs.append(gm)
        return gm.forward

    compiled_targets: list[object] = []

    def compile_piece(forward: Callable[..., object], *, fullgraph: bool) -> object:
        fullgraph_flags.append(fullgraph)
        compiled_targets.append(forward)
        return torch.compile(forward, backend=backend, fullgraph=fullgraph)

    report = diagnostics.CaptureReport(capture_index=0)
    args = _args()
    points = _split.split_points(graph_module, args[3])
    split = _split.split_graph(graph_module, points, compile_piece, report)
    assert (split.pieces, split.hooks) == (2, 1)
    for _ in range(3):
        expected = _reference(_args())
        EAGER_CALLS.clear()
        (out,) = split(*_args())
        torch.testing.assert_close(out, expected, atol=0, rtol=0)
        assert EAGER_CALLS == [False]  # the disabled hook ran once, outside Dynamo
    assert fullgraph_flags == [True, True]
    assert len(compiled_graphs) == 2  # one Dynamo graph per piece, no recompiles, no resume pieces
    assert report.fallbacks == []
    # no nn.Module call machinery on the run path: compiled pieces are compiled bound forwards,
    # the eager piece is a bound forward, the top level holds no submodule
    assert all(isinstance(target, types.MethodType) and target.__name__ == "forward" for target in compiled_targets)
    assert all(isinstance(target.__self__, torch.fx.GraphModule) for target in compiled_targets)
    assert list(split.top.children()) == []


def _needs_graph_break(x: torch.Tensor) -> torch.Tensor:
    torch._dynamo.graph_break()
    return x + 1


def test_piece_that_needs_a_graph_break_is_recompiled_without_fullgraph_and_reported() -> None:
    graph_module = _ca_like_graph(_eager_hook)
    output = next(n for n in graph_module.graph.nodes if n.op == "output")
    (result,) = output.args[0]
    with graph_module.graph.inserting_before(output):
        broken = graph_module.graph.call_function(_needs_graph_break, (result,))
    output.args = ([broken],)
    graph_module.recompile()
    flags: list[bool] = []

    def compile_piece(forward: Callable[..., object], *, fullgraph: bool) -> object:
        flags.append(fullgraph)
        return torch.compile(forward, backend="eager", fullgraph=fullgraph)

    report = diagnostics.CaptureReport(capture_index=0)
    split = _split.split_graph(graph_module, _split.split_points(graph_module, _args()[3]), compile_piece, report)
    expected = _reference(_args()) + 1
    (out,) = split(*_args())
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    assert flags == [True, True, False]  # only the last piece fell back
    assert len(report.fallbacks) == 1
    assert "needs a graph break" in report.fallbacks[0] and "fullgraph=False" in report.fallbacks[0]
    (again,) = split(*_args())
    torch.testing.assert_close(again, expected, atol=0, rtol=0)
    assert len(report.fallbacks) == 1


def test_pieces_can_run_uncompiled_for_measurement_and_back() -> None:
    """``SplitGraph.use_compiled(False)`` runs each piece's FX graph (what ``fsdp2-cost`` measures), same result."""
    graph_module = _ca_like_graph(_eager_hook)
    compiled_calls: list[int] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        def run(*args: object) -> object:
            compiled_calls.append(1)
            return gm.forward(*args)

        return run

    def compile_piece(forward: Callable[..., object], *, fullgraph: bool) -> object:
        return torch.compile(forward, backend=backend, fullgraph=fullgraph)

    report = diagnostics.CaptureReport(capture_index=0)
    split = _split.split_graph(graph_module, _split.split_points(graph_module, _args()[3]), compile_piece, report)
    with pytest.raises(RuntimeError, match=r"split piece submod_\d+: use_compiled\(\) before its first run"):
        split.use_compiled(False)
    expected = _reference(_args())
    torch.testing.assert_close(split(*_args())[0], expected, atol=0, rtol=0)
    assert len(compiled_calls) == 2
    split.use_compiled(False)
    split.use_compiled(False)  # idempotent
    torch.testing.assert_close(split(*_args())[0], expected, atol=0, rtol=0)
    assert len(compiled_calls) == 2  # neither piece ran its compiled code
    split.use_compiled(True)
    torch.testing.assert_close(split(*_args())[0], expected, atol=0, rtol=0)
    assert len(compiled_calls) == 4
