"""Capture reports: node counts per subclass type and mode, cache hits, miss reasons, logging."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

import subclass_ca
from subclass_ca import diagnostics
from subclass_ca.testing.subclasses import Int8RowwiseTensor, PairTensor, TaggedTensor, make_pair, make_tagged


def _two_pair_params_step():
    """Two PairTensor parameters, one PairTensor input: the backward rebuilds exactly two PairTensor grads."""
    torch.manual_seed(0)
    w1 = torch.nn.Parameter(make_pair(torch.randn(6, 5)))
    w2 = torch.nn.Parameter(make_pair(torch.randn(3, 6)))
    step = torch.compile(lambda x: (torch.tanh(x @ w1.t()) @ w2.t()).sum(), backend="aot_eager")
    return (w1, w2), step


def test_report_counts_exactly_two_pair_nodes_for_two_pair_params():
    (w1, w2), step = _two_pair_params_step()
    before = diagnostics.capture_count()
    with subclass_ca.enable():
        step(make_pair(torch.randn(4, 5))).backward()
    report = subclass_ca.last_report()
    assert report is not None and report.capture_index == before
    assert report.nodes_for("PairTensor") == 2
    assert report.nodes_for("PairTensor", "proxy") == 2
    assert report.nodes_for("PairTensor", "opaque") == 0
    assert report.total_subclass_nodes == 2
    assert report.aot_backwards == 1
    assert report.graph_code.count("subclass_ca_make_PairTensor(") == 2
    assert isinstance(w1.grad, PairTensor) and isinstance(w2.grad, PairTensor)


@pytest.mark.parametrize("mode", ["proxy", "opaque"])
def test_report_keys_nodes_by_subclass_type_and_handler_mode(mode: str):
    torch.manual_seed(0)
    registered = mode != "proxy"
    if registered:
        subclass_ca.register_handler(TaggedTensor, mode=mode)
    try:
        w = torch.nn.Parameter(make_tagged(torch.randn(4, 4), tag="t"))
        step = torch.compile(lambda x: (x @ w).sum(), backend="aot_eager")
        with subclass_ca.enable():
            step(make_tagged(torch.randn(2, 4), tag="t")).backward()
    finally:
        if registered:
            subclass_ca.unregister_handler(TaggedTensor)
    report = subclass_ca.last_report()
    assert dict(report.subclass_nodes) == {("TaggedTensor", mode): 1}
    assert report.nodes_for("TaggedTensor", mode) == 1
    assert report.nodes_for("PairTensor") == 0
    assert report.fullgraph is (mode != "opaque")
    assert f"1 x make_subclass TaggedTensor [{mode}]" in report.summary()
    assert isinstance(w.grad, TaggedTensor) and w.grad.tag == "t"


def test_frozen_int8_base_with_plain_adapters_has_no_make_subclass_nodes():
    torch.manual_seed(0)
    base = Int8RowwiseTensor.quantize(torch.randn(6, 5))
    lora_a = torch.nn.Parameter(torch.randn(2, 5) * 0.1)
    lora_b = torch.nn.Parameter(torch.randn(6, 2) * 0.1)
    step = torch.compile(lambda x: (x @ base.t() + x @ lora_a.t() @ lora_b.t()).sum(), backend="aot_eager")
    with subclass_ca.enable():
        step(torch.randn(3, 5)).backward()
    report = subclass_ca.last_report()
    assert report.total_subclass_nodes == 0
    assert report.nodes_for("Int8RowwiseTensor") == 0
    assert report.aot_backwards == 1
    assert lora_a.grad is not None and type(lora_a.grad) is torch.Tensor


def test_repeated_backward_is_a_cache_hit_counted_on_its_capture():
    (w1, w2), step = _two_pair_params_step()
    x = make_pair(torch.randn(4, 5))
    before = diagnostics.capture_count()
    with subclass_ca.enable():
        for _ in range(2):  # warm-up: the first backward has no .grad yet, so the second recaptures
            step(x).backward()
        captures_after_warmup = diagnostics.capture_count()
        for _ in range(3):
            step(x).backward()
    assert diagnostics.capture_count() == captures_after_warmup  # no new capture: every later backward hit the cache
    last = subclass_ca.last_report()
    assert last.runs == 4 and last.cache_hits == 3
    stats = subclass_ca.cache_stats(since=before)
    assert stats["captures"] == captures_after_warmup - before
    assert stats["runs"] == 5
    assert stats["cache_hits"] == stats["runs"] - stats["captures"]
    assert stats["make_subclass_nodes"] == 2 * stats["captures"]
    assert "runs=4 (cache hits=3)" in last.summary()


def test_with_report_every_capture_carries_torchs_cache_miss_reason():
    (w1, w2), step = _two_pair_params_step()
    before = diagnostics.capture_count()
    with subclass_ca.enable(report=True):
        for _ in range(3):
            step(make_pair(torch.randn(4, 5))).backward()
    new = [r for r in subclass_ca.reports() if r.capture_index >= before]
    assert new, "no capture recorded"
    for report in new:
        assert report.miss_reasons_available
        assert len(report.miss_reasons) == 1, report.miss_reasons
        assert report.miss_reasons[0].startswith("Cache miss due to")
    assert "previous key sizes=[]" in new[0].miss_reasons[0]  # a cold cache
    assert "cache miss: Cache miss due to" in new[0].summary()


def test_metadata_change_capture_reports_a_miss_reason():
    torch.manual_seed(0)
    step = torch.compile(lambda x, w: (x @ w).sum(), backend="aot_eager")
    with subclass_ca.enable(report=True):
        for tag in ("a", "b"):
            w = torch.nn.Parameter(make_tagged(torch.randn(4, 4), tag=tag))
            before = diagnostics.capture_count()
            step(make_tagged(torch.randn(2, 4), tag=tag), w).backward()
            assert diagnostics.capture_count() == before + 1
            assert subclass_ca.last_report().miss_reasons
            assert w.grad.tag == tag


def test_miss_reasons_from_outside_enable_do_not_leak_into_the_next_report():
    (w1, w2), step = _two_pair_params_step()
    stock = lambda gm: torch.compile(gm, backend="aot_eager", fullgraph=True)  # noqa: E731
    with torch._dynamo.compiled_autograd._enable(stock):  # stock CA: our reason hook is not installed
        step(make_pair(torch.randn(4, 5))).backward()
    subclass_ca.reset()
    with subclass_ca.enable(report=True):
        step(make_pair(torch.randn(4, 5))).backward()
    assert len(subclass_ca.last_report().miss_reasons) == 1


def test_miss_reasons_are_not_collected_unless_asked_for():
    """Collecting them installs torch's C++ verbose logger, which has its own failure modes (issue 21)."""
    (w1, w2), step = _two_pair_params_step()
    with subclass_ca.enable():
        assert diagnostics.CACHE_MISS_LOG.holders == 0
        step(make_pair(torch.randn(4, 5))).backward()
    report = subclass_ca.last_report()
    assert not report.miss_reasons_available and report.miss_reasons == []
    assert "not collected" in report.summary()


def test_report_true_logs_the_summary(caplog: pytest.LogCaptureFixture):
    (w1, w2), step = _two_pair_params_step()
    with caplog.at_level(logging.WARNING, logger="subclass_ca"):
        with subclass_ca.enable(report=True):
            step(make_pair(torch.randn(4, 5))).backward()
    messages = [r.getMessage() for r in caplog.records if r.name == "subclass_ca"]
    assert any("2 x make_subclass PairTensor [proxy]" in m for m in messages), messages


_LOG_SCRIPT = """
import torch, subclass_ca
from subclass_ca.testing.subclasses import make_pair
w = torch.nn.Parameter(make_pair(torch.randn(3, 3)))
step = torch.compile(lambda x: (x @ w).sum(), backend="aot_eager")
with subclass_ca.enable():
    step(torch.randn(2, 3)).backward()
print("done")
"""


@pytest.mark.parametrize("level", ["", "debug"])
def test_logging_is_quiet_by_default_and_verbose_with_env(level: str):
    env = {k: v for k, v in os.environ.items() if k != "SUBCLASS_CA_LOG"}
    env.update(OMP_NUM_THREADS="1", **({"SUBCLASS_CA_LOG": level} if level else {}))
    result = subprocess.run(
        [sys.executable, "-c", _LOG_SCRIPT], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr
    assert "done" in result.stdout
    ours = [line for line in result.stderr.splitlines() if "[subclass_ca" in line]
    if level:
        assert any("make_subclass node for PairTensor [proxy]" in line for line in ours), result.stderr
        assert "1 x make_subclass PairTensor [proxy]" in result.stderr  # the capture summary (INFO)
        assert any("cache miss due to" in line.lower() for line in ours), result.stderr
    else:
        assert ours == [], result.stderr
