"""Built-in handler for torchao's ``NF4Tensor`` (optional: ``pip install 'subclass_ca[torchao]'``).

Registered lazily: torchao is never imported by subclass_ca; the handler is registered the
first time an NF4Tensor reaches a capture.  NF4's flatten context is a dict (unhashable);
the key lists the parts that change the rebuilt tensor.

The supported torchao releases (0.15 to 0.18, the ``torchao`` extra) keep NF4Tensor in two
modules (:data:`NF4_MODULES`); a deferred registration waits on each, and the one this torchao
has is the one that fires.  The class and its flatten context are the same in both.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

from ..registry import defer_registration, register_handler

NF4_MODULES: tuple[str, ...] = (
    "torchao.quantization.quantize_.workflows.nf4.nf4_tensor",  # torchao 0.18
    "torchao.dtypes.nf4tensor",  # torchao 0.15-0.17 (torchtune 0.6's torchao)
)
"""Where each supported torchao defines ``NF4Tensor``, newest first."""

NF4_QUALNAMES: tuple[str, ...] = tuple(f"{module}.NF4Tensor" for module in NF4_MODULES)


def nf4_metadata_key(ctx: Any) -> Any:
    meta = ctx["tensor_meta"]
    return (
        ctx["block_size"],
        ctx["n_blocks"],
        ctx["scaler_block_size"],
        tuple(meta.original_shape),
        tuple(meta.original_strides),
        meta.storage_offset,
        meta.dtype,
        str(meta.device),
        meta.requires_grad,
    )


def _register_nf4(module_name: str) -> None:
    nf4_tensor = importlib.import_module(module_name).NF4Tensor
    register_handler(nf4_tensor, metadata_key=nf4_metadata_key, replace=True)


for _module_name in NF4_MODULES:
    defer_registration(f"{_module_name}.NF4Tensor", functools.partial(_register_nf4, _module_name))
del _module_name
