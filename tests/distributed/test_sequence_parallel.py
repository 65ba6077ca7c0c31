"""Sequence parallel with an eager DTensor loss (issue 17, item 1), 2 processes, gloo, 127.0.0.1.

``parallelize_module`` with ``ColwiseParallel(input_layouts=Shard(0))`` /
``RowwiseParallel(output_layouts=Shard(0), use_local_output=False)`` (plus
``SequenceParallel`` norms), the model compiled, the loss computed eagerly on DTensors
(``(out - DTensor.from_local(target)).pow(2).mean().full_tensor()``).  The eager loss puts
DTensor's own ``autograd.Function`` backwards (``full_tensor``/``to_local``, ``redistribute``,
``from_local``) into the compiled-autograd graph, and Dynamo refuses to trace them
(torch 2.13: ``torch._C._DTensor_compute_global_tensor_info`` is a C builtin; 2.14 and 2.15
first stop at a ``DTensorSpec`` the sourceless builder cannot wrap).  So:

* ``subclass_ca.enable(fullgraph=False)`` trains == eager sequence parallel (bitwise) and ==
  a dense single-process run (float tolerance); Dynamo graph-breaks around those functions;
* the default ``enable()`` (``fullgraph=True``) raises ``subclass_ca.GraphBreakError``
  (chained to Dynamo's ``Unsupported``) telling the user to pass ``fullgraph=False``, before
  any gradient or parameter update;
* stock compiled autograd with torch's documented ``fullgraph=True`` compiler fails the same
  way with Dynamo's raw ``Unsupported``;
* compiling the loss together with the model (nothing DTensor-specific runs eagerly) trains
  == eager with the default ``enable()`` (fullgraph, no graph break).

All modes run in one pair of processes (``sp_workers.sequence_parallel_modes``), once per module.
"""

from __future__ import annotations

import pytest
import torch

from subclass_ca.distributed import run_workers
from tests.distributed import _example, sp_workers

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available"),
]

STEPS = 3


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(sp_workers.sequence_parallel_modes, 2, timeout_s=180, args=(STEPS, "aot_eager"))


@pytest.fixture(scope="module")
def dense_losses() -> torch.Tensor:
    example = _example.load()
    args = example.parse_args(["--dense", "--steps", str(STEPS)])
    return torch.tensor(example.train_dense(args)["losses"], dtype=torch.float64)


def _losses(mode_result: dict) -> torch.Tensor:
    return torch.tensor(mode_result["losses"], dtype=torch.float64)


def test_fullgraph_false_trains_like_eager_sequence_parallel(results):
    for rank, result in enumerate(results):
        eager, ours = result["eager"], result["no_fullgraph"]
        assert ours["losses"] == eager["losses"], f"rank {rank}"  # bitwise
        assert ours["grad_placements"] == eager["grad_placements"], f"rank {rank}"
        assert all(kind == "DTensor" for kind, _ in ours["grad_placements"].values())
        for name, want in eager["params"].items():
            torch.testing.assert_close(ours["params"][name], want, rtol=0, atol=0, msg=f"rank {rank} param {name}")
        for name, want in eager["grads"].items():
            torch.testing.assert_close(ours["grads"][name], want, rtol=0, atol=0, msg=f"rank {rank} grad {name}")


def test_fullgraph_false_matches_dense_single_process(results, dense_losses):
    assert dense_losses[-1] < dense_losses[0]
    for result in results:
        torch.testing.assert_close(_losses(result["no_fullgraph"]), dense_losses, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(_losses(result["eager"]), dense_losses, rtol=1e-6, atol=1e-6)


def test_fullgraph_false_report_lists_the_dtensor_graph_breaks(results):
    for result in results:
        report = result["no_fullgraph"]["report"]
        assert report["fullgraph"] is False and report["dtensor_nodes"] > 0, report
        # the reasons differ between torch releases (2.13: the C builtin _DTensor_compute_global_tensor_info
        # first; 2.14/2.15: DTensorSpec in the sourceless builder first); each names DTensor
        assert any("DTensor" in reason for reason in report["graph_breaks"]), report


def test_default_fullgraph_raises_graph_break_error_before_any_update(results):
    for rank, result in enumerate(results):
        default = result["default"]
        error = default["error"]
        assert error is not None, f"rank {rank}: the default enable() trained without a graph break"
        assert error["type"] == "GraphBreakError", error
        assert "fullgraph=False" in error["message"] and "No gradient was produced" in error["message"], error
        assert error["cause_type"] == "torch._dynamo.exc.Unsupported", error
        assert "DTensor" in error["cause_message"], error["cause_message"]
        assert default["grads_none"] and default["params_untouched"]


def test_stock_compiled_autograd_fullgraph_fails_with_dynamo_unsupported(results):
    for result in results:
        error = result["stock_fullgraph"]["error"]
        assert error is not None and error["type"] == "Unsupported", error
        assert "DTensor" in error["message"], error["message"]


def test_loss_compiled_with_the_model_works_with_the_default_fullgraph(results, dense_losses):
    for rank, result in enumerate(results):
        eager, ours = result["eager"], result["compiled_loss"]
        report = ours["report"]
        assert report["fullgraph"] is True and report["graph_breaks"] == [] and report["dtensor_nodes"] > 0, report
        assert ours["grad_placements"] == eager["grad_placements"], f"rank {rank}"
        for name, want in eager["params"].items():
            torch.testing.assert_close(ours["params"][name], want, rtol=0, atol=0, msg=f"rank {rank} param {name}")
        torch.testing.assert_close(_losses(ours), dense_losses, rtol=1e-6, atol=1e-6)
