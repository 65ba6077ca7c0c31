"""Built-in handler for ``torch.distributed.tensor.DTensor``.

A DTensor gradient is its local shard plus its mesh, placements and global shape/stride.
The rebuild goes through DTensor's own protocol with the mesh passed at run time and the
global outer size/stride from the AOT metadata; the metadata key covers placements, global
shape/stride, dtype and shard order, so a change of layout gets its own recipe.
"""

from __future__ import annotations

from typing import Any

from ..registry import register_handler

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed
    DTensor = None  # type: ignore[assignment,misc]


def dtensor_metadata_key(ctx: Any) -> Any:
    """(placements, global shape, stride, dtype, shard order, requires_grad) from the flatten context.

    torch 2.13 flattens a DTensor as inner ``_local_tensor`` + ``device_mesh`` (an opaque
    inner value, passed to the node at run time) and a context ``(placements, tensor_meta,
    shard_order, requires_grad)``; older releases used ``(spec, requires_grad)``.
    """
    if len(ctx) == 2:  # (DTensorSpec, requires_grad)
        spec, requires_grad = ctx
        placements, meta, shard_order = spec.placements, spec.tensor_meta, getattr(spec, "shard_order", None)
        mesh = spec.mesh
    else:
        placements, meta, shard_order, requires_grad = ctx
        mesh = None
    shape = tuple(meta.shape) if meta is not None else None
    stride = tuple(meta.stride) if meta is not None else None
    dtype = meta.dtype if meta is not None else None
    return (mesh, tuple(placements), shape, stride, dtype, _hashable(shard_order), requires_grad)


def _hashable(value: Any) -> Any:
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


def rebuild_dtensor(inner: dict[str, Any], ctx: Any, outer_size: Any, outer_stride: Any) -> Any:
    """Rebuild with the captured mesh and placements through DTensor's own protocol."""
    # torch leaves DTensor.__tensor_unflatten__ unannotated
    return DTensor.__tensor_unflatten__(inner, ctx, outer_size, outer_stride)  # type: ignore[no-untyped-call]


if DTensor is not None:
    register_handler(DTensor, rebuild=rebuild_dtensor, metadata_key=dtensor_metadata_key)
