"""torchtune: a stock recipe run under ``subclass_ca.enable()``, without copying it.

``python -m subclass_ca.integrations.torchtune RECIPE --config CONFIG [key=value ...]`` is
``tune run RECIPE --config CONFIG [key=value ...]`` with the recipe's every backward captured by compiled
autograd: it hands the arguments to torchtune's own command line (the ``tune`` console script's
``TuneCLIParser``), so recipe and config names resolve exactly as ``tune run`` resolves them, and
``tune run`` runs a single-device recipe in this process (``runpy``), inside the block.  :func:`run` is the
same thing as a function.

The CA graph's backend is torchtune's own compile setting: its recipes compile with
``TORCH_COMPILE_BACKEND`` (``torchtune.training.compile_model``, inductor when unset), so that variable, when
set, names the backend here too; unset, the backend follows the forwards (Note [Defaults follow the user]).

``tune run --nproc_per_node N`` (any torchrun option) starts worker processes that would run outside the
block, so it is refused; ``torchrun --nproc_per_node N -m subclass_ca.integrations.torchtune RECIPE ...``
starts the workers instead, each running the recipe in-process under the block.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Sequence
from dataclasses import replace

from torch.distributed.run import get_args_parser as torchrun_args_parser
from torchtune._cli.tune import TuneCLIParser  # the `tune` console script's parser (`tune = torchtune._cli.tune:main`)

import subclass_ca

__all__ = ["TorchrunOptionsError", "block_config", "main", "run", "torchrun_refusal"]

BACKEND_VARIABLE = "TORCH_COMPILE_BACKEND"
"""The environment variable torchtune's recipes compile with (``torchtune.training.compile_model``/``compile_loss``)."""

ENTRY_POINT = "python -m subclass_ca.integrations.torchtune"


class TorchrunOptionsError(ValueError):
    """``tune run`` was given torchrun options: its workers would run outside ``subclass_ca.enable()``."""


def run(argv: Sequence[str], *, config: subclass_ca.Config | None = None) -> None:
    """Run ``tune run *argv`` (a recipe, ``--config`` and overrides) in this process, inside ``subclass_ca.enable()``.

    ``config`` sets the block (default: ``subclass_ca.Config()``); a config without a backend takes
    ``TORCH_COMPILE_BACKEND`` when it is set (:func:`block_config`).  Returns when the recipe finishes (its
    ``sys.exit(None)``/``sys.exit(0)`` included); any other exit or exception propagates, the block left first.
    ``sys.argv`` is restored afterwards (``tune run`` rewrites it for the recipe).
    """
    arguments = list(argv)
    refusal = torchrun_refusal(arguments)
    if refusal is not None:
        raise TorchrunOptionsError(refusal)
    saved_argv = sys.argv
    sys.argv = ["tune", "run", *arguments]  # what `tune run` reads: its parser and its distributed-launch check
    try:
        cli = TuneCLIParser()
        parsed = cli.parse_args()
        with subclass_ca.enable(config=block_config(config)):
            cli.run(parsed)
    except SystemExit as finished:
        if finished.code not in (None, 0):  # recipes end with sys.exit(recipe_main()): None on success
            raise
    finally:
        sys.argv = saved_argv


def block_config(config: subclass_ca.Config | None = None) -> subclass_ca.Config:
    """The ``enable()`` settings for a recipe: ``config`` (default ``Config()``), its backend, when it names none,
    taken from ``TORCH_COMPILE_BACKEND`` (torchtune's compile backend) if that is set, else left to follow the
    forwards."""
    config = subclass_ca.Config() if config is None else config
    backend = os.environ.get(BACKEND_VARIABLE)
    if config.backend is None and backend:
        return replace(config, backend=backend)
    return config


def torchrun_refusal(argv: Sequence[str]) -> str | None:
    """Why ``tune run *argv`` cannot run under the block (torchrun options before the recipe), with the command
    that can; None when it can.  Options before the recipe are torchrun's, exactly ``tune run``'s own rule."""
    if not argv or not argv[0].startswith("-") or argv[0] in ("-h", "--help"):
        return None
    launch = torchrun_args_parser().parse_args(list(argv))
    recipe_and_args = [launch.training_script, *launch.training_script_args]
    torchrun_options = list(argv[: len(argv) - len(recipe_and_args)])
    command = shlex.join(["torchrun", *torchrun_options, "-m", "subclass_ca.integrations.torchtune", *recipe_and_args])
    return (
        f"torchrun options ({shlex.join(torchrun_options)}) make `tune run` start worker processes, which would run "
        f"outside subclass_ca.enable(); start the workers with torchrun instead, each running the recipe under the "
        f"block:\n  {command}"
    )


def main(argv: Sequence[str] | None = None) -> None:
    """The command line: ``python -m subclass_ca.integrations.torchtune`` followed by ``tune run``'s arguments."""
    arguments = sys.argv[1:] if argv is None else list(argv)
    try:
        run(arguments)
    except TorchrunOptionsError as refused:
        raise SystemExit(f"{ENTRY_POINT}: error: {refused}") from None


if __name__ == "__main__":
    main()
