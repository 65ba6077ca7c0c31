"""Offline stand-ins for the parts of a torchtune config that would download something.

A stock recipe instantiates every ``_component_`` of its config by dotted path, so the tests' YAML points the
tokenizer, dataset and checkpointer here; the model is torchtune's own builder (QLoRA) or
:func:`two_tensor_llama2` (torchtune's Llama2 with wrapper-subclass weights).  Everything is seeded: two runs of one
config start from the same weights and see the same batches.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.testing._internal.two_tensor import TwoTensor

FINAL_WEIGHTS = "final_weights.pt"
"""The file :class:`SeededCheckpointer` writes the trained weights to, under its ``output_dir``."""


class TinyTokenizer:
    """What the recipes read from a tokenizer: ``pad_id`` (the collate function pads with it)."""

    pad_id = 0


def token_dataset(tokenizer: TinyTokenizer, *, vocab_size: int, samples: int, seq_len: int, seed: int) -> list[dict[str, list[int]]]:
    """``samples`` seeded token sequences of ``seq_len`` (labels = tokens, as an SFT dataset gives them)."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randint(1, vocab_size, (samples, seq_len), generator=generator)
    return [{"tokens": row.tolist(), "labels": row.tolist()} for row in rows]


def two_tensor_llama2(**llama2_kwargs: Any) -> nn.Module:
    """torchtune's own Llama2 (``torchtune.models.llama2.llama2``) with every weight a :class:`TwoTensor`
    parameter (inner tensors ``w`` and ``2 * w``): its activations, loss and gradients are TwoTensors, so the
    CA graph of each backward rebuilds TwoTensor gradients (``subclass_nodes``).  Every weight, not some: a
    plain weight would get a TwoTensor gradient, which an optimizer cannot apply to it."""
    from torchtune.models.llama2 import llama2

    model = llama2(**llama2_kwargs)
    for module in model.modules():
        for name, weight in list(module.named_parameters(recurse=False)):
            data = weight.detach()
            setattr(module, name, nn.Parameter(TwoTensor(data.clone(), data * 2.0)))
    return model


def plain_tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """``state``'s tensors as plain tensors: a wrapper subclass (TwoTensor) becomes its inner tensors
    (``name.a``, ``name.b``), so the file loads anywhere and compares element by element."""
    plain: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        if type(value) in (torch.Tensor, nn.Parameter):
            plain[name] = value.detach().clone()
        else:
            inner_names, _ = value.__tensor_flatten__()
            plain.update({f"{name}.{inner}": getattr(value, inner).detach().clone() for inner in inner_names})
    return plain


class SeededCheckpointer:
    """A checkpointer without files to read: "loads" the state dict of a model built by ``builder`` (dotted path)
    with ``builder_kwargs`` under ``seed``, and saves the trained weights (the final epoch's ``model``, or
    ``adapter`` when the recipe saves adapters only) to ``output_dir/final_weights.pt`` as plain tensors."""

    def __init__(self, output_dir: str, builder: str, builder_kwargs: dict[str, Any], seed: int,
                 should_load_recipe_state: bool = False) -> None:
        if should_load_recipe_state:
            raise ValueError("SeededCheckpointer has no recipe state to resume from")
        self.output_dir = Path(output_dir)
        self.builder = builder
        self.builder_kwargs = dict(builder_kwargs)
        self.seed = seed

    def load_checkpoint(self) -> dict[str, Any]:
        module_name, _, function_name = self.builder.rpartition(".")
        build = getattr(importlib.import_module(module_name), function_name)
        with torch.random.fork_rng():
            torch.manual_seed(self.seed)
            model = build(**self.builder_kwargs)
        return {"model": model.state_dict()}

    def save_checkpoint(self, state_dict: dict[str, Any], epoch: int, intermediate_checkpoint: bool = False,
                        **_: Any) -> None:
        if intermediate_checkpoint:
            return
        weights = state_dict["model"] if "model" in state_dict else state_dict["adapter"]
        self.output_dir.mkdir(parents=True, exist_ok=True)
        torch.save(plain_tensors(weights), self.output_dir / FINAL_WEIGHTS)
