"""FSDP2 over NF4 QLoRA blocks under enable(), forward inside the block or only the backward (issue 45.2).

On torch 2.11 FSDP2 records at its first forward whether compiled autograd is on and then skips
NF4's all-gather extension in the hooks subclass_ca runs eagerly (``fsdp.all_gather_copy_in``
on NF4 shards); Note [FSDP2 under compiled autograd].  Two gloo ranks; losses and the adapters
after three AdamW steps equal eager FSDP2's on every rank, bitwise (aot_eager).
"""

from __future__ import annotations

import pytest
import torch

from subclass_ca.distributed import run_workers

pytestmark = pytest.mark.distributed
pytest.importorskip("torchao")

from tests import fsdp2_nf4_workers  # noqa: E402


@pytest.mark.parametrize("block_scope", ["step", "backward"])
def test_fsdp2_over_nf4_qlora_trains_like_eager_fsdp2(block_scope):
    eager = run_workers(fsdp2_nf4_workers.train, 2, timeout_s=240, args=("eager", block_scope))
    ours = run_workers(fsdp2_nf4_workers.train, 2, timeout_s=240, args=("ours", block_scope))
    for rank, (got, expected) in enumerate(zip(ours, eager, strict=True)):
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e, rtol=0, atol=0, msg=lambda m: f"rank {rank}: {m}")
