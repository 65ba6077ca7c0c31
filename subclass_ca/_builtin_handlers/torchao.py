"""Built-in handler for torchao's ``NF4Tensor`` (optional: ``pip install 'subclass_ca[torchao]'``).

Registered lazily: torchao is never imported by subclass_ca; the handler is registered the
first time an NF4Tensor reaches a capture.  NF4's flatten context is a dict (unhashable);
the key lists the parts that change the rebuilt tensor.
"""

from __future__ import annotations

from typing import Any

from ..registry import defer_registration, register_handler

NF4_QUALNAME = "torchao.quantization.quantize_.workflows.nf4.nf4_tensor.NF4Tensor"


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


def _register_nf4() -> None:
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor

    register_handler(NF4Tensor, metadata_key=nf4_metadata_key, replace=True)


defer_registration(NF4_QUALNAME, _register_nf4)
