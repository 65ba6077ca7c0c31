"""``subclass_ca.integrations.lightning.CompiledAutograd`` against the real Lightning Trainer: automatic and manual
optimization train a TwoTensor-gradient model and a QLoRA model as eager trains them, every backward captured, and a
backward that raises leaves no block open."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import subclass_ca

from .models import MODELS, assert_no_block_open, assert_same_training, rows, trained_state

pytest.importorskip("pytorch_lightning")
integration = pytest.importorskip("subclass_ca.integrations.lightning")
if integration.CALLBACK_PACKAGE == "lightning":
    import lightning.pytorch as pl
else:
    import pytorch_lightning as pl

STEPS = 3


class _Module(pl.LightningModule):
    def __init__(self, model_name: str, compile_backend: str | None, manual: bool, fail_at_step: int | None = None):
        super().__init__()
        self.model = MODELS[model_name](compile_backend=compile_backend)
        self.automatic_optimization = not manual
        self.fail_at_step = fail_at_step

    def training_step(self, batch: dict[str, torch.Tensor], index: int) -> Any:
        loss = self.model(batch["x"], batch["labels"])["loss"]
        if self.fail_at_step == index:
            loss.register_hook(self._fail)
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return None

    @staticmethod
    def _fail(grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a backward hook failed")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.05, foreach=False)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(rows(), batch_size=4)


def _fit(module: _Module, callbacks: list[Any]) -> None:
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                         num_sanity_val_steps=0)
    trainer.fit(module)


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual_backward"])
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_the_callback_trains_as_eager_with_every_backward_captured(model_name, manual):
    eager = _Module(model_name, compile_backend=None, manual=manual)
    _fit(eager, [])
    before = len(subclass_ca.reports())
    callback = integration.CompiledAutograd()
    ours = _Module(model_name, compile_backend="aot_eager", manual=manual)
    _fit(ours, [callback])
    assert_same_training(trained_state(eager.model), trained_state(ours.model))
    new = subclass_ca.reports()[before:]
    assert new and sum(r.runs for r in new) == STEPS
    assert all(r.backend == "aot_eager" for r in new), "Lightning has no compile setting: the forwards' backend"
    assert not callback.is_open
    if model_name == "two_tensor":
        assert any(name == "TwoTensor" for name, _mode in new[-1].subclass_nodes), new[-1].subclass_nodes


def test_a_backward_that_raises_leaves_no_block_open():
    callback = integration.CompiledAutograd(backend="aot_eager")
    module = _Module("two_tensor", compile_backend="aot_eager", manual=False, fail_at_step=1)
    with pytest.raises(RuntimeError, match="a backward hook failed"):
        _fit(module, [callback])
    assert not callback.is_open
    assert_no_block_open()


def test_settings_are_validated_when_the_callback_is_made():
    assert integration.CompiledAutograd(backend="aot_eager", dynamic=True).config == subclass_ca.Config(
        backend="aot_eager", dynamic=True)
    config = subclass_ca.Config(backend="eager")
    assert integration.CompiledAutograd(config=config).config is config
    with pytest.raises(ValueError, match="unknown backend"):
        integration.CompiledAutograd(backend="no_such_backend")
    with pytest.raises(TypeError, match="put them all in the Config"):
        integration.CompiledAutograd(config=config, dynamic=True)
