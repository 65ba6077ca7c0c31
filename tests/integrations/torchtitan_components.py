"""A torchtitan config registry for the tests: torchtitan's llama3 debug model, trained offline.

torchtitan's own ``llama3_debugmodel`` reads its tokenizer and its ``c4_test`` dataset from the torchtitan
repository's ``tests/assets``, which the wheel does not ship; these configs keep its model, optimizer, loss and
schedule and swap in a seeded token stream.  ``--module tests.integrations.torchtitan_components --config
tiny_debugmodel`` selects one, as any config registry is selected (the GPU check does).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.trainer import Trainer

from subclass_ca.integrations.torchtitan import with_compiled_autograd

VOCAB_SIZE = 2048
"""The debug model's vocabulary."""


class CountingTokenizer(BaseTokenizer):
    """What the trainer reads from a tokenizer (its vocabulary size and ``eos_id``); it never encodes text here."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = VOCAB_SIZE

    def __init__(self, config: Config, *, tokenizer_path: str | None = None, **_: Any) -> None:
        super().__init__()
        self.vocab_size = config.vocab_size
        self.eos_id = 0

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        raise NotImplementedError("the seeded dataloader yields token ids")

    def decode(self, *args: Any, **kwargs: Any) -> str:
        raise NotImplementedError("the seeded dataloader yields token ids")

    def get_vocab_size(self) -> int:
        return self.vocab_size


class SeededTokenLoader(BaseDataLoader):
    """Endless seeded batches ``({"input": tokens, "positions": positions}, labels)`` of ``local_batch_size`` x
    ``seq_len``: what torchtitan's text dataloaders yield (labels the next tokens, one document per row)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        seed: int = 0

    def __init__(self, config: Config, *, tokenizer: BaseTokenizer, seq_len: int, local_batch_size: int,
                 dp_rank: int = 0, **_: Any) -> None:
        self.vocab_size = tokenizer.get_vocab_size()
        self.shape = (local_batch_size, seq_len + 1)
        self.seed = config.seed + dp_rank
        self.batches_served = 0

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        generator = torch.Generator().manual_seed(self.seed)
        while True:
            sequence = torch.randint(1, self.vocab_size, self.shape, generator=generator)
            self.batches_served += 1
            positions = torch.arange(self.shape[1] - 1).expand(self.shape[0], -1).clone()
            yield {"input": sequence[:, :-1], "positions": positions}, sequence[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {"batches_served": self.batches_served}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.batches_served = state_dict["batches_served"]


def tiny_debugmodel() -> Trainer.Config:
    """torchtitan's ``llama3_debugmodel`` (the stock trainer's config) at a short sequence, seeded and
    deterministic, reading the seeded token stream; no checkpoint, no validation."""
    config = llama3_debugmodel()
    config.tokenizer = CountingTokenizer.Config()
    config.dataloader = SeededTokenLoader.Config()
    config.training.local_batch_size = 2
    config.training.seq_len = 64
    config.training.steps = 4
    config.checkpoint.enable = False
    config.validator.enable = False
    config.debug.seed = 0
    config.debug.deterministic = True
    return config


def tiny_debugmodel_with_compiled_autograd() -> Trainer.Config:
    """:func:`tiny_debugmodel` selecting ``subclass_ca.integrations.torchtitan.Trainer``: what a user's config
    function returns to train under the block."""
    return with_compiled_autograd(tiny_debugmodel())
