"""``subclass_ca.integrations.torchtune``: a stock torchtune recipe run under ``enable()`` equals ``tune run``.

Each run is the real recipe file of the pinned torchtune release, resolved and started by torchtune's own
command line in this process, on a tiny offline config (``torchtune_*.yaml``: the model, optimizer, loss,
scheduler and collate function are torchtune's or torch's; the tokenizer, dataset and checkpointer are the
seeded stand-ins of ``torchtune_components.py``).  The same config runs twice, once through ``tune run``'s
CLI as is and once through the integration, and the trained weights must be bitwise equal: aot_eager
(``TORCH_COMPILE_BACKEND``, torchtune's own backend setting) computes the same kernels as eager.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtune")

import torch

import subclass_ca
from subclass_ca.integrations import torchtune as tune_integration

from .torchtune_components import FINAL_WEIGHTS

HERE = Path(__file__).resolve().parent
QLORA = (HERE / "torchtune_qlora.yaml", "lora_finetune_single_device")
TWO_TENSOR = (HERE / "torchtune_two_tensor.yaml", "full_finetune_single_device")
STEPS = 3
"""Optimizer steps per run: 6 samples, batch size 2, one epoch (both configs)."""


@pytest.fixture(autouse=True)
def aot_eager_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchtune's compile backend, for its compiled forwards and (through the integration) the CA graphs."""
    monkeypatch.setenv("TORCH_COMPILE_BACKEND", "aot_eager")


def tune_run_plain(argv: list[str]) -> None:
    """``tune run *argv`` exactly as the ``tune`` console script runs it (no block), in this process."""
    from torchtune._cli.tune import main as tune_main

    saved = sys.argv
    sys.argv = ["tune", "run", *argv]
    try:
        tune_main()
    except SystemExit as finished:
        assert finished.code in (None, 0), finished
    finally:
        sys.argv = saved


def recipe_argv(config: tuple[Path, str], output_dir: Path, *overrides: str) -> list[str]:
    path, recipe = config
    return [recipe, "--config", str(path), f"output_dir={output_dir}", *overrides]


def assert_bitwise_equal_weights(plain_dir: Path, ca_dir: Path) -> None:
    plain = torch.load(plain_dir / FINAL_WEIGHTS)
    captured = torch.load(ca_dir / FINAL_WEIGHTS)
    assert plain.keys() == captured.keys() and plain
    for name in plain:
        torch.testing.assert_close(captured[name], plain[name], rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")


def test_qlora_recipe_under_enable_equals_tune_run(tmp_path: Path):
    """torchtune's QLoRA (NF4 base weights from its own ``lora_llama2(quantize_base=True)``), the stock
    ``lora_finetune_single_device`` recipe with ``compile=True``: its layers are compiled with aot_eager, the
    CA graph follows torchtune's ``TORCH_COMPILE_BACKEND``, and the trained adapters equal ``tune run``'s."""
    argv = recipe_argv(QLORA, tmp_path / "plain", "compile=True")
    subclass_ca.clear_reports()
    tune_run_plain(argv)
    assert subclass_ca.cache_stats()["captures"] == 0  # the baseline really ran without compiled autograd
    tune_integration.run(recipe_argv(QLORA, tmp_path / "ca", "compile=True"))

    stats = subclass_ca.cache_stats()
    assert stats["captures"] >= 1 and stats["runs"] == STEPS, stats  # every backward went through a CA graph
    report = subclass_ca.last_report()
    assert report is not None and report.backend == "aot_eager"
    assert report.aot_backwards >= 1 and set(report.forward_backends) == {"aot_eager"}  # compiled forwards captured
    assert_bitwise_equal_weights(tmp_path / "plain", tmp_path / "ca")


def test_subclass_gradient_recipe_through_the_command_line_equals_tune_run(tmp_path: Path):
    """The stock ``full_finetune_single_device`` recipe on torchtune's Llama2 with every weight a TwoTensor
    parameter, ``compile: True`` (torchtune compiles its attention layer with aot_eager): each backward's CA
    graph rebuilds TwoTensor gradients, and the trained weights (both inner tensors of each) equal ``tune
    run``'s.  Runs through ``main`` (the ``python -m`` entry point)."""
    subclass_ca.clear_reports()
    tune_run_plain(recipe_argv(TWO_TENSOR, tmp_path / "plain"))
    assert subclass_ca.cache_stats()["captures"] == 0
    argv_before = list(sys.argv)
    tune_integration.main(recipe_argv(TWO_TENSOR, tmp_path / "ca"))
    assert sys.argv == argv_before  # tune run rewrites sys.argv for the recipe; the integration puts it back

    stats = subclass_ca.cache_stats()
    assert stats["captures"] >= 1 and stats["runs"] == STEPS, stats
    report = subclass_ca.last_report()
    assert report is not None and report.backend == "aot_eager"
    assert report.nodes_for("TwoTensor") >= 2, report.subclass_nodes  # both weights' gradients rebuilt
    assert_bitwise_equal_weights(tmp_path / "plain", tmp_path / "ca")
    assert any(name.endswith(".b") for name in torch.load(tmp_path / "ca" / FINAL_WEIGHTS))  # TwoTensors compared


def test_a_failing_recipe_leaves_the_block(tmp_path: Path):
    """An exception inside the recipe propagates from ``run`` and the block is left: a later backward is eager."""
    with pytest.raises(ValueError, match="no recipe state"):
        tune_integration.run(recipe_argv(TWO_TENSOR, tmp_path, "resume_from_checkpoint=True"))
    subclass_ca.clear_reports()
    weight = torch.randn(3, requires_grad=True)
    (weight * 2).sum().backward()
    assert subclass_ca.cache_stats()["captures"] == 0


def test_a_failed_exit_propagates(tmp_path: Path):
    """``tune run``'s own usage errors (here: no ``--config``) exit non-zero through ``run``, not swallowed."""
    with pytest.raises(SystemExit) as exited:
        tune_integration.run(["full_finetune_single_device"])
    assert exited.value.code not in (None, 0)


def test_torchrun_options_are_refused_with_the_command_that_works(tmp_path: Path):
    """``tune run --nproc_per_node N`` would start workers outside the block: refused before anything runs,
    naming the torchrun command whose workers each run the recipe under the block."""
    argv = ["--nproc_per_node", "2", "full_finetune_distributed", "--config", "my.yaml", "epochs=1"]
    with pytest.raises(tune_integration.TorchrunOptionsError) as refused:
        tune_integration.run(argv)
    expected = "torchrun --nproc_per_node 2 -m subclass_ca.integrations.torchtune full_finetune_distributed --config my.yaml epochs=1"
    assert expected in str(refused.value)
    with pytest.raises(SystemExit) as exited:
        tune_integration.main(argv)
    assert isinstance(exited.value.code, str) and expected in exited.value.code
    assert tune_integration.torchrun_refusal(["full_finetune_single_device", "--config", "x.yaml"]) is None


def test_the_backend_is_torchtunes_compile_backend(monkeypatch: pytest.MonkeyPatch):
    """``TORCH_COMPILE_BACKEND`` names the CA backend when set; unset, the backend follows the forwards (None);
    a backend the caller names wins either way."""
    assert tune_integration.block_config().backend == "aot_eager"
    assert tune_integration.block_config(subclass_ca.Config(backend="eager")).backend == "eager"
    assert tune_integration.block_config(subclass_ca.Config(strict=True)).strict  # other settings kept
    monkeypatch.delenv("TORCH_COMPILE_BACKEND")
    assert tune_integration.block_config().backend is None
