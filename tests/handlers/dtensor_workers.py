"""Worker functions for the 2-process DTensor tests (module level: picklable for spawn)."""

from __future__ import annotations

import torch


def dense_problem(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(8, 8, generator=generator),
        "b": torch.randn(8, generator=generator),
        "x": torch.randn(6, 8, generator=generator),
    }


def loss_fn(x, w, b):
    return ((x @ w).tanh() + b).pow(2).sum()


def dense_reference(seed: int = 0) -> dict[str, torch.Tensor]:
    problem = dense_problem(seed)
    w = torch.nn.Parameter(problem["w"].clone())
    b = torch.nn.Parameter(problem["b"].clone())
    loss_fn(problem["x"], w, b).backward()
    return {"w": w.grad, "b": b.grad}


def dtensor_grads_under_subclass_ca(rank: int, world_size: int, seed: int) -> dict[str, object]:
    """Shard(0) weight + Replicate bias on a 2-rank mesh; backward under subclass_ca.enable()."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    import subclass_ca

    mesh = init_device_mesh("cpu", (world_size,))
    problem = dense_problem(seed)
    w = torch.nn.Parameter(distribute_tensor(problem["w"], mesh, [Shard(0)]))
    b = torch.nn.Parameter(distribute_tensor(problem["b"], mesh, [Replicate()]))
    x = distribute_tensor(problem["x"], mesh, [Replicate()])
    eager_w = torch.nn.Parameter(distribute_tensor(problem["w"], mesh, [Shard(0)]))
    eager_b = torch.nn.Parameter(distribute_tensor(problem["b"], mesh, [Replicate()]))
    loss_fn(x, eager_w, eager_b).backward()
    loss = torch.compile(loss_fn, backend="aot_eager")(x, w, b)
    with subclass_ca.enable():
        loss.backward()
    report = subclass_ca.last_report()
    return {
        "w": w.grad.full_tensor(),
        "b": b.grad.full_tensor(),
        "w_type": type(w.grad).__name__,
        "w_placements": [str(p) for p in w.grad.placements],
        "eager_w_placements": [str(p) for p in eager_w.grad.placements],
        "b_placements": [str(p) for p in b.grad.placements],
        "eager_b_placements": [str(p) for p in eager_b.grad.placements],
        "local_w": w.grad.to_local(),
        "eager_local_w": eager_w.grad.to_local(),
        "local_w_shape": tuple(w.grad.to_local().shape),
        "dtensor_nodes": report.nodes_for("DTensor"),
        "is_dtensor": isinstance(w.grad, DTensor) and isinstance(b.grad, DTensor),
    }
