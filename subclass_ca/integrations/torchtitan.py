"""torchtitan: a ``Trainer`` whose forward-backward step runs under ``subclass_ca.enable()``, chosen by config.

torchtitan builds its trainer from the config a ``--module``/``--config`` function returns
(``Trainer.Config.build()`` constructs the class the config is nested in), so selecting this trainer is
returning :class:`Trainer.Config` instead of ``torchtitan.trainer.Trainer.Config`` (or
:func:`with_compiled_autograd` of a stock config), and running::

    python -m subclass_ca.integrations.torchtitan --module llama3 --config llama3_debugmodel [--section.key value ...]

which is torchtitan's ``train.py`` with a stock config converted to this trainer's (a config function that
returns this trainer's config already is used as is).  The config gains one section,
``compiled_autograd`` (:class:`CompiledAutogradConfig`): ``--compiled_autograd.no-enable`` turns the block
off (torchtitan's flags for booleans, as ``--compile.no-enable``), ``--compiled_autograd.backend NAME`` names
the CA graph's backend.  Left unset, the backend is
torchtitan's own ``compile.backend`` when ``compile.enable`` is on, else it follows the forwards (Note
[Defaults follow the user]).  The block wraps the stock ``forward_backward_step`` (pipeline-parallel steps
included) and nothing else: the optimizer step, checkpointing and validation run as torchtitan runs them.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torchtitan.trainer

import subclass_ca

__all__ = ["CompiledAutogradConfig", "Trainer", "block_config", "main", "parse_config", "with_compiled_autograd"]


@dataclass(kw_only=True, slots=True)
class CompiledAutogradConfig:
    """The ``compiled_autograd`` section of :class:`Trainer.Config`."""

    enable: bool = True
    """Run each forward-backward step inside ``subclass_ca.enable()``."""

    backend: str | None = None
    """The CA graph's backend.  None: torchtitan's ``compile.backend`` when ``compile.enable`` is on (the
    backend its forwards are compiled with), else the backend follows the forwards (``Config.backend=None``)."""


def block_config(compiled_autograd: CompiledAutogradConfig, compile_config: Any) -> subclass_ca.Config:
    """The ``enable()`` settings of a step: the backend named in ``compiled_autograd``, else torchtitan's compile
    backend (``compile_config``: its ``CompileConfig``) when compiling is on, else None (follow the forwards)."""
    backend = compiled_autograd.backend
    if backend is None and compile_config.enable:
        backend = compile_config.backend
    return subclass_ca.Config(backend=backend)


class Trainer(torchtitan.trainer.Trainer):
    """torchtitan's ``Trainer`` with each forward-backward step (forward, loss and ``backward()``) inside
    ``subclass_ca.enable()`` while ``config.compiled_autograd.enable``; otherwise exactly the stock trainer."""

    @dataclass(kw_only=True, slots=True)
    class Config(torchtitan.trainer.Trainer.Config):
        """torchtitan's trainer config plus the ``compiled_autograd`` section; ``build()`` makes this module's
        :class:`Trainer`."""

        compiled_autograd: CompiledAutogradConfig = field(default_factory=CompiledAutogradConfig)

    def forward_backward_step(
        self,
        *,
        input_dict: dict[str, torch.Tensor] | list[dict[str, torch.Tensor]],
        labels: torch.Tensor | list[torch.Tensor],
        global_valid_tokens: torch.Tensor,
    ) -> torch.Tensor:
        """The stock step, inside the block when enabled; the block is left on every exit, exceptions included.
        (A config without the section, a stock one set on this trainer by hand, counts as enabled.)"""
        step = {"input_dict": input_dict, "labels": labels, "global_valid_tokens": global_valid_tokens}
        compiled_autograd = getattr(self.config, "compiled_autograd", None) or CompiledAutogradConfig()
        if not compiled_autograd.enable:
            stock_loss: torch.Tensor = super().forward_backward_step(**step)
            return stock_loss
        with subclass_ca.enable(config=block_config(compiled_autograd, self.config.compile)):
            loss: torch.Tensor = super().forward_backward_step(**step)
        return loss


def with_compiled_autograd(config: Any, compiled_autograd: CompiledAutogradConfig | None = None) -> Trainer.Config:
    """A stock ``Trainer.Config`` (``config``, as a ``--config`` function returns it) as this trainer's config,
    field by field (the same section objects, not copies), with the ``compiled_autograd`` section added;
    a config of this trainer already is returned as is."""
    if isinstance(config, Trainer.Config):
        return config
    sections = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    return Trainer.Config(**sections, compiled_autograd=compiled_autograd or CompiledAutogradConfig())


def parse_config(argv: Sequence[str]) -> Trainer.Config:
    """torchtitan's command line (``--module``, ``--config``, ``--section.key value`` ...) parsed as torchtitan's
    ``ConfigManager`` parses it, against the loaded config converted to :class:`Trainer.Config`, so the
    ``compiled_autograd`` flags parse too.  The conversion hooks ``ConfigManager._load_config`` (the step that
    calls the ``--config`` function), the one place between loading and parsing; tested at the pinned release."""
    from torchtitan.config import ConfigManager

    class ManagerOfThisTrainer(ConfigManager):
        """ConfigManager whose loaded config is this trainer's: torchtitan's own parsing, defaults and checks."""

        def _load_config(self, args: list[str]) -> tuple[object, list[str]]:
            loaded, rest = super()._load_config(args)
            return with_compiled_autograd(loaded), rest

    config: Trainer.Config = ManagerOfThisTrainer().parse_args(list(argv))
    return config


def main(argv: Sequence[str] | None = None) -> None:
    """``torchtitan/train.py``'s ``main`` with this trainer: ``python -m subclass_ca.integrations.torchtitan``.

    torchtitan's own ``main`` runs (logging, build, train, close, process-group teardown), handed the config
    :func:`parse_config` made through the ``ConfigManager`` name it looks up, restored on every exit."""
    import torchtitan.train

    arguments = sys.argv[1:] if argv is None else list(argv)
    config = parse_config(arguments)

    class ConfigManagerWithThisTrainer:
        """What ``torchtitan.train.main`` asks for: a config manager whose ``parse_args()`` gives our config."""

        def parse_args(self, args: list[str] | None = None) -> Trainer.Config:
            return config

    stock_manager = torchtitan.train.ConfigManager
    torchtitan.train.ConfigManager = ConfigManagerWithThisTrainer
    try:
        torchtitan.train.main()
    finally:
        torchtitan.train.ConfigManager = stock_manager


if __name__ == "__main__":
    main()
