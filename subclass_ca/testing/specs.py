"""Ready-made :class:`SubclassSpec` entries: the reference zoo and the built-in handlers' types.

``ZOO_SPECS`` certifies every zoo subclass (TaggedTensor with a second tag, so
``metadata_change`` runs).  :func:`builtin_specs` adds the subclasses subclass_ca ships
handlers for: torch's ``TwoTensor`` and ``DTensor`` (on a 1-rank in-process gloo group,
built on first use; see :func:`one_rank_mesh`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

import subclass_ca

from . import subclasses
from .suite import SubclassSpec

__all__ = ["ZOO_SPECS", "DTENSOR_KNOWN_FAILURES", "builtin_specs", "one_rank_mesh", "dtensor_spec"]

ZOO_SPECS: dict[str, SubclassSpec] = {
    "pair": SubclassSpec(make_tensor=subclasses.make_pair),
    "nested_pair": SubclassSpec(make_tensor=subclasses.make_nested_pair),
    "int8": SubclassSpec(make_tensor=subclasses.make_int8),
    "chunked": SubclassSpec(make_tensor=subclasses.make_chunked),
    "tagged": SubclassSpec(
        make_tensor=subclasses.make_tagged, make_variant=functools.partial(subclasses.make_tagged, tag="v2")
    ),
}
"""name -> spec for every entry of :data:`subclasses.ZOO`."""


def one_rank_mesh() -> Any:
    """A 1-D DeviceMesh over a 1-rank gloo group in this process (created once; no ports).

    Raises ``RuntimeError`` when torch.distributed is unavailable.
    """
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this torch build")
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        # HashStore is public (documented in torch.distributed) but not re-exported explicitly for type checkers
        store = dist.HashStore()  # type: ignore[attr-defined]
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    if dist.get_world_size() != 1:
        raise RuntimeError(f"one_rank_mesh needs a 1-rank process group, this one has {dist.get_world_size()} ranks")
    return init_device_mesh("cpu", (1,))


DTENSOR_KNOWN_FAILURES = {
    "dynamic_batch": "torch 2.13: stock compiled autograd fails the same way when a DTensor's batch size "
    "changes between backwards (SymInt 'is not tracked with proxy')",
}


def dtensor_spec(mesh: Any) -> SubclassSpec:
    """DTensor on ``mesh``: Replicate tensors, Shard(0) as the metadata variant, Replicate neighbours."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    def replicate(dense: torch.Tensor) -> Any:
        return distribute_tensor(dense, mesh, [Replicate()])

    def shard(dense: torch.Tensor) -> Any:
        return distribute_tensor(dense, mesh, [Shard(0)])

    return SubclassSpec(
        make_tensor=replicate, make_variant=shard, make_plain=replicate, known_failures=DTENSOR_KNOWN_FAILURES
    )


def _two_tensor_spec() -> SubclassSpec | None:
    # found through the registry (public API): the built-in handler registers torch's TwoTensor
    TwoTensor = next((cls for cls in subclass_ca.handlers() if cls.__name__ == "TwoTensor"), None)
    if TwoTensor is None:
        return None
    return SubclassSpec(make_tensor=lambda dense: TwoTensor(dense.clone(), dense * 2.0))


class _LazyDTensorFactory:
    """Builds the 1-rank mesh only when the first DTensor is made (keeps imports cheap)."""

    def __init__(self, attr: str) -> None:
        self.attr = attr

    def __call__(self, dense: torch.Tensor) -> Any:
        return getattr(_dtensor_on_one_rank(), self.attr)(dense)


@functools.lru_cache(maxsize=1)
def _dtensor_on_one_rank() -> SubclassSpec:
    return dtensor_spec(one_rank_mesh())


def builtin_specs() -> dict[str, SubclassSpec]:
    """Specs for the subclasses subclass_ca ships handlers for (those this torch provides)."""
    specs: dict[str, SubclassSpec] = {}
    two_tensor = _two_tensor_spec()
    if two_tensor is not None:
        specs["two_tensor"] = two_tensor
    try:
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor  # noqa: F401
    except ImportError:
        return specs
    if dist.is_available():
        specs["dtensor"] = SubclassSpec(
            make_tensor=_LazyDTensorFactory("make_tensor"),
            make_variant=_LazyDTensorFactory("make_variant"),
            make_plain=_LazyDTensorFactory("make_plain"),
            known_failures=DTENSOR_KNOWN_FAILURES,
        )
    return specs
