"""Deliberately broken subclasses: the testing kit must fail on them, naming the scenario.

Also a ``--module`` for ``python -m subclass_ca check`` (it exposes ``SUBCLASS_CA_FACTORIES``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from subclass_ca.testing import SubclassSpec
from subclass_ca.testing.subclasses import Int8RowwiseTensor, TaggedTensor


class ScaleDroppingInt8(Int8RowwiseTensor):
    """Int8RowwiseTensor whose ``__tensor_unflatten__`` drops its scale (rebuilds with ones).

    Eager never unflattens, so eager is right; every compiled rebuild is wrong.
    """

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["data_int8", "scale"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], ctx: Any, outer_size: Any, outer_stride: Any) -> Any:
        return ScaleDroppingInt8(inner["data_int8"], torch.ones_like(inner["scale"]), outer_size, outer_stride)


class TagForgettingTensor(TaggedTensor):
    """TaggedTensor whose ``__tensor_unflatten__`` ignores the context (always tag "v1").

    Right as long as the tag is "v1": only a metadata change exposes it.
    """

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], ctx: Any, outer_size: Any, outer_stride: Any) -> Any:
        return TagForgettingTensor(inner["elem"], "v1", outer_size, outer_stride)

    @classmethod
    def from_parts(cls, like: Any) -> Any:
        # eager detach/alias keep the tag (the zoo's default goes through __tensor_unflatten__)
        return cls(like.elem, like.tag, like.size(), like.stride())


def make_scale_dropping(dense: torch.Tensor) -> ScaleDroppingInt8:
    return ScaleDroppingInt8.quantize(dense)


def make_tag_forgetting(dense: torch.Tensor, tag: str = "v1") -> TagForgettingTensor:
    return TagForgettingTensor(dense.clone(), tag)


TAG_FORGETTING_SPEC = SubclassSpec(
    make_tensor=make_tag_forgetting, make_variant=functools.partial(make_tag_forgetting, tag="v2")
)

SUBCLASS_CA_FACTORIES = {
    "scale_dropping_int8": make_scale_dropping,
    "tag_forgetting": TAG_FORGETTING_SPEC,
}
