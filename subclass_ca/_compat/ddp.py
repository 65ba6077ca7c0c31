"""DistributedDataParallel's reducers: the C++ one compiled autograd refuses, the Python one it needs.

Note [DDP under compiled autograd] in ``subclass_ca/_ddp.py`` says what we do with them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._lookup import lookup
from ._patch import AttributeSwap

__all__ = ["DDP_CLASS", "DDP_PARTS", "ddp_supported", "pre_forward_swap", "uses_python_reducer", "to_python_reducer",
           "to_cpp_reducer", "ddp_features", "DDP_BUCKETING", "bucketing_options"]

DDP_CLASS = "torch.nn.parallel:DistributedDataParallel"
DDP_PARTS = ("_pre_forward", "_register_accum_grad_hook", "_ddp_init_helper", "_build_params_for_reducer",
             "_build_debug_param_to_name_mapping")
"""The methods switching a module's reducer calls (it also reads ``_use_python_reducer`` and ``_accum_grad_hooks``)."""
DDP_BUCKETING = "torch._inductor:config._fuse_ddp_communication"
DDP_BUCKET_SIZE = "torch._inductor:config._fuse_ddp_bucket_size"
DDP_BUCKETING_PASSES = "torch._inductor:config._fuse_ddp_communication_passes"
"""Inductor's pass bucketing the Python reducer's all-reduces, and its bucket size in MB (Note [Bucketing the
Python reducer's all-reduces] in ``subclass_ca/_ddp.py``)."""
_MB = 1024 * 1024


def ddp_supported() -> bool:
    try:
        cls = lookup(DDP_CLASS)
    except (ImportError, AttributeError):
        return False
    return all(callable(getattr(cls, name, None)) for name in DDP_PARTS)


def pre_forward_swap(before: Callable[[Any], None]) -> AttributeSwap:
    """``DistributedDataParallel._pre_forward`` calls ``before(module)`` first (never traced by Dynamo)."""
    def make(original: Any) -> Any:
        def _pre_forward(self: Any, *inputs: Any, **kwargs: Any) -> Any:
            before(self)
            return original(self, *inputs, **kwargs)

        _pre_forward.__subclass_ca_original__ = original  # type: ignore[attr-defined]
        return lookup("torch._dynamo:disable")(_pre_forward)

    return AttributeSwap(lambda: lookup(DDP_CLASS), "_pre_forward", make)


def uses_python_reducer(module: Any) -> bool:
    return bool(getattr(module, "_use_python_reducer", False))


def ddp_features(module: Any) -> list[str]:
    """The settings of ``module`` that torch's Python reducer does not implement."""
    found = []
    if getattr(module, "static_graph", False):
        found.append("static_graph=True")
    if getattr(module, "mixed_precision", None) is not None:
        found.append("mixed_precision=...")
    if getattr(module, "_delay_all_reduce_all_params", False) or getattr(module, "_delay_all_reduce_params", None):
        found.append("delay_all_reduce_named_params=...")
    return found


def to_python_reducer(module: Any) -> None:
    """Run ``module``'s gradient all-reduce through torch's Python reducer (post-accumulate hooks compiled autograd captures)."""
    module.reducer._remove_autograd_hooks()  # the C++ reducer's hooks, which compiled autograd refuses
    module._use_python_reducer = True
    module._register_accum_grad_hook()


def to_cpp_reducer(module: Any) -> None:
    """Undo :func:`to_python_reducer`: a fresh C++ reducer, as the module's constructor builds it."""
    for handle in module._accum_grad_hooks:
        handle.remove()
    module._accum_grad_hooks.clear()
    module._use_python_reducer = False
    parameters, expect_sparse_gradient = module._build_params_for_reducer()
    mapping = module._build_debug_param_to_name_mapping(parameters)
    module._ddp_init_helper(parameters, expect_sparse_gradient, mapping, module.static_graph)


def bucketing_options(module: Any) -> dict[str, Any]:
    """Inductor options that bucket ``module``'s all-reduces by its own bucket size, as torch's ``python_reducer``
    mode sets them process-wide when it builds a DDP module; ``{}`` where this torch's inductor has no such pass."""
    try:
        lookup(DDP_BUCKETING)
        lookup(DDP_BUCKET_SIZE)
        lookup(DDP_BUCKETING_PASSES)
    except (ImportError, AttributeError):
        return {}
    cap = getattr(module, "bucket_bytes_cap", None)
    size_mb = max(1, round(cap / _MB)) if isinstance(cap, int) and cap > 0 else lookup(DDP_BUCKET_SIZE)
    return {DDP_BUCKETING.rpartition(".")[2]: True, DDP_BUCKET_SIZE.rpartition(".")[2]: size_mb,
            DDP_BUCKETING_PASSES.rpartition(".")[2]: ["fuse_ddp_with_coalesced_op", "schedule_comm_wait"]}
