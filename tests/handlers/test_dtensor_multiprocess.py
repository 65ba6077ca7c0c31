"""DTensor on world_size 2 (two processes, gloo, 127.0.0.1): gradients equal a dense reference."""

from __future__ import annotations

import pytest
import torch

from subclass_ca.distributed import run_workers
from tests.handlers import dtensor_workers

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available"),
]


def test_two_rank_shard_and_replicate_grads_match_dense_reference():
    results = run_workers(dtensor_workers.dtensor_grads_under_subclass_ca, 2, timeout_s=120, args=(0,))
    reference = dtensor_workers.dense_reference(0)
    assert len(results) == 2
    for rank, result in enumerate(results):
        assert result["is_dtensor"], f"rank {rank}: gradients are not DTensors"
        assert result["dtensor_nodes"] >= 2
        torch.testing.assert_close(result["w"], reference["w"])
        torch.testing.assert_close(result["b"], reference["b"])
        assert result["w_placements"] == result["eager_w_placements"]
        assert result["b_placements"] == result["eager_b_placements"]
        torch.testing.assert_close(result["local_w"], result["eager_local_w"])
