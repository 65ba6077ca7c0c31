"""The DDP bench (``bench --ddp``, issue 46): every mode timed per round, the Python reducer in its own launch."""

from __future__ import annotations

import pytest

from tools.bench import ddp as bench_ddp

TINY = bench_ddp.DDPBench(models=("two_tensor_mlp",), backends=("aot_eager",), warmup=0, reps=2, block=1)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(250)
def test_ddp_bench_times_every_mode_and_the_python_reducer_against_compile_only():
    result = bench_ddp.bench(2, settings=TINY, timeout_s=240)
    (row,) = result["rows"]
    assert set(row["modes"]) == set(bench_ddp.MODES), row
    assert row["modes"]["compile_python_reducer"]["ratio"] is None  # its own launch: no ratio to eager DDP
    assert row["modes"]["compile_python_reducer"]["vs_compile"] > 0
    assert not row["gated"] and result["ok"]
    text = bench_ddp.markdown_section(result)
    assert "## DistributedDataParallel training, 2 processes" in text and "- (own launch)" in text


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="DDPBench.models"):
        bench_ddp.DDPBench(models=("resnet",))
    with pytest.raises(ValueError, match="DDPBench.reps"):
        bench_ddp.DDPBench(reps=0)
