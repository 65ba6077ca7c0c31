"""DDP trains under ``enable()`` as without it, whatever ``optimize_ddp`` says (issue 46; Note [DDP under compiled autograd]).

Two gloo ranks; parameters after three SGD steps equal, bitwise (aot_eager), on every rank, those of data parallel
by definition: each rank's gradients (every inner tensor of a subclass gradient) divided by the world size and
all-reduced by hand.  For plain parameters that is eager DDP's result bitwise (checked below); for TwoTensor
parameters eager DDP's C++ reducer averages wrong (torch's bucket copy; seen on 2.13), so the hand reference is
the one to meet.
"""

from __future__ import annotations

import pytest
import torch

from subclass_ca import _compat
from subclass_ca.distributed import run_workers
from tests import ddp_workers

pytestmark = [pytest.mark.distributed, pytest.mark.skipif(ddp_workers.TwoTensor is None, reason="no TwoTensor")]


def _run(kind, mode, optimize_ddp, style):
    return run_workers(ddp_workers.train, 2, timeout_s=240, args=(kind, mode, optimize_ddp, style))


@pytest.mark.parametrize(
    ("kind", "optimize_ddp", "style"),
    [
        ("two_tensor", "default", "forward"),
        ("two_tensor", False, "forward"),
        ("two_tensor", "ddp_optimizer", "step"),
        ("two_tensor", "python_reducer", "forward"),
        ("plain", "default", "no_sync"),
        ("unused", "default", "forward"),
    ],
)
def test_ddp_trains_under_enable_like_data_parallel_by_hand(kind, optimize_ddp, style):
    eager = _run(kind, "manual", optimize_ddp, style if style == "no_sync" else "forward")
    ours = _run(kind, "ours", optimize_ddp, style)
    for rank, (got, expected) in enumerate(zip(ours, eager, strict=True)):
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e, rtol=0, atol=0, msg=lambda m: f"rank {rank}: {m}")


def test_the_hand_reference_is_eager_ddp_for_plain_parameters():
    for got, expected in zip(_run("plain", "manual", "default", "no_sync"), _run("plain", "eager", "default", "no_sync"), strict=True):
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_a_ddp_module_gets_its_cpp_reducer_back_outside_the_block_and_a_static_graph_is_refused():
    import subclass_ca
    from subclass_ca.errors import SubclassCAError
    from tests.distributed_utils import single_process_group

    with single_process_group():
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
        forward = torch.compile(ddp, backend="aot_eager")
        with subclass_ca.enable():
            forward(torch.randn(2, 4)).sum().backward()
            assert ddp._use_python_reducer
        reducer = ddp.reducer
        ddp(torch.randn(2, 4)).sum().backward()  # outside: torch's own DDP again
        assert not ddp._use_python_reducer and ddp.reducer is not reducer and not ddp._accum_grad_hooks

        static = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4), static_graph=True)
        with pytest.raises(SubclassCAError, match="static_graph=True"), subclass_ca.enable():
            static(torch.randn(2, 4)).sum().backward()
