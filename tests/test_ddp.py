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


def test_ddp_trains_under_enable_like_data_parallel_by_hand_whatever_optimize_ddp_says():
    """Every case of ``ddp_workers.CASES``: default / False / "ddp_optimizer" / "python_reducer", a compiled
    forward or a compiled train step (flag style), ``no_sync()`` accumulation, ``find_unused_parameters``."""
    expected = run_workers(ddp_workers.train_all, 2, timeout_s=300, args=("manual",))
    got = run_workers(ddp_workers.train_all, 2, timeout_s=300, args=("ours",))
    for rank in range(2):
        assert got[rank].keys() == expected[rank].keys()
        for case in expected[rank]:
            for g, e in zip(got[rank][case], expected[rank][case], strict=True):
                torch.testing.assert_close(g, e, rtol=0, atol=0, msg=lambda m, case=case: f"rank {rank}, {case}: {m}")


def test_the_hand_reference_is_eager_ddp_for_plain_parameters():
    cases = [("plain", "default", "no_sync"), ("plain", "default", "forward")]
    manual = run_workers(ddp_workers.train_all, 2, timeout_s=300, args=("manual", cases))
    eager = run_workers(ddp_workers.train_all, 2, timeout_s=300, args=("eager", cases))
    for rank in range(2):
        for case in manual[rank]:
            for g, e in zip(manual[rank][case], eager[rank][case], strict=True):
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
