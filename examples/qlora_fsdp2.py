"""QLoRA fine-tuning under FSDP2 with a compiled model and subclass_ca (torchrun).

Launch (2 processes; gloo on CPU, NCCL with ``--device cuda``, one GPU per process)::

    torchrun --standalone --nproc-per-node 2 examples/qlora_fsdp2.py
    torchrun --standalone --nproc-per-node 2 examples/qlora_fsdp2.py --backend aot_eager --steps 5 --check
    torchrun --standalone --nproc-per-node 2 examples/qlora_fsdp2.py --device cuda --check

Needs torchao (``pip install torchao``).  The model, data and optimizer are those of
``examples/qlora.py`` (imported from the same folder: keep both files together): transformer
blocks whose projections are a frozen 4-bit NF4 base weight (``requires_grad=False``) plus
trainable fp32 LoRA adapters, trained with AdamW.  Here the model is sharded with FSDP2:
``fully_shard`` on every block, then on the root module.  Every parameter, the frozen NF4
weights included, becomes a ``DTensor`` sharded on dim 0; an NF4 weight's local shard is an
``NF4Tensor`` (torchao implements FSDP2's all-gather extension for it, so the forward
all-gathers the 4-bit data, not a dequantized copy).  Each rank trains on its own batches;
FSDP2 averages the adapter gradients across ranks.  The forward is
``torch.compile(model, backend=...)``; ``loss.backward()`` runs inside
``subclass_ca.enable(backend=...)`` (nothing FSDP-specific to pass; see docs/distributed.md).

``--check`` trains the same model a second time under eager FSDP2 (same initial weights,
same per-rank batches, eager forward and backward) and compares every rank's per-step losses
and the final (gathered) adapters with ``torch.testing.assert_close``; every rank exits with
status 1 on a mismatch.  It also checks that the frozen NF4 shards got no gradient and did
not change, and that every adapter gradient was a DTensor over a plain local tensor.

What subclass_ca's NF4 handler does and does not do here
--------------------------------------------------------
* A frozen NF4 weight gets **no gradient**: it has ``requires_grad=False`` and
  ``linear_nf4``'s backward returns ``None`` for it, so FSDP2 reduce-scatters only the adapter
  gradients (sharded ``DTensor``s of plain fp32 tensors).
* The backward graph contains no subclass construction at all (the capture report shows 0
  ``NF4Tensor`` nodes, ``--check`` asserts it, and no other subclass node either): FSDP2
  all-gathers each NF4 weight back into a whole ``NF4Tensor`` before the block runs, the
  compiled backward computes plain adapter gradients, and FSDP2's post-backward hooks
  reduce-scatter them into sharded ``DTensor`` gradients.  What subclass_ca adds under FSDP2
  is running those hooks correctly inside the captured backward (on torch 2.13 with a graph
  break at each hook, ``fullgraph=False``: the report says so; stock compiled autograd gets
  FSDP2 wrong there, see docs/distributed.md).
* subclass_ca's ``NF4Tensor`` handler (``subclass_ca._builtin_handlers.torchao``, registered lazily)
  is used only if the backward epilogue had to build an NF4-typed gradient; QLoRA never does,
  and this script does not exercise it.  It does not train NF4 weights, and it does not
  change torchao's numerics or FSDP2's all-gather of the NF4 shards.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import qlora


def shard(model: qlora.QLoRAModel) -> qlora.QLoRAModel:
    """``fully_shard`` every block, then the root (which holds the final norm)."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def check(args: argparse.Namespace, model: nn.Module, result: dict[str, Any], initial: dict[str, torch.Tensor], rank: int) -> int:
    """Train the eager FSDP2 reference and compare; the same exit status on every rank."""
    import torch.distributed as dist

    if rank == 0:
        print("check: training the same model under eager FSDP2", flush=True)
    eager_model = shard(qlora.build_model(args.seed, args.device))
    dist.barrier()
    expected = qlora.train(eager_model, args, compiled=False, rank=rank)
    problems = qlora.compare(result, expected, model, eager_model, args, grad_types=frozenset({"DTensor[Tensor]"}))
    problems += qlora.frozen_unchanged(model, initial)
    failed = torch.tensor([1.0 if problems else 0.0], device=args.device)
    dist.all_reduce(failed)  # every rank agrees on the outcome
    if problems:
        print(f"rank {rank}: check FAILED:\n  " + "\n  ".join(problems), file=sys.stderr, flush=True)
    if failed.item():
        return 1
    if rank == 0:
        print(f"check passed: {args.steps} losses on every rank and {len(qlora.lora_parameters(model))} "
              f"sharded adapters match eager FSDP2 ({args.backend})", flush=True)
    return 0


def run(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = shard(qlora.build_model(args.seed, args.device))
    initial = {name: qlora._quantized_data(p) for name, p in qlora.nf4_weights(model).items()}
    if not initial:
        raise RuntimeError("no NF4 shard found after fully_shard")
    result = qlora.train(model, args, compiled=True, rank=rank)  # this rank's batches; FSDP2 reduces the grads
    if rank == 0:
        print(f"world size {world_size}; {len(initial)} frozen NF4 weights sharded as DTensor[NF4Tensor]; "
              f"adapter grads {sorted(result['grad_types'])}; NF4 nodes in the backward graph: {result['nf4_nodes']}",
              flush=True)
        report = result["report"]
        print(f"backward capture: fullgraph={report.fullgraph}, {report.total_subclass_nodes} subclass nodes, "
              f"{len(report.graph_breaks)} graph break(s)", flush=True)
    return check(args, model, result, initial, rank) if args.check else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = qlora.parse_args(argv)  # --backend --steps --device --seed --lr --check
    args.timeout_s = float(os.environ.get("QLORA_PG_TIMEOUT_S", "120"))
    return args


def main(argv: list[str] | None = None) -> int:
    import torch.distributed as dist

    args = parse_args(argv)
    if "RANK" not in os.environ:
        sys.exit("not launched by torchrun (no RANK in the environment); see the usage at the top of this file")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", timeout=timedelta(seconds=args.timeout_s), device_id=torch.device("cuda", local_rank))
    else:
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout_s))
    try:
        return run(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
