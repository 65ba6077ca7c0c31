"""``subclass_ca.integrations.torchtitan``: torchtitan's ``Trainer`` with its forward-backward step under ``enable()``.

torchtitan does not train on CPU (its ``Trainer.__init__`` sets a CUDA device, and FlexAttention, the debug
model's attention, has no CPU backward), so on CPU these tests run what torchtitan allows:

* the config plumbing, real: ``Trainer.Config`` builds this trainer, a stock config converts field by field,
  torchtitan's own ``ConfigManager``/tyro parses the ``compiled_autograd`` flags, the backend rule;
* the step, real torchtitan code on a stubbed trainer: the stock ``forward_backward_step``,
  ``post_dataloading_process`` and ``_forward_backward_body`` (through ``wrap_with_cuda_graph``, the
  pass-through on CPU), with torchtitan's ``CrossEntropyLoss``, ``ParallelDims``, spmd_types context (a
  one-process gloo group) and its default ``spmd_types`` input annotation, run by an instance made without
  ``__init__``: what ``__init__`` would have built (model parts, loss, context) is set by
  :func:`bare_trainer`, and the model is a tiny LM whose weights are TwoTensor parameters, compiled with
  aot_eager (what ``parallelize_fn`` does with ``--compile.enable``).  The same step of torchtitan's stock
  ``Trainer`` is the reference: gradients bitwise equal.

``test_debug_model_trains_under_enable_cuda`` (``-m cuda``, skipped without a GPU) runs the rest: the debug
model end to end through torchtitan's trainer, stock and this one, and ``python -m``'s ``main``.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("torchtitan")

from .torchtitan_cpu import import_torchtitan_trainer

stock = import_torchtitan_trainer()  # torchtitan.trainer (a triton stand-in during the import on CPU-only torch)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.testing._internal.two_tensor import TwoTensor  # noqa: E402
from torchtitan.components.loss import CrossEntropyLoss  # noqa: E402
from torchtitan.config import CompileConfig  # noqa: E402
from torchtitan.distributed import ParallelDims  # noqa: E402
from torchtitan.distributed import utils as dist_utils  # noqa: E402
from torchtitan.distributed.cudagraph import wrap_with_cuda_graph  # noqa: E402

import subclass_ca  # noqa: E402
from subclass_ca.integrations import torchtitan as titan  # noqa: E402

from . import torchtitan_components  # noqa: E402
from .models import nf4_module  # noqa: E402

VOCAB, DIM = 32, 8
COMPONENTS = "tests.integrations.torchtitan_components"


class TwoTensorLM(nn.Module):
    """Embedding, tanh, projection; both weights TwoTensor parameters (every gradient a TwoTensor)."""

    def __init__(self) -> None:
        super().__init__()
        embedding, projection = torch.randn(VOCAB, DIM) * 0.1, torch.randn(VOCAB, DIM) * 0.1
        self.embedding = nn.Parameter(TwoTensor(embedding, embedding * 2.0))
        self.projection = nn.Parameter(TwoTensor(projection, projection * 0.5))

    def forward(self, tokens: torch.Tensor, **extra: Any) -> torch.Tensor:
        return nn.functional.linear(torch.tanh(nn.functional.embedding(tokens, self.embedding)), self.projection)


class QLoRALM(nn.Module):
    """Embedding, tanh, then a frozen torchao NF4 projection with trainable LoRA adapters (QLoRA)."""

    def __init__(self) -> None:
        super().__init__()
        nf4 = nf4_module()
        self.linear_nf4 = nf4.linear_nf4
        self.embedding = nn.Parameter(torch.randn(VOCAB, DIM) * 0.1)
        self.base = nn.Parameter(nf4.to_nf4(torch.randn(VOCAB, DIM) * 0.1, block_size=64, scaler_block_size=1), requires_grad=False)
        self.lora_a = nn.Parameter(torch.randn(4, DIM) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(VOCAB, 4) * 0.1)

    def forward(self, tokens: torch.Tensor, **extra: Any) -> torch.Tensor:
        hidden = torch.tanh(nn.functional.embedding(tokens, self.embedding))
        return self.linear_nf4(hidden, self.base) + hidden @ self.lora_a.t() @ self.lora_b.t()


@pytest.fixture(scope="module", autouse=True)
def one_process_group() -> Iterator[None]:
    """The default ``spmd_types`` backend builds a device mesh: a one-process gloo group (in-memory store)."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if dist.is_initialized():  # the CUDA test replaces it with torchtitan's own, which torchtitan tears down
            dist.destroy_process_group()


def step_config(trainer_class: type, *, compiled_autograd: titan.CompiledAutogradConfig | None = None) -> Any:
    """A ``Trainer.Config`` of ``trainer_class`` for the step: torchtitan's CE loss, ``--compile.enable`` with
    aot_eager (the backend its forwards are compiled with; the CA graph follows it)."""
    sections: dict[str, Any] = {
        "loss": CrossEntropyLoss.Config(global_vocab_size=VOCAB),
        "compile": CompileConfig(enable=True, backend="aot_eager"),
    }
    if compiled_autograd is not None:
        sections["compiled_autograd"] = compiled_autograd
    return trainer_class.Config(**sections)


def bare_trainer(trainer_class: type, config: Any, model: nn.Module) -> Any:
    """An instance of ``trainer_class`` made without ``__init__`` (which needs CUDA): the attributes its step
    reads, built as ``__init__`` builds them for one CPU process without CUDA graphs."""
    trainer = object.__new__(trainer_class)
    trainer.config = config
    trainer.device = torch.device("cpu")
    trainer.parallel_dims = ParallelDims.from_config(config.parallelism, world_size=1)
    trainer.model_config = None  # not a Decoder config: no attention masks to build
    trainer.model_parts = [torch.compile(model, backend=config.compile.backend)]
    trainer.loss_fn = config.loss.build(compile_config=config.compile)
    trainer.ntokens_seen = 0
    trainer.train_context = dist_utils.get_spmd_context(parallel_dims=trainer.parallel_dims, spmd_typechecking=False)
    trainer.fwd_bwd_fn = wrap_with_cuda_graph(trainer._forward_backward_body)
    return trainer


def gradients_after_steps(trainer: Any, model: nn.Module, steps: int = 2) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    for _ in range(steps):  # the second step accumulates into the first's gradients
        tokens, labels = torch.randint(0, VOCAB, (2, 6)), torch.randint(0, VOCAB, (2, 6))
        trainer.forward_backward_step(input_dict={"input": tokens}, labels=labels, global_valid_tokens=torch.tensor(12))
    return {name: parameter.grad for name, parameter in model.named_parameters() if parameter.requires_grad}


def stock_and_ours(compiled_autograd: titan.CompiledAutogradConfig | None = None,
                   make_model: Callable[[], nn.Module] = TwoTensorLM) -> tuple[dict, dict]:
    """Gradients of two steps of torchtitan's stock trainer, then of this one, from the same weights (each trainer's
    model made from the same seed: torchao's NF4 re-quantizes with other block sizes when deep-copied)."""
    results = []
    for trainer_class, section in ((stock.Trainer, None), (titan.Trainer, compiled_autograd)):
        torch.manual_seed(0)
        copied = make_model()
        trainer = bare_trainer(trainer_class, step_config(trainer_class, compiled_autograd=section), copied)
        subclass_ca.clear_reports()
        results.append(gradients_after_steps(trainer, copied))
        if trainer_class is stock.Trainer:
            assert subclass_ca.cache_stats()["captures"] == 0  # the reference ran without compiled autograd
    return results[0], results[1]


def assert_bitwise_equal(reference: dict[str, torch.Tensor], actual: dict[str, torch.Tensor], *,
                         gradient_type: type = TwoTensor) -> None:
    assert reference.keys() == actual.keys()
    for name, gradient in reference.items():
        assert type(actual[name]) is type(gradient) is gradient_type, name
        torch.testing.assert_close(actual[name], gradient, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")


def test_forward_backward_step_under_enable_equals_the_stock_step():
    """torchtitan's own step code, in this trainer: every backward captured (the CA backend is torchtitan's
    ``compile.backend``), TwoTensor gradients rebuilt in the CA graph, and bitwise the stock trainer's."""
    reference, ours = stock_and_ours()
    stats = subclass_ca.cache_stats()
    assert stats["runs"] == 2 and stats["captures"] >= 1, stats
    report = subclass_ca.last_report()
    assert report is not None and report.backend == "aot_eager" and report.aot_backwards >= 1
    assert report.nodes_for("TwoTensor") >= 2, report.subclass_nodes
    assert_bitwise_equal(reference, ours)


def test_a_qlora_step_under_enable_equals_the_stock_step():
    """The same with QLoRA: a frozen NF4 projection (an input of the compiled forward) and LoRA adapters."""
    reference, ours = stock_and_ours(make_model=QLoRALM)
    stats = subclass_ca.cache_stats()
    assert stats["runs"] == 2 and stats["captures"] >= 1, stats
    assert set(ours) == {"embedding", "lora_a", "lora_b"}  # the NF4 base is frozen: no gradient
    assert_bitwise_equal(reference, ours, gradient_type=torch.Tensor)


def test_the_section_turns_the_block_off():
    """``--compiled_autograd.no-enable``: this trainer's step is the stock step, nothing captured."""
    reference, ours = stock_and_ours(titan.CompiledAutogradConfig(enable=False))
    assert subclass_ca.cache_stats()["captures"] == 0
    assert_bitwise_equal(reference, ours)


def test_an_exception_in_the_step_leaves_the_block():
    """A step that raises (labels of the wrong shape) leaves the block: a later backward runs eagerly."""
    trainer = bare_trainer(titan.Trainer, step_config(titan.Trainer), TwoTensorLM())
    with pytest.raises(Exception):  # noqa: B017  (whatever the loss raises)
        trainer.forward_backward_step(input_dict={"input": torch.zeros(2, 6, dtype=torch.long)},
                                      labels=torch.zeros(3, 5, dtype=torch.long), global_valid_tokens=torch.tensor(1))
    subclass_ca.clear_reports()
    weight = torch.randn(3, requires_grad=True)
    (weight * 2).sum().backward()
    assert subclass_ca.cache_stats()["captures"] == 0


def test_the_config_selects_this_trainer():
    """``Trainer.Config.build`` constructs the class its config is nested in: this module's config builds this
    trainer; a stock config converts field by field (the same section objects) with the section added."""
    assert titan.Trainer.Config._owner is titan.Trainer and stock.Trainer.Config._owner is stock.Trainer
    stock_config = torchtitan_components.tiny_debugmodel()
    ours = titan.with_compiled_autograd(stock_config)
    assert isinstance(ours, titan.Trainer.Config) and ours.compiled_autograd == titan.CompiledAutogradConfig()
    for field_name in ("model_spec", "training", "compile", "parallelism", "dataloader", "tokenizer"):
        assert getattr(ours, field_name) is getattr(stock_config, field_name)
    assert titan.with_compiled_autograd(ours) is ours


@pytest.mark.parametrize(
    ("flags", "enable", "backend"),
    [
        ([], True, None),
        (["--compiled_autograd.no-enable"], False, None),
        (["--compiled_autograd.backend", "eager"], True, "eager"),
        (["--compile.enable", "--compile.backend", "aot_eager"], True, "aot_eager"),
        (["--compile.enable", "--compiled_autograd.backend", "eager"], True, "eager"),
    ],
    ids=["default", "off", "named", "torchtitans-compile-backend", "named-wins"],
)
def test_command_line_flags_parse_with_torchtitans_config_manager(flags: list[str], enable: bool, backend: str | None):
    """A stock config function (``--module``/``--config``) parsed by torchtitan's ConfigManager and tyro, as
    this trainer's config; the CA backend: the section's, else ``compile.backend`` when compiling, else None."""
    config = titan.parse_config(["--module", COMPONENTS, "--config", "tiny_debugmodel", *flags])
    assert isinstance(config, titan.Trainer.Config)
    assert config.compiled_autograd.enable is enable
    assert titan.block_config(config.compiled_autograd, config.compile).backend == backend
    assert config.training.seq_len == 64  # the config function's own settings kept


def test_a_config_function_returning_this_trainers_config_needs_no_conversion():
    from torchtitan.config import ConfigManager

    config = ConfigManager().parse_args(
        ["--module", COMPONENTS, "--config", "tiny_debugmodel_with_compiled_autograd", "--compiled_autograd.no-enable"])
    assert isinstance(config, titan.Trainer.Config) and config.compiled_autograd.enable is False


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torchtitan's trainer does)")
@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["cuda-graphs", "no-cuda-graphs"])
def test_debug_model_trains_under_enable_cuda(monkeypatch: pytest.MonkeyPatch, tmp_path, cuda_graphs: bool):
    """torchtitan's llama3 debug model (FlexAttention; torchtitan's CUDA graphs on, its default, and off), end to
    end on one GPU: four steps of the stock trainer and of this one (CA backend aot_eager: the same kernels as
    eager) from the same seed reach the same weights; then ``main`` (``python -m``) trains it under the block
    again.  With CUDA graphs, the first step runs eagerly (compiled autograd captures there), the second is
    recorded into a CUDA graph (the CA graph's kernels with it) and later steps replay it."""
    if dist.is_initialized():  # the CPU tests' gloo group: torchtitan makes its own
        dist.destroy_process_group()
    port = str(_free_port())
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}.items():
        monkeypatch.setenv(name, value)
    flags = ["--module", COMPONENTS, "--config", "tiny_debugmodel", "--dump_folder", str(tmp_path),
             *([] if cuda_graphs else ["--training.disable_cuda_graphs"])]

    def train(config: Any) -> dict[str, torch.Tensor]:
        trainer = config.build()
        try:
            trainer.train()
            return {k: v.detach().clone() for k, v in trainer.model_parts[0].state_dict().items()}
        finally:
            trainer.close()

    from torchtitan.config import ConfigManager

    subclass_ca.clear_reports()
    reference = train(ConfigManager().parse_args(flags))
    assert subclass_ca.cache_stats()["captures"] == 0
    ours = train(titan.parse_config([*flags, "--compiled_autograd.backend", "aot_eager"]))
    stats = subclass_ca.cache_stats()
    assert stats["captures"] >= 1 and stats["runs"] >= 1, stats
    assert reference.keys() == ours.keys()
    for name in reference:
        torch.testing.assert_close(ours[name], reference[name], rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")

    subclass_ca.clear_reports()
    titan.main([*flags, "--training.steps", "2"])
    assert subclass_ca.cache_stats()["captures"] >= 1
    assert not dist.is_initialized() and os.environ["RANK"] == "0"
