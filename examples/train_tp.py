"""Tensor-parallel (and sequence-parallel) training with a compiled model and subclass_ca.

Launch (2 processes; gloo on CPU, NCCL with ``--device cuda``)::

    torchrun --standalone --nproc-per-node 2 examples/train_tp.py --steps 5
    torchrun --standalone --nproc-per-node 2 examples/train_tp.py --steps 5 --json tp.json
    python examples/train_tp.py --dense --steps 5 --json dense.json     # single-process reference

The model is a stack of attention-free MLP blocks (RMSNorm -> Linear up -> GELU -> Linear
down, plus a residual), tensor-parallelized with ``parallelize_module`` over a 1-D
DeviceMesh: ``up`` is ``ColwiseParallel``, ``down`` is ``RowwiseParallel``.  The model is
``torch.compile``-d, the loss is computed eagerly on its output, and ``loss.backward()`` runs
under ``subclass_ca.enable()``; SGD updates the sharded ``DTensor`` parameters.  Every rank
sees the same seeded batches, so the losses equal those of ``--dense`` (the same model,
data and seed in one process, plain eager training) up to float rounding.

Modes (``--plan``):

* ``tp`` (default): plain tensor parallel; the model's input and output are ordinary
  replicated tensors, the loss is a plain ``mse_loss``.
* ``sp``: sequence parallel.  Tokens (dim 0 of the ``(tokens, dim)`` input) are sharded
  across ranks: the model input is a ``Shard(0)`` DTensor (``PrepareModuleInput``), the norms
  are ``SequenceParallel(sequence_dim=0)``, ``up`` is ``ColwiseParallel(input_layouts=Shard(0))``
  and ``down`` is ``RowwiseParallel(output_layouts=Shard(0), use_local_output=False)``.  The
  loss is computed eagerly on DTensors: ``(out - DTensor.from_local(target_shard, mesh,
  [Shard(0)])).pow(2).mean().full_tensor()``.  ``--sp-eager-loss`` is short for ``--plan sp``.

Backward (``--backward``): ``subclass_ca`` (default; ``--no-fullgraph`` passes
``enable(fullgraph=False)``), ``stock_ca`` (torch's own compiled autograd with torch's
documented ``fullgraph=True`` compiler, for comparison) or ``eager`` (no compiled autograd).
``--no-compile`` runs the forward eagerly; ``--compiled-loss`` compiles the model and the loss
together.  On rank 0 each step prints ``step <i> loss <value>``; ``--json OUT`` writes rank
0's losses, the capture report and the settings.

What works (torch 2.13, CPU, gloo; see docs/distributed.md): ``tp`` with the default
``enable()``; ``sp`` (eager DTensor loss) needs ``--no-fullgraph``: the eager loss's DTensor
``autograd.Function`` backwards (``full_tensor``/``to_local``, ``from_local``,
``redistribute``) land in the compiled-autograd graph and Dynamo cannot trace them, so the
default raises ``subclass_ca.GraphBreakError``.  ``sp --compiled-loss`` works with the
default.  The same holds for any DTensor conversion that runs eagerly (``tp --no-compile``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

DIM = 16
HIDDEN = 64
TOKENS = 8
BLOCKS = 2
LR = 0.2


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x**2, -1) + eps) * weight`` written out (works on plain tensors and DTensors)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = RMSNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class MLPStack(nn.Module):
    def __init__(self, dim: int = DIM, hidden: int = HIDDEN, blocks: int = BLOCKS) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def build_model(seed: int, device: str) -> MLPStack:
    """The same initial weights on every rank and in ``--dense`` (seeded CPU init, then moved)."""
    torch.manual_seed(seed)
    return MLPStack().to(device)


def batch(seed: int, step: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s full ``(tokens, dim)`` input and target: the same on every rank.

    The target is a fixed "teacher" function of the input, so the loss goes down.
    """
    teacher = torch.randn(DIM, DIM, generator=torch.Generator().manual_seed(seed + 12345)) / DIM**0.5
    x = torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(seed * 1000 + step))
    return x.to(device), torch.tanh(x @ teacher).to(device)


def parallelize(model: MLPStack, mesh: Any, plan: str) -> MLPStack:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    if plan == "tp":
        layout: dict[str, Any] = {}
        for i in range(len(model.blocks)):
            layout[f"blocks.{i}.up"] = ColwiseParallel()
            layout[f"blocks.{i}.down"] = RowwiseParallel()
        return parallelize_module(model, mesh, layout)
    if plan == "sp":
        # the local token shard becomes a Shard(0) DTensor, so the residual adds DTensor + DTensor
        parallelize_module(
            model,
            mesh,
            PrepareModuleInput(input_layouts=Shard(0), desired_input_layouts=Shard(0), use_local_output=False),
        )
        layout = {}
        for i in range(len(model.blocks)):
            layout[f"blocks.{i}.norm"] = SequenceParallel(sequence_dim=0)
            layout[f"blocks.{i}.up"] = ColwiseParallel(input_layouts=Shard(0))
            layout[f"blocks.{i}.down"] = RowwiseParallel(output_layouts=Shard(0), use_local_output=False)
        return parallelize_module(model, mesh, layout)
    raise ValueError(f"unknown plan {plan!r}")


def backward_context(args: argparse.Namespace) -> Any:
    import contextlib

    if args.backward == "subclass_ca":
        import subclass_ca

        return subclass_ca.enable(backend=args.backend, fullgraph=args.fullgraph)
    if args.backward == "stock_ca":
        compiler = lambda gm: torch.compile(gm, backend=args.backend, fullgraph=args.fullgraph)  # noqa: E731
        return torch._dynamo.compiled_autograd._enable(compiler)
    return contextlib.nullcontext()


@dataclasses.dataclass
class Run:
    """One rank's training state (see :func:`setup`)."""

    mesh: Any
    model: MLPStack
    step_loss: Any
    """``(x, target) -> loss`` for this rank's inputs (see :func:`rank_inputs`)."""
    opt: torch.optim.Optimizer


def loss_of(plan: str, mesh: Any, forward: Any, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The loss of one batch: a plain ``mse_loss`` (tp), or the DTensor loss on token shards (sp)."""
    if plan == "sp":
        from torch.distributed.tensor import DTensor, Shard

        out = forward(x)  # a Shard(0) DTensor
        target_dt = DTensor.from_local(target, mesh, [Shard(0)], run_check=False)
        return (out - target_dt).pow(2).mean().full_tensor()
    return F.mse_loss(forward(x), target)


def setup(args: argparse.Namespace) -> Run:
    """Mesh, parallelized model, compiled forward (or forward + loss) and optimizer.

    torch.distributed must be initialised.  By default only the model is compiled and the
    loss runs eagerly after it; ``--compiled-loss`` compiles the model and the loss together.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(args.device, (dist.get_world_size(),))
    model = parallelize(build_model(args.seed, args.device), mesh, args.plan)
    forward = torch.compile(model, backend=args.backend) if args.compile and not args.compiled_loss else model

    def step_loss(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss_of(args.plan, mesh, forward, x, target)

    if args.compiled_loss:
        step_loss = torch.compile(step_loss, backend=args.backend)
    return Run(mesh, model, step_loss, torch.optim.SGD(model.parameters(), lr=args.lr))


def rank_inputs(args: argparse.Namespace, mesh: Any, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's input and target: the whole batch (tp) or its token shard (sp)."""
    x, target = batch(args.seed, step, args.device)
    if args.plan == "sp":
        rank, world_size = mesh.get_local_rank(), mesh.size()
        return x.chunk(world_size)[rank], target.chunk(world_size)[rank]
    return x, target


def train_step(args: argparse.Namespace, run: Run, step: int) -> torch.Tensor:
    """Forward and loss, ``loss.backward()`` (under the caller's ``enable()`` block), SGD step."""
    run.opt.zero_grad(set_to_none=True)
    loss = run.step_loss(*rank_inputs(args, run.mesh, step))
    loss.backward()
    run.opt.step()
    return loss.detach()


def _short(reason: str) -> str:
    """Dynamo's graph-break reason in one line: its first line and its ``Explanation:`` line."""
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    explanation = next((line for line in lines[1:] if line.startswith("Explanation:")), "")
    return f"{lines[0]} ({explanation})" if explanation else lines[0] if lines else reason


def train(args: argparse.Namespace, run: Run | None = None) -> dict[str, Any]:
    """The per-rank loop; torch.distributed must be initialised.  Returns this rank's losses."""
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    run = run or setup(args)
    losses: list[float] = []
    times: list[float] = []
    with backward_context(args):  # one block around the loop (entering it per step costs more)
        for step in range(args.steps):
            start = time.perf_counter()
            losses.append(train_step(args, run, step).item())
            times.append(time.perf_counter() - start)
            if rank == 0:
                print(f"step {step} loss {losses[-1]:.6f}", flush=True)
    result: dict[str, Any] = {"rank": rank, "world_size": world_size, "losses": losses, "step_times_s": times}
    if args.backward == "subclass_ca":
        import subclass_ca

        report = subclass_ca.last_report()
        if report is not None:
            result["report"] = {
                "fullgraph": report.fullgraph,
                "graph_breaks": [_short(reason) for reason in report.graph_breaks],
                "fallbacks": list(report.fallbacks),
                "dtensor_nodes": report.nodes_for("DTensor"),
            }
    return result


def train_dense(args: argparse.Namespace) -> dict[str, Any]:
    """The single-process reference: same model, data and seed, plain eager training."""
    model = build_model(args.seed, args.device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    losses: list[float] = []
    for step in range(args.steps):
        x, target = batch(args.seed, step, args.device)
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        print(f"step {step} loss {losses[-1]:.6f}", flush=True)
    return {"rank": 0, "world_size": 1, "losses": losses}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--backend", default="aot_eager", help="torch.compile backend of the model and the CA graph")
    parser.add_argument("--json", metavar="OUT", help="write rank 0's per-step losses (and the settings) here")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=LR)
    parser.add_argument("--dense", action="store_true", help="single process, no torch.distributed, plain eager (the reference)")
    parser.add_argument("--plan", choices=("tp", "sp"), default="tp", help="tp: tensor parallel; sp: sequence parallel with a DTensor loss (eager unless --compiled-loss)")
    parser.add_argument("--sp-eager-loss", action="store_true", help="same as --plan sp")
    parser.add_argument("--backward", choices=("subclass_ca", "stock_ca", "eager"), default="subclass_ca")
    parser.add_argument("--no-fullgraph", dest="fullgraph", action="store_false", help="compile the CA graph with fullgraph=False")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="run the model's forward eagerly")
    parser.add_argument("--compiled-loss", action="store_true", help="torch.compile the model and the loss together")
    parser.add_argument("--timeout-s", type=float, default=120, help="process-group timeout (a dead peer fails instead of hanging)")
    args = parser.parse_args(argv)
    if args.sp_eager_loss:
        args.plan = "sp"
    if args.compiled_loss and not args.compile:
        parser.error("--compiled-loss and --no-compile exclude each other")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dense:
        result = train_dense(args)
    else:
        import torch.distributed as dist

        if "RANK" not in os.environ:
            sys.exit("not launched by torchrun (no RANK in the environment); use torchrun or --dense")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if args.device == "cuda":
            torch.cuda.set_device(local_rank)
            dist.init_process_group("nccl", timeout=timedelta(seconds=args.timeout_s), device_id=torch.device("cuda", local_rank))
        else:
            dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout_s))
        try:
            result = train(args)
        finally:
            dist.destroy_process_group()
        result["rendezvous"] = {name: os.environ.get(name) for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE")}
    if args.json and result["rank"] == 0:
        settings = {k: v for k, v in vars(args).items() if k != "json"}
        with open(args.json, "w") as f:
            json.dump({**result, "settings": settings, "torch": torch.__version__}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
