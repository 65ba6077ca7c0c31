"""Backward memory: our make_subclass nodes keep fewer gradients alive than stock ones.

Structural property of the captured CA graph (see Note [Why the epilogue holds memory] in
``tools/bench/memory.py``): stock feeds every flat backward output to every
``make_subclass`` node; ours passes each node only its own inner tensors.
"""

from __future__ import annotations

import pytest
import torch

from subclass_ca import _compat, _runtime
from subclass_ca.testing.subclasses import PairTensor, make_pair
from tools.bench import memory as _bench_memory

N_SUBCLASS_PARAMS = 4
ENTERS = {"stock": _compat.enable_compiled_autograd, "ours": _runtime.capture_with}


def _params(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    pairs = [torch.nn.Parameter(make_pair(torch.randn(16, 16, generator=gen))) for _ in range(N_SUBCLASS_PARAMS)]
    return [*pairs, torch.nn.Parameter(torch.randn(16, generator=gen))]


def _loss(params: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    *weights, bias = params
    h = x
    for w in weights:
        h = torch.tanh(h @ w)
    return (h + bias).sum()


def _measure(kind: str) -> tuple[_bench_memory.Liveness, list[torch.Tensor]]:
    params = _params()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    forward = torch.compile(_loss, backend="aot_eager")

    def step() -> None:
        loss = forward(params, x)
        loss.backward()  # a PairTensor scalar: its tangent is a PairTensor of ones

    with ENTERS[kind](_compat.stock_ca_compiler("aot_eager")):
        step()  # first backward creates the .grads; the measured one accumulates into them
    liveness = _bench_memory.ca_graph_liveness(step, ENTERS[kind])
    return liveness, [p.grad for p in params]


def _eager_grads() -> list[torch.Tensor]:
    params = _params()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        _loss(params, x).backward()
    return [p.grad for p in params]


def _assert_same_grads(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for got, want in zip(actual, expected, strict=True):
        assert type(got) is type(want)
        if isinstance(want, PairTensor):
            torch.testing.assert_close(got.a, want.a)
            torch.testing.assert_close(got.b, want.b)
        else:
            torch.testing.assert_close(got, want)


@pytest.fixture(scope="module")
def measured() -> dict[str, tuple[_bench_memory.Liveness, list[torch.Tensor]]]:
    return {kind: _measure(kind) for kind in ENTERS}


def test_liveness_run_computes_the_same_gradients_as_eager(measured):
    expected = _eager_grads()
    for _, grads in measured.values():
        _assert_same_grads(grads, expected)


def test_both_graphs_rebuild_the_same_subclass_gradients(measured):
    ours, stock = measured["ours"][0], measured["stock"][0]
    # one per PairTensor weight, plus the plain bias, whose gradient through a PairTensor output is a pair
    assert ours.make_subclass_nodes == stock.make_subclass_nodes == N_SUBCLASS_PARAMS + 1


def test_our_nodes_take_only_their_own_inner_tensors(measured):
    ours, stock = measured["ours"][0], measured["stock"][0]
    assert ours.make_subclass_args == 2 * ours.make_subclass_nodes  # PairTensor: two inner tensors each
    assert stock.make_subclass_args > ours.make_subclass_args


def test_our_backward_peak_is_at_most_stock(measured):
    ours, stock = measured["ours"][0], measured["stock"][0]
    assert ours.peak_bytes > 0
    assert ours.peak_bytes <= stock.peak_bytes


def test_our_epilogue_keeps_fewer_bytes_alive_than_stock(measured):
    ours, stock = measured["ours"][0], measured["stock"][0]
    assert ours.epilogue_mean_bytes < stock.epilogue_mean_bytes


def test_graph_liveness_counts_a_view_once_and_frees_after_last_use():
    def f(x: torch.Tensor) -> torch.Tensor:
        a = x + 1  # 64 floats
        b = a.t()  # view of a: same storage
        c = b * 2  # new storage; a dies here
        return c.sum()

    gm = torch.fx.symbolic_trace(f)
    _, liveness = _bench_memory.graph_liveness(gm, torch.ones(8, 8))
    # a (256 B) and c (256 B) overlap at the mul; the input is excluded; sum adds 4 B after a died
    assert liveness.peak_bytes == 512
    assert liveness.make_subclass_nodes == 0


def test_ca_graph_liveness_without_a_capture_raises_naming_the_step():
    with pytest.raises(RuntimeError, match="did not capture a compiled-autograd graph"):
        _bench_memory.ca_graph_liveness(lambda: None, ENTERS["ours"])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_backward_peak_memory_ours_at_most_stock():
    peaks = {}
    for kind, enter in ENTERS.items():
        torch._dynamo.reset()
        _compat.reset_compiled_autograd()
        params = [p.detach().cuda().requires_grad_() for p in _params()]
        x = torch.randn(8, 16, device="cuda")
        forward = torch.compile(_loss, backend="aot_eager")
        with enter(_compat.stock_ca_compiler("aot_eager")):
            for _ in range(2):
                loss = forward(params, x)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                loss.backward()
                torch.cuda.synchronize()
                peaks[kind] = torch.cuda.max_memory_allocated() - base
    assert peaks["ours"] <= peaks["stock"]
