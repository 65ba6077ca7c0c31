"""``subclass_ca.integrations.transformers`` against the real HF Trainer (and accelerate alone): a TwoTensor-
gradient model and a QLoRA model train as eager trains them, every backward captured, the backend taken from
``TrainingArguments``, and a step that raises leaves no block open."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import subclass_ca

from .models import MODELS, assert_no_block_open, assert_same_training, rows, trained_state

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")
integration = pytest.importorskip("subclass_ca.integrations.transformers")

STEPS = 3


def _arguments(tmp_path: Any, **overrides: Any) -> Any:
    settings: dict[str, Any] = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=STEPS, learning_rate=0.05,
        report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no", seed=0, dataloader_num_workers=0,
        disable_tqdm=True,
    )
    settings.update(overrides)
    return transformers.TrainingArguments(**settings)


def _train(trainer_class: Any, model_name: str, tmp_path: Any, *, compile_backend: str | None, **trainer_kwargs: Any):
    model = MODELS[model_name]()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=0.05, foreach=False)
    arguments = _arguments(tmp_path, **({"torch_compile": True, "torch_compile_backend": compile_backend}
                                        if compile_backend else {}))
    trainer = trainer_class(model=model, args=arguments, train_dataset=rows(), optimizers=(optimizer, None),
                            **trainer_kwargs)
    trainer.train()
    return trained_state(model), trainer


@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_the_trainer_trains_as_eager_with_every_backward_captured(model_name, tmp_path):
    expected, _ = _train(transformers.Trainer, model_name, tmp_path / "eager", compile_backend=None)
    before = len(subclass_ca.reports())
    actual, trainer = _train(integration.Trainer, model_name, tmp_path / "ca", compile_backend="aot_eager")
    assert_same_training(expected, actual)
    new = subclass_ca.reports()[before:]
    assert new and sum(r.runs for r in new) == STEPS, [(r.capture_index, r.runs) for r in new]
    assert all(r.backend == "aot_eager" for r in new), "the CA graph's backend follows TrainingArguments"
    assert trainer.subclass_ca_config.backend == "aot_eager"
    if model_name == "two_tensor":
        assert any(name == "TwoTensor" for name, _mode in new[-1].subclass_nodes), new[-1].subclass_nodes
        assert all(r.aot_backwards for r in new)


def test_the_backend_comes_from_training_arguments_unless_the_config_names_one(tmp_path):
    compiled = _arguments(tmp_path, torch_compile=True, torch_compile_backend="aot_eager")
    assert integration.config_for(compiled).backend == "aot_eager"
    assert integration.config_for(_arguments(tmp_path)).backend is None  # not compiled: follow the forwards
    chosen = subclass_ca.Config(backend="eager", dynamic=True)
    assert integration.config_for(compiled, chosen) == chosen
    filled = integration.config_for(compiled, subclass_ca.Config(dynamic=True))
    assert (filled.backend, filled.dynamic) == ("aot_eager", True)
    with pytest.raises(TypeError, match="subclass_ca.Config"):
        integration.config_for(compiled, {"backend": "eager"})


class _FailsOnSecondStep(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = MODELS["two_tensor"]()
        self.calls = 0

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("the second step failed")
        return self.inner(x, labels)


def test_a_step_that_raises_leaves_no_block_open(tmp_path):
    model = _FailsOnSecondStep()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, foreach=False)
    trainer = integration.Trainer(model=model, args=_arguments(tmp_path), train_dataset=rows(),
                                  optimizers=(optimizer, None), subclass_ca_config=subclass_ca.Config(backend="aot_eager"))
    with pytest.raises(RuntimeError, match="the second step failed"):
        trainer.train()
    assert_no_block_open()


def test_accelerate_alone_with_a_block_around_backward_trains_as_eager():
    def run(block: bool) -> dict[str, torch.Tensor]:
        accelerator = accelerate.Accelerator(cpu=True)
        model = MODELS["two_tensor"](compile_backend="aot_eager" if block else None)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, foreach=False)
        model, optimizer = accelerator.prepare(model, optimizer)
        data = rows()
        for step in range(STEPS):
            batch = data[step * 4:(step + 1) * 4]
            loss = model(torch.stack([r["x"] for r in batch]), torch.stack([r["labels"] for r in batch]))["loss"]
            if block:
                with subclass_ca.enable():
                    accelerator.backward(loss)
            else:
                accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        return trained_state(accelerator.unwrap_model(model))

    expected = run(block=False)
    before = subclass_ca.cache_stats()["runs"]
    actual = run(block=True)
    assert_same_training(expected, actual)
    assert subclass_ca.cache_stats()["runs"] - before == STEPS
    assert subclass_ca.last_report().backend == "aot_eager"  # followed the forwards' backend
