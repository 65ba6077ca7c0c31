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


def test_fsdp2_over_nf4_qlora_trains_like_eager_fsdp2_with_the_forward_in_or_out_of_the_block():
    eager = run_workers(fsdp2_nf4_workers.train_both, 2, timeout_s=300, args=("eager",))
    ours = run_workers(fsdp2_nf4_workers.train_both, 2, timeout_s=300, args=("ours",))
    for rank in range(2):
        for scope in ("step", "backward"):
            for g, e in zip(ours[rank][scope], eager[rank][scope], strict=True):
                torch.testing.assert_close(g, e, rtol=0, atol=0, msg=lambda m, scope=scope: f"rank {rank}, {scope}: {m}")
