"""Hugging Face ``transformers.Trainer`` with every training step's backward captured by subclass_ca.

The one line: ``from subclass_ca.integrations.transformers import Trainer`` in place of
``from transformers import Trainer`` (or mix :class:`CompiledAutogradMixin` into a Trainer subclass of your
own, first among the bases).  ``Trainer.training_step`` computes the loss and calls
``accelerator.backward`` (accelerate's, which scales, accumulates and calls ``loss.backward()``); the mixin
runs that whole step inside one ``subclass_ca.enable()`` block, so the forward is inside the block too
(what warm-starts best) and an exception anywhere in the step leaves the block.  ``TrainerCallback`` could
not do this: it has no hook around the backward and none on an exception, so a block opened there stays
open when a step raises.

The CA graph's backend is the one the Trainer compiles the model with, ``TrainingArguments``'
``torch_compile_backend`` when ``torch_compile`` is on; otherwise subclass_ca's own default (the forwards'
backend, else inductor: Note [Defaults follow the user] in ``subclass_ca/config.py``).  A ``Config`` given as
``subclass_ca_config=`` wins, its ``backend`` filled from the arguments when it leaves it None.

accelerate alone needs no adapter: ``with subclass_ca.enable(): accelerator.backward(loss)`` (the
backend follows the forwards accelerate compiled).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import transformers

import subclass_ca

__all__ = ["CompiledAutogradMixin", "Trainer", "config_for"]


def config_for(args: Any, config: subclass_ca.Config | None = None) -> subclass_ca.Config:
    """The block's settings for a Trainer run with ``args`` (its ``TrainingArguments``).

    ``config`` (default ``subclass_ca.Config()``) with its backend taken from ``args.torch_compile_backend``
    when ``args.torch_compile`` is on and ``config`` names no backend of its own.
    """
    config = subclass_ca.Config() if config is None else config
    if not isinstance(config, subclass_ca.Config):
        raise TypeError(f"subclass_ca_config= takes a subclass_ca.Config, got {type(config).__name__}")
    compiled_with = getattr(args, "torch_compile_backend", None) if getattr(args, "torch_compile", False) else None
    if config.backend is None and compiled_with:
        config = dataclasses.replace(config, backend=compiled_with)
    return config


class CompiledAutogradMixin:
    """Runs each ``training_step`` (forward, loss, ``accelerator.backward``) inside ``subclass_ca.enable()``.

    Put it before ``transformers.Trainer`` among a subclass's bases.  ``subclass_ca_config=`` (a
    ``subclass_ca.Config``) sets the block's settings; by default they follow ``TrainingArguments``
    (:func:`config_for`).
    """

    def __init__(self, *args: Any, subclass_ca_config: subclass_ca.Config | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.subclass_ca_config = config_for(self.args, subclass_ca_config)  # type: ignore[attr-defined]

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with subclass_ca.enable(config=self.subclass_ca_config):
            return super().training_step(*args, **kwargs)  # type: ignore[misc]


class Trainer(CompiledAutogradMixin, transformers.Trainer):
    """``transformers.Trainer`` whose backward passes subclass_ca captures (:class:`CompiledAutogradMixin`)."""
