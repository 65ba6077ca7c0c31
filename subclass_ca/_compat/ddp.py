"""DistributedDataParallel's reducers: the C++ one compiled autograd refuses, the Python one it needs.

Note [DDP under compiled autograd] in ``subclass_ca/_ddp.py`` says what we do with them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ._lookup import lookup
from ._patch import AttributeSwap

__all__ = ["is_reducer_hook", "reducer_module", "DDP_CLASS", "DDP_PARTS", "ddp_supported", "pre_forward_swap", "uses_python_reducer", "to_python_reducer",
           "to_cpp_reducer", "ddp_features", "DDP_BUCKETING", "bucket_size_mb", "bucketing_options", "bucketing_aot_eager"]

DDP_CLASS = "torch.nn.parallel:DistributedDataParallel"
_DDP_MODULE = "torch.nn.parallel.distributed"
"""Where DDP's Python reducer defines the post-accumulate-grad hook it registers per parameter."""
DDP_PARTS = ("_pre_forward", "_register_accum_grad_hook", "_ddp_init_helper", "_build_params_for_reducer",
             "_build_debug_param_to_name_mapping")
"""The methods switching a module's reducer calls (it also reads ``_use_python_reducer`` and ``_accum_grad_hooks``)."""
DDP_BUCKETING = "torch._inductor:config._fuse_ddp_communication"
DDP_BUCKET_SIZE = "torch._inductor:config._fuse_ddp_bucket_size"
DDP_BUCKETING_PASSES = "torch._inductor:config._fuse_ddp_communication_passes"
COALESCE_PASS = "fuse_ddp_with_coalesced_op"
WAIT_PASS = "schedule_comm_wait"
DDP_FUSION = "torch._inductor.fx_passes.ddp_fusion"
AOT_EAGER = "torch._dynamo.backends.debugging:aot_eager"
BOXED_NOP = "torch._dynamo.backends.debugging:boxed_nop"
DETECT_FAKE_MODE = "torch._guards:detect_fake_mode"
SET_FAKE_MODE = "torch._inductor.virtualized:V.set_fake_mode"
"""Inductor's passes bucketing the Python reducer's all-reduces, their bucket size in MB, and aot_eager's pieces that
let those passes run there too (Note [Bucketing the Python reducer's all-reduces] in ``subclass_ca/_ddp.py``)."""
_MB = 1024 * 1024


def is_reducer_hook(hook: Any) -> bool:
    """A post-accumulate-grad hook DDP's Python reducer registered: it all-reduces ``.grad`` and never writes the
    parameter (a ``functools.partial`` of a function defined in DDP's module)."""
    return getattr(_hook_function(hook), "__module__", None) == _DDP_MODULE


def _hook_function(hook: Any) -> Any:
    """The function a hook calls, under any ``functools.partial`` (DDP's reducer binds the parameter's index so)."""
    while isinstance(hook, functools.partial):
        hook = hook.func
    return hook


def reducer_module(hook: Any) -> Any:
    """The DDP module whose Python reducer registered ``hook`` (:func:`is_reducer_hook`), None for any other hook: the
    hook's function closes over the module it all-reduces for, so a CA graph learns its bucket size from its own hooks
    (Note [Bucketing the Python reducer's all-reduces] in ``subclass_ca/_ddp.py``)."""
    if not is_reducer_hook(hook):
        return None
    function = _hook_function(hook)
    try:
        ddp = lookup(DDP_CLASS)
    except (ImportError, AttributeError):
        return None
    for cell in getattr(function, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, ddp):
            return value
    return None


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


def bucket_size_mb(module: Any) -> int:
    """``module``'s DDP bucket size in whole MB (its ``bucket_cap_mb``; 25, DDP's default, where it has none)."""
    cap = getattr(module, "bucket_bytes_cap", None)
    return max(1, round(cap / _MB)) if isinstance(cap, int) and cap > 0 else 25


def bucketing_options(size_mb: int) -> dict[str, Any]:
    """Inductor options that bucket the Python reducer's all-reduces by ``size_mb``, as torch's ``python_reducer``
    mode sets them process-wide when it builds a DDP module; ``{}`` where this torch's inductor has no such pass."""
    try:
        for dotted in (DDP_BUCKETING, DDP_BUCKET_SIZE, DDP_BUCKETING_PASSES, f"{DDP_FUSION}:{COALESCE_PASS}"):
            lookup(dotted)
    except (ImportError, AttributeError):
        return {}
    return {DDP_BUCKETING.rpartition(".")[2]: True, DDP_BUCKET_SIZE.rpartition(".")[2]: size_mb,
            DDP_BUCKETING_PASSES.rpartition(".")[2]: [COALESCE_PASS, WAIT_PASS]}


def _reducer_block(block: Any) -> bool:
    """A Python reducer's all-reduce in an AOT graph that no inductor pass has touched: its input divides the
    gradient by the world size, and its result only reaches the gradient's copy (a functional ``copy``, which
    inductor's own filter, written for its post-grad graphs, does not know) or the graph's output."""
    import torch

    aten = torch.ops.aten
    source = block.comm_node.args[0]
    if getattr(source, "target", None) is not aten.div.Tensor or len(block.wait_nodes) != 1:
        return False
    users = list(block.wait_nodes[0].users)
    return len(users) == 1 and (users[0].op == "output" or users[0].target in (aten.copy.default, aten.copy_.default))


def bucketing_aot_eager(size_mb: int) -> Callable[..., Any] | None:
    """torch's ``aot_eager`` backend with inductor's bucketing (coalesced all-reduces by ``size_mb``, waits at first
    use) run on its graph before the op-by-op run; None where this torch lacks a piece of it."""
    try:
        fusion = lookup(DDP_FUSION)
        parts = [getattr(fusion, name) for name in ("get_all_comm_blocks", "_bucket_size_fusion", "_fuse_allreduce", WAIT_PASS)]
        aot_eager = lookup(AOT_EAGER)
        boxed_nop = lookup(BOXED_NOP)
        fake_mode_of = lookup(DETECT_FAKE_MODE)
        set_fake_mode = lookup(SET_FAKE_MODE)
    except (ImportError, AttributeError):
        return None
    comm_blocks, buckets, fuse, schedule_waits = parts

    def bucketing_nop(graph_module: Any, example_inputs: Any) -> Any:
        import torch

        graph = graph_module.graph
        all_reduces = (torch.ops._c10d_functional.all_reduce.default, torch.ops._c10d_functional.all_reduce_.default)
        blocks = comm_blocks(graph, all_reduces, comm_filter=_reducer_block)
        if blocks:
            order = {node: index for index, node in enumerate(graph.nodes)}
            with set_fake_mode(fake_mode_of(example_inputs)):  # the fused nodes' metadata, as inductor computes it
                for bucket in buckets(graph, blocks, size_mb):
                    fuse(graph, bucket, order, use_concat=False)
            schedule_waits(graph)
            graph_module.recompile()
        return boxed_nop(graph_module, example_inputs)

    def aot_eager_bucketing(graph_module: Any, example_inputs: Any, **kwargs: Any) -> Any:
        return aot_eager(graph_module, example_inputs, fw_compiler=bucketing_nop, **kwargs)

    return aot_eager_bucketing
