"""QLoRA fine-tuning under DistributedDataParallel with a compiled model and subclass_ca (torchrun).

Launch (2 processes; gloo on CPU, NCCL with ``--device cuda``, one GPU per process)::

    torchrun --standalone --nproc-per-node 2 examples/qlora_ddp.py
    torchrun --standalone --nproc-per-node 2 examples/qlora_ddp.py --backend aot_eager --steps 3 --check

Needs torchao.  The model, data and optimizer are those of ``examples/qlora.py`` (keep both files
together); here the model is wrapped in ``DistributedDataParallel`` and compiled, and each step's
forward and ``loss.backward()`` run inside ``subclass_ca.enable()``.  No ``optimize_ddp`` flag is
set: inside the block subclass_ca moves the DDP module to torch's Python reducer, whose all-reduce
compiled autograd captures, and gives it its C++ reducer back outside (docs/distributed.md, "DDP").

``--check`` trains the same model again under eager DDP (same initial weights, same per-rank batches)
and compares every rank's losses and the final adapters with ``torch.testing.assert_close``; every
rank exits with status 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta

import torch
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import qlora


def wrap(model: qlora.QLoRAModel, args: argparse.Namespace) -> DistributedDataParallel:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return DistributedDataParallel(model, device_ids=[local_rank] if args.device == "cuda" else None)


def run(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = wrap(qlora.build_model(args.seed, args.device), args)
    initial = {name: qlora._quantized_data(p) for name, p in qlora.nf4_weights(model).items()}
    result = qlora.train(model, args, compiled=True, rank=rank, forward_in_block=True)
    if rank == 0:
        print(f"world size {world_size}; {len(initial)} frozen NF4 weights; adapter grads {sorted(result['grad_types'])}; "
              f"{result['summary']}", flush=True)
    if not args.check:
        return 0
    if rank == 0:
        print("check: training the same model under eager DDP", flush=True)
    eager_model = wrap(qlora.build_model(args.seed, args.device), args)
    expected = qlora.train(eager_model, args, compiled=False, rank=rank)
    problems = qlora.compare(result, expected, model, eager_model, args) + qlora.frozen_unchanged(model, initial)
    failed = torch.tensor([1.0 if problems else 0.0], device=args.device)
    dist.all_reduce(failed)  # every rank agrees on the outcome
    if problems:
        print(f"rank {rank}: check FAILED:\n  " + "\n  ".join(problems), file=sys.stderr, flush=True)
    if failed.item():
        return 1
    if rank == 0:
        print(f"check passed: {args.steps} losses on every rank and {len(qlora.lora_parameters(model))} adapters "
              f"match eager DDP ({args.backend})", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    import torch.distributed as dist

    args = qlora.parse_args(argv)  # --backend --steps --device --seed --lr --check
    if "RANK" not in os.environ:
        sys.exit("not launched by torchrun (no RANK in the environment); see the usage at the top of this file")
    timeout = timedelta(seconds=float(os.environ.get("QLORA_PG_TIMEOUT_S", "120")))
    if args.device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", timeout=timeout, device_id=torch.device("cuda", local_rank))
    else:
        dist.init_process_group("gloo", timeout=timeout)
    try:
        return run(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
