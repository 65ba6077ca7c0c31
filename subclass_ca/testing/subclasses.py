"""The reference subclass zoo: small, honest wrapper subclasses for certification.

Each implements the traceable wrapper subclass protocol (``__tensor_flatten__`` /
``__tensor_unflatten__``) and a ``__torch_dispatch__`` small enough to read:

* :class:`PairTensor` — two same-shape inner tensors; every op runs on both (TwoTensor-like).
* :class:`Int8RowwiseTensor` — int8 data + float per-row scale.  An op whose tensor inputs
  are *all* Int8RowwiseTensor returns one (quantization-aware: results are requantized, so
  gradients of an all-int8 model are Int8RowwiseTensor); mixed inputs dequantize and return
  plain tensors (a frozen quantized weight in a float model).
* :class:`ChunkedTensor` — stored as two halves along dim 0: outer shape differs from the
  inner shapes (a sharded-like layout).  All-chunked inputs stay chunked.
* :class:`TaggedTensor` — one inner tensor plus a constant tag in the flatten context; the
  tag propagates, and changing it must recompile.
* a nested pair — ``PairTensor(PairTensor(...), PairTensor(...))`` (see :func:`make_nested_pair`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree

__all__ = [
    "PairTensor",
    "Int8RowwiseTensor",
    "ChunkedTensor",
    "TaggedTensor",
    "make_pair",
    "make_nested_pair",
    "make_int8",
    "make_chunked",
    "make_tagged",
    "ZOO",
]

_aten = torch.ops.aten

# Ops whose output is not a tensor of the input's layout (in-place/meta ops keep subclass semantics elsewhere).
_NON_TENSOR_RESULT_OPS = {_aten.is_same_size.default, _aten.equal.default}
# Allocation ops: the result is a fresh zero instance of the subclass (what AccumulateGrad needs).
_EMPTY_LIKE_OPS = {_aten.new_empty_strided.default, _aten.new_empty.default, _aten.empty_like.default,
                   _aten.new_zeros.default, _aten.zeros_like.default}


class PairTensor(torch.Tensor):
    """Two same-shape inner tensors ``a`` and ``b``; every op runs on both."""

    @staticmethod
    def __new__(cls, a: torch.Tensor, b: torch.Tensor, outer_size: Any = None, outer_stride: Any = None) -> PairTensor:
        if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
            raise ValueError(f"PairTensor needs same shape/dtype/device, got {a.shape}/{b.shape}")
        size = a.size() if outer_size is None else outer_size
        stride = a.stride() if outer_stride is None else outer_stride
        return torch.Tensor._make_wrapper_subclass(
            cls, size, strides=stride, storage_offset=a.storage_offset(), dtype=a.dtype, device=a.device, layout=a.layout
        )

    def __init__(self, a: torch.Tensor, b: torch.Tensor, outer_size: Any = None, outer_stride: Any = None) -> None:
        self.a = a
        self.b = b

    def __repr__(self) -> str:  # type: ignore[override]  # torch's untyped Tensor.__repr__: mypy rejects even a matching override
        return f"PairTensor({self.a!r}, {self.b!r})"

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["a", "b"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], ctx: Any, outer_size: Any, outer_stride: Any) -> PairTensor:
        return PairTensor(inner["a"], inner["b"], outer_size, outer_stride)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]  # torch's stubs type Tensor.__torch_dispatch__ as a plain function; the protocol is this classmethod
        kwargs = kwargs or {}
        args_a = pytree.tree_map_only(PairTensor, lambda t: t.a, args)
        args_b = pytree.tree_map_only(PairTensor, lambda t: t.b, args)
        kwargs_a = pytree.tree_map_only(PairTensor, lambda t: t.a, kwargs)
        kwargs_b = pytree.tree_map_only(PairTensor, lambda t: t.b, kwargs)
        out_a = func(*args_a, **kwargs_a)
        out_b = func(*args_b, **kwargs_b)
        flat_a, spec = pytree.tree_flatten(out_a)
        flat_b = pytree.tree_leaves(out_b)
        if func._schema.is_mutable or func in _NON_TENSOR_RESULT_OPS:
            return out_a if func in _NON_TENSOR_RESULT_OPS else args[0]
        wrapped = [
            PairTensor(x, y) if isinstance(x, torch.Tensor) else x for x, y in zip(flat_a, flat_b)
        ]
        return pytree.tree_unflatten(wrapped, spec)


class _DenseBacked(torch.Tensor):
    """Shared dispatch for zoo tensors that compute on a dense view of themselves.

    All-same-type tensor inputs: the result is converted back (``from_dense`` with the first
    input's context).  Mixed inputs: the result is plain.
    """

    if TYPE_CHECKING:  # every zoo tensor defines the traceable wrapper subclass protocol
        def __tensor_flatten__(self) -> tuple[list[str], Any]: ...

        @staticmethod
        def __tensor_unflatten__(inner: dict[str, torch.Tensor], ctx: Any, outer_size: Any, outer_stride: Any) -> Any: ...

    def to_dense(self, dtype: torch.dtype | None = None, *, masked_grad: bool | None = None) -> torch.Tensor:
        """The dense value (``Tensor.to_dense``'s signature: ``dtype`` converts it; ``masked_grad`` is for sparse)."""
        dense = self._dense()
        return dense if dtype is None else dense.to(dtype)

    def _dense(self) -> torch.Tensor:
        raise NotImplementedError

    @classmethod
    def from_dense(cls, dense: torch.Tensor, like: Any) -> Any:
        raise NotImplementedError

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]  # torch's stubs type Tensor.__torch_dispatch__ as a plain function; the protocol is this classmethod
        kwargs = kwargs or {}
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        like = next(t for t in tensors if isinstance(t, cls))
        same_type = all(isinstance(t, cls) for t in tensors)
        if func is _aten.detach.default or func is _aten.alias.default:
            return cls.from_parts(like)
        if func in _EMPTY_LIKE_OPS:
            dense = func(like.to_dense(), *args[1:], **kwargs)
            return cls.from_dense(torch.zeros_like(dense), like)
        dense_args, dense_kwargs = pytree.tree_map_only(cls, lambda t: t.to_dense(), (args, kwargs))
        out = func(*dense_args, **dense_kwargs)
        if func._schema.is_mutable:
            # In-place on the dense copy, then write the converted result back into the inner tensors.
            target = args[0]
            if not isinstance(target, cls):
                raise NotImplementedError(f"{cls.__name__}: in-place {func} into a plain tensor is not supported")
            rebuilt = cls.from_dense(dense_args[0], target)
            for name in target.__tensor_flatten__()[0]:
                getattr(target, name).copy_(getattr(rebuilt, name))
            return target
        if not same_type or func in _NON_TENSOR_RESULT_OPS:
            return out
        return pytree.tree_map_only(
            torch.Tensor, lambda t: cls.from_dense(t, like) if t.is_floating_point() and cls.accepts(t) else t, out
        )

    @classmethod
    def accepts(cls, dense: torch.Tensor) -> bool:
        return True

    @classmethod
    def from_parts(cls, like: Any) -> Any:
        names, ctx = like.__tensor_flatten__()
        return cls.__tensor_unflatten__({n: getattr(like, n) for n in names}, ctx, like.size(), like.stride())


class Int8RowwiseTensor(_DenseBacked):
    """Row-wise int8 quantization: ``dense = data.float() * scale`` (``scale`` is ``[rows, 1]``)."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, outer_size: Any = None, outer_stride: Any = None) -> Any:
        if data.dtype != torch.int8:
            raise ValueError(f"Int8RowwiseTensor data must be int8, got {data.dtype}")
        size = data.size() if outer_size is None else outer_size
        stride = data.stride() if outer_stride is None else outer_stride
        return torch.Tensor._make_wrapper_subclass(
            cls, size, strides=stride, dtype=scale.dtype, device=data.device, layout=data.layout
        )

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, outer_size: Any = None, outer_stride: Any = None) -> None:
        self.data_int8 = data
        self.scale = scale

    def __repr__(self) -> str:  # type: ignore[override]  # torch's untyped Tensor.__repr__: mypy rejects even a matching override
        return f"Int8RowwiseTensor(shape={tuple(self.shape)}, scale_dtype={self.scale.dtype})"

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["data_int8", "scale"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], ctx: Any, outer_size: Any, outer_stride: Any) -> Any:
        return Int8RowwiseTensor(inner["data_int8"], inner["scale"], outer_size, outer_stride)

    @classmethod
    def quantize(cls, dense: torch.Tensor) -> Int8RowwiseTensor:
        """Quantize a 1-D or 2-D float tensor row-wise (symmetric, 127 levels)."""
        rows = dense.reshape(dense.shape[0], -1) if dense.dim() > 1 else dense.reshape(1, -1)
        scale = rows.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127.0
        data = torch.round(rows / scale).clamp(-127, 127).to(torch.int8)
        if dense.dim() <= 1:
            return cls(data.reshape(dense.shape), scale.reshape(1) if dense.dim() == 1 else scale.reshape(()))
        return cls(data.reshape(dense.shape), scale.reshape(dense.shape[0], *([1] * (dense.dim() - 1))))

    def _dense(self) -> torch.Tensor:
        return self.data_int8.to(self.scale.dtype) * self.scale

    @classmethod
    def accepts(cls, dense: torch.Tensor) -> bool:
        return dense.dim() >= 1

    @classmethod
    def from_dense(cls, dense: torch.Tensor, like: Any) -> Any:
        return cls.quantize(dense)


class ChunkedTensor(_DenseBacked):
    """Stored as ``top`` and ``bottom`` halves along dim 0: the outer shape is their concatenation."""

    @staticmethod
    def __new__(cls, top: torch.Tensor, bottom: torch.Tensor, outer_size: Any = None, outer_stride: Any = None) -> Any:
        if top.shape[1:] != bottom.shape[1:]:
            raise ValueError(f"ChunkedTensor halves must agree past dim 0, got {top.shape} and {bottom.shape}")
        size = (top.shape[0] + bottom.shape[0], *top.shape[1:]) if outer_size is None else tuple(outer_size)
        stride = torch.empty(size, device="meta").stride() if outer_stride is None else tuple(outer_stride)
        return torch.Tensor._make_wrapper_subclass(
            cls, size, strides=stride, dtype=top.dtype, device=top.device, layout=top.layout
        )

    def __init__(self, top: torch.Tensor, bottom: torch.Tensor, outer_size: Any = None, outer_stride: Any = None) -> None:
        self.top = top
        self.bottom = bottom

    def __repr__(self) -> str:  # type: ignore[override]  # torch's untyped Tensor.__repr__: mypy rejects even a matching override
        return f"ChunkedTensor(shape={tuple(self.shape)}, halves={tuple(self.top.shape)}+{tuple(self.bottom.shape)})"

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["top", "bottom"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], ctx: Any, outer_size: Any, outer_stride: Any) -> Any:
        return ChunkedTensor(inner["top"], inner["bottom"], outer_size, outer_stride)

    @classmethod
    def halve(cls, dense: torch.Tensor) -> ChunkedTensor:
        """``dense`` stored as its two halves along dim 0 (the top one gets the odd row)."""
        half = (dense.shape[0] + 1) // 2
        return cls(dense[:half].clone(), dense[half:].clone())

    def _dense(self) -> torch.Tensor:
        return torch.cat([self.top, self.bottom], dim=0)

    @classmethod
    def accepts(cls, dense: torch.Tensor) -> bool:
        return dense.dim() >= 1 and dense.shape[0] >= 2

    @classmethod
    def from_dense(cls, dense: torch.Tensor, like: Any) -> Any:
        return cls.halve(dense)


class TaggedTensor(_DenseBacked):
    """One inner tensor plus a constant ``tag`` (non-tensor flatten context) that propagates."""

    @staticmethod
    def __new__(cls, elem: torch.Tensor, tag: Any, outer_size: Any = None, outer_stride: Any = None) -> Any:
        size = elem.size() if outer_size is None else outer_size
        stride = elem.stride() if outer_stride is None else outer_stride
        return torch.Tensor._make_wrapper_subclass(
            cls, size, strides=stride, storage_offset=elem.storage_offset(), dtype=elem.dtype, device=elem.device
        )

    def __init__(self, elem: torch.Tensor, tag: Any, outer_size: Any = None, outer_stride: Any = None) -> None:
        self.elem = elem
        self.tag = tag

    def __repr__(self) -> str:  # type: ignore[override]  # torch's untyped Tensor.__repr__: mypy rejects even a matching override
        return f"TaggedTensor({self.elem!r}, tag={self.tag!r})"

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["elem"], self.tag

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], ctx: Any, outer_size: Any, outer_stride: Any) -> Any:
        return TaggedTensor(inner["elem"], ctx, outer_size, outer_stride)

    def _dense(self) -> torch.Tensor:
        return self.elem

    @classmethod
    def from_dense(cls, dense: torch.Tensor, like: Any) -> Any:
        return cls(dense, like.tag)


# --- factories: plain tensor -> zoo tensor ---------------------------------------


def make_pair(dense: torch.Tensor) -> PairTensor:
    """A PairTensor whose halves differ (``b = 2a``), so mixing them up is visible."""
    return PairTensor(dense.clone(), dense * 2.0)


def make_nested_pair(dense: torch.Tensor) -> PairTensor:
    """A pair of pairs: four distinct inner tensors."""
    return PairTensor(make_pair(dense), make_pair(dense * -0.5))


def make_int8(dense: torch.Tensor) -> Int8RowwiseTensor:
    return Int8RowwiseTensor.quantize(dense)


def make_chunked(dense: torch.Tensor) -> ChunkedTensor:
    return ChunkedTensor.halve(dense)


def make_tagged(dense: torch.Tensor, tag: Any = "v1") -> TaggedTensor:
    return TaggedTensor(dense.clone(), tag)


#: name -> factory(dense) for every zoo subclass
ZOO: dict[str, Any] = {
    "pair": make_pair,
    "nested_pair": make_nested_pair,
    "int8": make_int8,
    "chunked": make_chunked,
    "tagged": make_tagged,
}
