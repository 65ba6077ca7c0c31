"""Built-in handler for ``torch.distributed.tensor.DTensor``.

A DTensor gradient is its local shard plus a ``DTensorSpec`` (mesh, placements, global
shape/stride).  The rebuild keeps the spec from capture and the global outer size/stride
from the AOT metadata; the metadata key is (mesh, placements, global shape, stride), so a
change of layout gets its own graph node.
"""

from __future__ import annotations

from typing import Any

from ..registry import register_handler

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed
    DTensor = None  # type: ignore[assignment,misc]


def dtensor_metadata_key(ctx: Any) -> Any:
    spec, requires_grad = ctx
    meta = spec.tensor_meta
    shape = tuple(meta.shape) if meta is not None else None
    stride = tuple(meta.stride) if meta is not None else None
    return (spec.mesh, tuple(spec.placements), shape, stride, requires_grad)


def rebuild_dtensor(inner: dict[str, Any], ctx: Any, outer_size: Any, outer_stride: Any) -> Any:
    """Rebuild with the captured mesh and placements through DTensor's own protocol."""
    return DTensor.__tensor_unflatten__(inner, ctx, outer_size, outer_stride)  # type: ignore[union-attr]


if DTensor is not None:
    register_handler(DTensor, rebuild=rebuild_dtensor, metadata_key=dtensor_metadata_key)
