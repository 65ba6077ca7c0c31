"""Built-in DTensor handler: world_size 1 in-process, CPU (gloo) and CUDA (NCCL) meshes (world_size 2 lives in test_dtensor_multiprocess.py)."""

from __future__ import annotations

import pytest
import torch

import subclass_ca
from tests.helpers import assert_same_grad

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor  # noqa: E402


@pytest.fixture(scope="module")
def process_group():
    from tests.distributed_utils import single_process_group

    with single_process_group():
        yield


@pytest.fixture
def mesh(process_group, device):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device, (1,))


@pytest.mark.parametrize("placement", [Shard(0), Replicate()], ids=["shard0", "replicate"])
def test_dtensor_param_grad_matches_dense_reference(mesh, placement, device):
    torch.manual_seed(0)
    dense_w, dense_b, x = (t.to(device) for t in (torch.randn(8, 8), torch.randn(8), torch.randn(4, 8)))
    reference_w = torch.nn.Parameter(dense_w.clone())
    reference_b = torch.nn.Parameter(dense_b.clone())
    ((x @ reference_w).tanh() + reference_b).pow(2).sum().backward()

    w = torch.nn.Parameter(distribute_tensor(dense_w.clone(), mesh, [placement]))
    b = torch.nn.Parameter(distribute_tensor(dense_b.clone(), mesh, [Replicate()]))
    x_d = distribute_tensor(x, mesh, [Replicate()])
    loss = torch.compile(lambda x: ((x @ w).tanh() + b).pow(2).sum(), backend="aot_eager")(x_d)
    with subclass_ca.enable():
        loss.backward()
    assert isinstance(w.grad, DTensor)
    torch.testing.assert_close(w.grad.full_tensor(), reference_w.grad)
    torch.testing.assert_close(b.grad.full_tensor(), reference_b.grad)
    report = subclass_ca.last_report()
    assert report.nodes_for("DTensor", "proxy") >= 2


def test_dtensor_grad_matches_eager_dtensor(mesh, device):
    torch.manual_seed(0)
    dense_w, x = torch.randn(6, 6).to(device), torch.randn(3, 6).to(device)
    eager_w = torch.nn.Parameter(distribute_tensor(dense_w.clone(), mesh, [Shard(0)]))
    x_d = distribute_tensor(x, mesh, [Replicate()])
    (x_d @ eager_w).sin().sum().backward()
    ca_w = torch.nn.Parameter(distribute_tensor(dense_w.clone(), mesh, [Shard(0)]))
    loss = torch.compile(lambda x: (x @ ca_w).sin().sum(), backend="aot_eager")(x_d)
    with subclass_ca.enable():
        loss.backward()
    assert_same_grad(eager_w.grad, ca_w.grad)
    assert ca_w.grad.device_mesh == eager_w.grad.device_mesh
    assert ca_w.grad.placements == eager_w.grad.placements


def test_dtensor_handler_key_distinguishes_placements(mesh, device):
    from subclass_ca._builtin_handlers.dtensor import dtensor_metadata_key

    dense = torch.randn(4, 4, device=device)
    sharded = distribute_tensor(dense, mesh, [Shard(0)])
    replicated = distribute_tensor(dense, mesh, [Replicate()])
    key_sharded = dtensor_metadata_key(sharded.__tensor_flatten__()[1])
    key_replicated = dtensor_metadata_key(replicated.__tensor_flatten__()[1])
    assert key_sharded != key_replicated
    assert key_sharded == dtensor_metadata_key(distribute_tensor(dense * 2, mesh, [Shard(0)]).__tensor_flatten__()[1])
    hash(key_sharded)
