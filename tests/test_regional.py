"""Regional compiled autograd (issue 47; Note [Regional CA graphs] in ``subclass_ca/_regional.py``).

A stack of identical blocks, each compiled on its own (``block.compile()``): under ``enable()`` the CA graph is
cut at its pasted AOT backwards and each distinct piece compiles once; the parameters after two SGD steps equal
the whole graph's bitwise (aot_eager) and eager's.  Graphs without repeated pieces, with hooks, or under
``regional=False`` stay whole; a piece that fails after others ran says so.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import subclass_ca
from subclass_ca import RegionalCompileError, _compat, _graph
from subclass_ca._regional import piece_identity

TwoTensor = _compat.two_tensor_type()
pytestmark = pytest.mark.skipif(TwoTensor is None, reason="this torch has no TwoTensor")


class Block(nn.Module):
    """LayerNorm -> frozen TwoTensor weight + rank-4 LoRA -> tanh -> residual (issue 47's block, smaller)."""

    def __init__(self, dim: int = 16, rank: int = 4) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        weight = torch.randn(dim, dim) * dim**-0.5
        self.weight = nn.Parameter(TwoTensor(weight.clone(), weight * 0.5), requires_grad=False)
        self.lora_a = nn.Parameter(torch.randn(rank, dim) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(dim, rank) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + torch.tanh(h @ self.weight.t() + h @ self.lora_a.t() @ self.lora_b.t())


def _inner(t: torch.Tensor) -> list[torch.Tensor]:
    return [t.a.detach().clone(), t.b.detach().clone()] if isinstance(t, TwoTensor) else [t.detach().clone()]


def stack(depth: int, mode: str, backend: str = "aot_eager", *, head: bool = False) -> nn.Sequential:
    """``depth`` blocks, each compiled on its own unless ``mode`` is eager; ``head``: a plain Linear after them (not compiled)."""
    torch.manual_seed(0)
    model = nn.Sequential(*(Block() for _ in range(depth)), *([nn.Linear(16, 16)] if head else []))
    if mode != "eager":
        for block in model[:depth]:
            block.compile(backend=backend)
    return model


def train(depth: int, mode: str, backend: str = "aot_eager", *, hook: bool = False, steps: int = 2, head: bool = False,
          **enable_kwargs):
    """Parameters (inner tensors) after ``steps`` SGD steps, and the last capture report (``mode``: eager | ours)."""
    model = stack(depth, mode, backend, head=head)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.1)
    for step in range(steps):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step), requires_grad=hook)
        if hook:
            x.register_hook(lambda grad: grad * 2)
        block = subclass_ca.enable(backend=backend, **enable_kwargs) if mode == "ours" else None
        loss = model(x).sin().sum()
        if block is None:
            loss.backward()
        else:
            with block:
                loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return [inner for p in model.parameters() for inner in _inner(p)], subclass_ca.last_report()


class CountingBackend:
    """A backend whose compiled pieces count their runs: Dynamo's graph run as it is, or compiled by ``inner``."""

    def __init__(self, inner: str | None = None) -> None:
        self.inner = inner
        self.compiles = 0
        self.runs = 0

    def __call__(self, graph_module, example_inputs):
        self.compiles += 1
        compiled = graph_module if self.inner is None else torch._dynamo.lookup_backend(self.inner)(graph_module, example_inputs)

        def run(*args):
            self.runs += 1
            return compiled(*args)

        return run


@pytest.fixture(scope="module")
def deep():
    subclass_ca.reset()
    return {"eager": train(5, "eager")[0], "regional": train(5, "ours"), "whole": train(5, "ours", regional=False)}


def test_identical_blocks_compile_each_distinct_piece_once_and_equal_the_whole_graph_bitwise(deep):
    got, report = deep["regional"]
    assert report.regional_pieces == 5, report.summary()
    # the first block (its input needs no gradient: compiled apart by Dynamo too) differs; the loss's backward runs
    # eagerly before the pieces, so the four others are one compile
    assert report.regional_compiles == 2, report.summary()
    assert "regional: 5 piece(s), 2 distinct compile(s)" in report.summary()
    whole, whole_report = deep["whole"]
    assert whole_report.regional_pieces == 0
    for g, w, e in zip(got, whole, deep["eager"], strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
        torch.testing.assert_close(g, e)


def test_a_graph_without_repeated_pieces_stays_whole():
    subclass_ca.reset()
    got, report = train(2, "ours")  # two blocks, two different backwards: nothing to share
    assert report.regional_pieces == 0, report.summary()
    for g, e in zip(got, train(2, "eager")[0], strict=True):
        torch.testing.assert_close(g, e)


def test_a_graph_with_hooks_stays_whole_and_matches_eager():
    subclass_ca.reset()
    got, report = train(4, "ours", hook=True)
    assert report.regional_pieces == 0, report.summary()
    for g, e in zip(got, train(4, "eager", hook=True)[0], strict=True):
        torch.testing.assert_close(g, e)


@pytest.mark.inductor
def test_regional_pieces_under_inductor_match_eager_and_run_compiled_at_every_step(monkeypatch):
    subclass_ca.reset()
    backend, run_only_steps = CountingBackend("inductor"), []
    enter = _compat.enter_run_only
    monkeypatch.setattr(_compat, "enter_run_only", lambda: run_only_steps.append(1) or enter())
    got, report = train(4, "ours", backend=backend, steps=3)
    assert report.regional_pieces == 4 and report.regional_compiles == 2, report.summary()
    # the blocks' forwards (compiled by the same backend) and inductor's pieces ran compiled at every step, the
    # last two steps' pieces entered directly (run-only mode)
    assert (backend.runs, len(run_only_steps)) == (4 * 3 + 4 * 3, 2)
    for g, e in zip(got, train(4, "eager", steps=3)[0], strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_a_head_outside_the_blocks_runs_eagerly_and_its_gradients_equal_the_whole_graphs():
    subclass_ca.reset()
    got, report = train(4, "ours", head=True)
    assert report.regional_pieces == 4 and report.regional_compiles == 2, report.summary()
    whole, _ = train(4, "ours", head=True, regional=False)
    for g, w, e in zip(got, whole, train(4, "eager", head=True)[0], strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
        torch.testing.assert_close(g, e)


def _graph_module(scale: float, fn=torch.mul) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(fn, (x, scale)))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _closure_over(value: object):
    def scaled(x):
        return x * (value is None)

    return scaled


def test_piece_identity_compares_what_pieces_compute_never_names():
    assert piece_identity(_graph_module(2.0)) == piece_identity(_graph_module(2.0))
    assert piece_identity(_graph_module(2.0)) != piece_identity(_graph_module(3.0))
    assert piece_identity(_graph_module(2.0)) != piece_identity(_graph_module(2.0, torch.add))
    # one code, two closures: the same only when the closure holds the very same objects
    shared = object()
    assert piece_identity(_graph_module(2.0, _closure_over(shared))) == piece_identity(_graph_module(2.0, _closure_over(shared)))
    assert piece_identity(_graph_module(2.0, _closure_over(shared))) != piece_identity(_graph_module(2.0, _closure_over(object())))


def _failing_compile(fail_at: int):
    """A piece compiler whose ``fail_at``-th distinct compile raises at its first call."""
    calls = []
    original = _graph.CompiledCAGraph._compile_piece

    def compile_piece(self, forward, *, fullgraph, **kwargs):
        calls.append(forward)
        if len(calls) == fail_at:
            def broken(*args):
                raise RuntimeError("piece compile failed on purpose")

            return broken
        return original(self, forward, fullgraph=fullgraph, **kwargs)

    return compile_piece


def test_a_piece_failing_after_others_ran_names_what_ran_and_the_way_out(monkeypatch):
    subclass_ca.reset()
    monkeypatch.setattr(_graph.CompiledCAGraph, "_compile_piece", _failing_compile(2))
    with pytest.raises(RegionalCompileError, match=r"piece 5 of 5 .*after 4 earlier piece\(s\) ran.*enable\(regional=False\)"):
        train(5, "ours", steps=1)


def test_a_first_piece_failing_compiles_the_graph_whole_and_matches_eager(monkeypatch):
    subclass_ca.reset()
    monkeypatch.setattr(_graph.CompiledCAGraph, "_compile_piece", _failing_compile(1))
    got, report = train(5, "ours", steps=1)
    assert report.regional_pieces == 0 and report.regional_compiles == 0, report.summary()
    assert any("the first piece failed to compile (RuntimeError: piece compile failed on purpose); the CA graph is "
               "compiled whole" in reason for reason in report.fallbacks), report.fallbacks
    for g, e in zip(got, train(5, "eager", steps=1)[0], strict=True):
        torch.testing.assert_close(g, e)


def test_a_first_piece_failing_accumulates_the_heads_gradients_once(monkeypatch):
    # the head's accumulations (the side Linear's) run after the first compiled piece: when that piece fails to
    # compile, the whole graph runs once on the restored inputs and the head's gradients are eager's
    subclass_ca.reset()
    monkeypatch.setattr(_graph.CompiledCAGraph, "_compile_piece", _failing_compile(1))
    grads = []
    for mode in ("ours", "eager"):
        model = stack(4, mode)
        torch.manual_seed(1)
        side = nn.Linear(16, 16)
        x = torch.randn(4, 16)
        loss = model(x).sin().sum() + side(x).pow(2).sum()
        with subclass_ca.enable() if mode == "ours" else contextlib.nullcontext():
            loss.backward()
        grads.append([side.weight.grad, side.bias.grad])
        if mode == "ours":
            assert subclass_ca.last_report().regional_pieces == 0, subclass_ca.last_report().summary()
    for got, expected in zip(*grads, strict=True):
        torch.testing.assert_close(got, expected)


def test_regional_must_be_a_bool():
    with pytest.raises(ValueError, match="Config.regional must be True or False"):
        subclass_ca.enable(regional="yes")


def train_steps(batches, backend=None, *, change=None):
    """Parameters after one SGD step per batch size in ``batches`` (eager when ``backend`` is None); ``change``: a
    context manager factory entered around the third step's backward."""
    model = stack(5, "eager" if backend is None else "ours")
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for step, batch in enumerate(batches):
        x = torch.randn(batch, 16, generator=torch.Generator().manual_seed(step))
        loss = model(x).sin().sum()
        around = change() if change is not None and step == 2 else contextlib.nullcontext()
        with around, subclass_ca.enable(backend=backend) if backend is not None else contextlib.nullcontext():
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return [inner for p in model.parameters() for inner in _inner(p)]


@contextlib.contextmanager
def _other_thread_count():  # part of the global state Dynamo guards
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "batches, change, runs, entered",
    [
        pytest.param((4, 4, 4), None, 15, 2, id="steady"),
        pytest.param((4, 4, 6, 6), None, 20, 2, id="new-sizes"),
        pytest.param((4, 4, 4, 4), lambda: torch.compiler.set_stance("force_eager"), 15, 2, id="force-eager-stance"),
        pytest.param((4, 4, 4, 4), _other_thread_count, 20, 1, id="new-global-state"),
    ],
)
def test_steady_steps_enter_the_compiled_pieces_directly_unless_sizes_state_or_stance_changed(monkeypatch, batches,
                                                                                              change, runs, entered):
    """From the second step the pieces' compiled frames are entered in Dynamo's run-only mode, without torch.compile's
    wrapper (Note [Regional CA graphs], steady); a step with new sizes or global state goes through the wrapper
    (which compiles what its guards miss), and a step at another stance runs as that stance says.

    ``runs``: the compiled pieces that ran (5 per compiled step: none fell back to plain Python); ``entered``: the
    steps run in run-only mode.
    """
    subclass_ca.reset()
    backend, run_only_steps = CountingBackend(), []
    enter = _compat.enter_run_only
    monkeypatch.setattr(_compat, "enter_run_only", lambda: run_only_steps.append(1) or enter())
    got = train_steps(batches, backend, change=change)
    assert subclass_ca.last_report().regional_pieces == 5, subclass_ca.last_report().summary()
    assert (backend.runs, len(run_only_steps)) == (runs, entered)
    for g, e in zip(got, train_steps(batches), strict=True):
        torch.testing.assert_close(g, e)


def test_a_torch_without_run_only_frames_enters_every_piece_through_the_wrapper(monkeypatch):
    """The optional feature missing (``_compat.OPTIONAL_FEATURES``): every step runs its pieces compiled, as before."""
    subclass_ca.reset()
    backend, run_only_steps = CountingBackend(), []
    monkeypatch.setattr(_compat, "run_only_supported", lambda: False)
    enter = _compat.enter_run_only
    monkeypatch.setattr(_compat, "enter_run_only", lambda: run_only_steps.append(1) or enter())
    got = train_steps((4, 4, 4), backend)
    assert (backend.runs, len(run_only_steps)) == (15, 0)
    for g, e in zip(got, train_steps((4, 4, 4)), strict=True):
        torch.testing.assert_close(g, e)


def test_each_piece_and_the_top_level_generate_their_code_once(monkeypatch):
    """Cutting the graph generates each module's Python code once (``split_module`` alone does it twice per piece:
    0.2-0.3 s of a 64-block cold backward), and the gradients are still eager's.  torch 2.11's ``split_module``
    makes plain GraphModules, which generate their code when made: twice per piece there, as before."""
    from subclass_ca import _regional

    generated: dict[int, int] = {}
    real_recompile = torch.fx.GraphModule.recompile
    cut: list[_regional.RegionalGraph] = []
    real_regional_graph = _regional.regional_graph

    def counted(self: torch.fx.GraphModule):
        generated[id(self)] = generated.get(id(self), 0) + 1
        return real_recompile(self)

    def kept(*args, **kwargs):
        regional = real_regional_graph(*args, **kwargs)
        cut.append(regional)
        return regional

    monkeypatch.setattr(torch.fx.GraphModule, "recompile", counted)
    monkeypatch.setattr(_graph._regional, "regional_graph", kept)
    subclass_ca.reset()
    got, report = train(4, "ours", steps=1)
    assert report.regional_pieces == 4 and cut and cut[0] is not None
    regional = cut[0]
    modules = [regional.top, *(slot._module for slot in regional._slots)]
    pieces = 1 if _compat.split_defers_codegen() else 2
    assert [generated.get(id(module)) for module in modules] == [1] + [pieces] * (len(modules) - 1)
    assert _compat.split_defers_codegen() == (tuple(map(int, torch.__version__.split("+")[0].split(".")[:2])) >= (2, 12))
    for g, e in zip(got, train(4, "eager", steps=1)[0], strict=True):
        torch.testing.assert_close(g, e)
