"""The kit on torch's DTensor (world_size 1: a 1-rank gloo group in this process, no ports)."""

from __future__ import annotations

import pytest
import torch

from subclass_ca.testing import SCENARIOS, check_subclass
from subclass_ca.testing.specs import DTENSOR_KNOWN_FAILURES, dtensor_spec


@pytest.fixture(scope="module")
def one_rank_mesh():
    """A DeviceMesh over a 1-rank gloo group; skips cleanly where distributed is unavailable."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this build")
    from torch.distributed.device_mesh import init_device_mesh

    created = False
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        created = True
    elif dist.get_world_size() != 1:
        pytest.skip(f"a {dist.get_world_size()}-rank process group is already initialized in this process")
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        if created:
            dist.destroy_process_group()


@pytest.mark.isolated(reason="torch 2.12 under xdist (CI, twice): every non-scalar scenario failed AOT's partition "
                              "('Node tangents_2 was invalid, but is output') after some earlier test in the worker; "
                              "the file alone, and the whole lane suite serially, pass")
def test_dtensor_passes_the_battery_except_its_documented_torch_limitation(one_rank_mesh):
    report = check_subclass(dtensor_spec(one_rank_mesh), name="DTensor")
    report.raise_for_failures()
    needs_spec_parts = {"module_swap", "optimizer_state"}  # need make_module / make_optimizer, which this spec has not
    assert all("the spec has no make_" in report.get(name).reason for name in needs_spec_parts)
    skipped = {r.scenario: r.reason for r in report.skipped if r.scenario not in needs_spec_parts}
    assert set(skipped) <= set(DTENSOR_KNOWN_FAILURES) | {"hook_intermediate"}
    for reason in skipped.values():
        assert reason.startswith("known failure ("), reason
    assert {r.scenario for r in report.passed} >= set(SCENARIOS) - set(skipped) - needs_spec_parts
    assert report.get("metadata_change").status == "pass"  # Replicate -> Shard(0) recompiles
    assert report.get("param_grad").subclass_nodes >= 1


def test_dtensor_known_failure_also_fails_under_stock_compiled_autograd(one_rank_mesh):
    """The dynamic_batch entry of DTENSOR_KNOWN_FAILURES is torch's, not ours: remove it once this fails."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    def make(dense):
        return distribute_tensor(dense, one_rank_mesh, [Replicate()])

    def compiler_fn(graph_module):
        return torch.compile(graph_module, backend="aot_eager", fullgraph=True)

    step = torch.compile(lambda x, w: torch.tanh(x @ w), backend="aot_eager")
    w = make(torch.randn(4, 4)).requires_grad_()
    errors = []
    for batch in (3, 5, 2):
        x = make(torch.randn(batch, 4)).requires_grad_()
        out = step(x, w)
        try:
            with torch._dynamo.compiled_autograd._enable(compiler_fn):
                out.backward(make(torch.randn(batch, 4)))
        except Exception as error:  # noqa: BLE001
            errors.append(error)
        w.grad = None
    assert errors, "stock compiled autograd now handles DTensor batch changes: drop dynamic_batch from DTENSOR_KNOWN_FAILURES"
