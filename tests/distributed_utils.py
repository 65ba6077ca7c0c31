"""In-process single-rank process group for DTensor tests (gloo, plus NCCL for CUDA tensors where CUDA exists; 127.0.0.1, free port)."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def single_process_group() -> Iterator[None]:
    """A world_size-1 group for the duration of the block (reuses one that exists).

    gloo for CPU tensors; where CUDA and NCCL exist, also NCCL for CUDA tensors (one default group,
    ``"cpu:gloo,cuda:nccl"``), so a test can build a CPU and a CUDA device mesh in the same process.
    """
    if dist.is_initialized():
        yield
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    with_cuda = torch.cuda.is_available() and dist.is_nccl_available()
    dist.init_process_group(
        "cpu:gloo,cuda:nccl" if with_cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=60),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()
