"""Built-in handler for torch's reference ``TwoTensor`` (a pair of same-shape tensors)."""

from __future__ import annotations

from typing import Any

from .. import _compat
from ..registry import register_handler

TwoTensor = _compat.two_tensor_type()


def rebuild_two_tensor(inner: dict[str, Any], ctx: Any, outer_size: Any, outer_stride: Any) -> Any:
    """TwoTensor is its two inner tensors plus the outer size/stride; the context is empty."""
    return TwoTensor(inner["a"], inner["b"], outer_size, outer_stride)  # type: ignore[misc]


if TwoTensor is not None:
    register_handler(TwoTensor, rebuild=rebuild_two_tensor, metadata_key=lambda ctx: None)
