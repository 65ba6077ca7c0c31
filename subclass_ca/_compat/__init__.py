"""Every touch of torch private API lives in this package, feature-detected.

``FEATURES`` is the complete table of torch internals the runtime uses (``OPTIONAL_FEATURES``
those it can do without, with what degrades).  ``require_support()`` checks the table once
and turns a missing piece into one :class:`UnsupportedTorchError` naming it, raised by
``enable()`` before any backward runs.  One module per torch area holds the code that uses
those internals; a torch upgrade that moves one breaks there and in the table only.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any

import torch

from ..errors import UnsupportedTorchError
from . import (
    accumulate,
    aot_autograd,
    caches,
    compiled_autograd,
    ddp,
    dynamo,
    engine,
    fsdp,
    logs,
    messages,
    optimizer_tracing,
    precompile,
    tracing,
    version,
    workarounds,
)
from ._lookup import lookup
from ._patch import BLOCKS, CA_CAPTURE, CA_GRAPH_RUN, AnyScope, AttributeSwap, CallSwap, PatchSet, Scope, Swap, gated, uninstall_resident

# every area module's public names, re-exported: its own __all__ is the one list of what it offers (issue 63)
from .accumulate import *  # noqa: F403
from .aot_autograd import *  # noqa: F403
from .caches import *  # noqa: F403
from .compiled_autograd import *  # noqa: F403
from .ddp import *  # noqa: F403
from .ddp import DDP_CLASS  # (names this module's own code uses are imported by name too)
from .dynamo import *  # noqa: F403
from .engine import *  # noqa: F403
from .fsdp import *  # noqa: F403
from .fsdp import FSDP2_CA_DETECTION
from .logs import *  # noqa: F403
from .messages import *  # noqa: F403
from .optimizer_tracing import *  # noqa: F403
from .precompile import *  # noqa: F403
from .tracing import *  # noqa: F403
from .version import *  # noqa: F403
from .version import SUPPORTED_TORCH, TESTED_TORCH, TORCH_VERSION
from .workarounds import *  # noqa: F403

__all__ = [  # the facade: this module's own names, its area modules and helpers; then every area's own list
    "accumulate",
    "AnyScope",
    "AttributeSwap",
    "BLOCKS",
    "CA_CAPTURE",
    "CA_GRAPH_RUN",
    "CallSwap",
    "ddp",
    "FEATURES",
    "forget_support_check",
    "gated",
    "logs",
    "lookup",
    "messages",
    "missing_features",
    "missing_optional_features",
    "OPTIONAL_FEATURES",
    "PatchSet",
    "require_support",
    "Scope",
    "Swap",
    "torch_state_snapshot",
    "tracing",
    "uninstall_resident",
    "workarounds",
]
__all__ += accumulate.__all__
__all__ += aot_autograd.__all__
__all__ += caches.__all__
__all__ += compiled_autograd.__all__
__all__ += ddp.__all__
__all__ += dynamo.__all__
__all__ += engine.__all__
__all__ += fsdp.__all__
__all__ += logs.__all__
__all__ += messages.__all__
__all__ += optimizer_tracing.__all__
__all__ += precompile.__all__
__all__ += tracing.__all__
__all__ += version.__all__
__all__ += workarounds.__all__

FEATURES: dict[str, str | tuple[str, ...]] = {
    "compiled autograd entry point": compiled_autograd.CA_MODULE + ":_enable",
    "compiled autograd compiler instance": compiled_autograd.COMPILER_INSTANCE,
    "AOT backward proxy": compiled_autograd.COMPILER_INSTANCE + ".proxy_call_aot_backward",
    "compiled autograd cache reset": compiled_autograd.CA_MODULE + ":reset",
    "compiled autograd cache clear": "torch._C:_dynamo.compiled_autograd.clear_cache",
    "capture begin": compiled_autograd.COMPILER_INSTANCE + ".begin_capture",
    "capture end": compiled_autograd.COMPILER_INSTANCE + ".end_capture",
    "autograd compiler setter": "torch._C:_dynamo.compiled_autograd.set_autograd_compiler",
    "Dynamo stance": "torch._dynamo:eval_frame._stance",
    "compiled autograd counters": "torch._dynamo.utils:counters",
    "autograd function CA cache key": compiled_autograd.AUTOGRAD_FUNCTION_CTX + "._compiled_autograd_key",
    "AccumulateGrad call": "torch._dynamo.external_utils:call_accumulate_grad",
    "capture AccumulateGrad": compiled_autograd.COMPILER_INSTANCE + ".accumulate_grad",
    "CA hook call": compiled_autograd.HOOK_CALLS[0],
    "CA custom-Function backward call": compiled_autograd.HOOK_CALLS[1],
    "AOT backward module extraction": aot_autograd.BW_MODULE_EXTRACTION,
    "AOT subclass creation metadata": aot_autograd.SCHEMAS + ":SubclassCreationMeta",
    "AOT epilogue wrapper": aot_autograd.EPILOGUE_WRAPPER,
    "AOT backward epilogue": tuple(aot_autograd.EPILOGUES.values()),
    "proxy-mode suspension": "torch.fx.experimental.proxy_tensor:disable_proxy_modes_tracing",
    "fake-mode suspension": "torch._subclasses.fake_tensor:unset_fake_temporarily",
    "fake-mode detection": "torch._guards:detect_fake_mode",
    "allow_in_graph": "torch._dynamo:allow_in_graph",
    "dynamo disable": "torch._dynamo:disable",
    "dynamo exceptions": "torch._dynamo.exc:TorchDynamoException",
    "dynamo graph-break exception": "torch._dynamo.exc:Unsupported",
    "dynamo config": "torch._dynamo:config",
    "functorch config": "torch._functorch:config",
    "deferred tensor hooks (trace_wrapped)": dynamo.TRACE_WRAPPED,
    "deferred tensor hooks caller": dynamo.TRACE_WRAPPED_USERS[0] + ":trace_wrapped",
    "deferred module backward hooks caller": dynamo.TRACE_WRAPPED_USERS[2] + ":trace_wrapped",
    "traceable wrapper subclass protocol": "torch.utils._python_dispatch:is_traceable_wrapper_subclass",
    "autograd engine final callbacks": "torch.autograd:Variable._execution_engine.queue_callback",
    **{f"FSDP2 {name}": dotted for name, dotted in fsdp.FSDP2_TYPES.items() if name != "RegisterPreBackwardFunction"},
}
"""Name -> ``"module:attr.path"`` of every torch internal the runtime needs, or a tuple of alternatives
(any one present suffices; the code using them detects which, e.g. ``aot_autograd.epilogue_style()``)."""

OPTIONAL_FEATURES: dict[str, tuple[str, str]] = {
    "optimizer steps traced in a backward hook": (
        "torch.optim.optimizer:_use_grad_for_differentiable",
        "an optimizer step in a post-accumulate-grad hook needs graph breaks (enable(fullgraph=False))",
    ),
    "Dynamo's optimizer variable": (
        "torch._dynamo.variables.optimizer:OptimizerVariable",
        "an optimizer step in a post-accumulate-grad hook needs graph breaks (enable(fullgraph=False))",
    ),
    "Dynamo's variable trackers": (
        "torch._dynamo.variables.base:VariableTracker",
        "an optimizer step in a post-accumulate-grad hook needs graph breaks (enable(fullgraph=False))",
    ),
    "Dynamo's constant and tensor variables": (
        "torch._dynamo.variables.constant:ConstantVariable",
        "an optimizer step in a post-accumulate-grad hook needs graph breaks (enable(fullgraph=False))",
    ),
    "Dynamo's tensor variable": (
        "torch._dynamo.variables.tensor:TensorVariable",
        "an optimizer step in a post-accumulate-grad hook needs graph breaks (enable(fullgraph=False))",
    ),
    "DDP all-reduce bucketing": (
        ddp.DDP_BUCKETING,
        "a DDP module under enable() all-reduces each gradient on its own (one collective per parameter)",
    ),
    "DDP all-reduce bucketing under aot_eager": (
        f"{ddp.DDP_FUSION}:_fuse_allreduce",
        "a DDP module under enable(backend='aot_eager') all-reduces each gradient on its own",
    ),
    "lazy FX graph modules": (
        tracing.LAZY_GRAPH_MODULES,
        "regional pieces generate their code twice when the graph is cut (a slower first backward)",
    ),
    "AccumulateGrad placeholder allocation": (
        compiled_autograd.COMPILER_INSTANCE + ".allocate_dummy_like",
        "none: torch without it gives a capture no placeholder .grad (AccumulateGrad assigns .grad in the graph)",
    ),
    "FSDP2 RegisterPreBackwardFunction": (
        fsdp.FSDP2_TYPES["RegisterPreBackwardFunction"],
        "none: torch without it runs FSDP2's pre-backward as a tensor hook only, recognised by its bound FSDPState",
    ),
    "compiled autograd verbose logger": (
        "torch._C:_dynamo.compiled_autograd.set_verbose_logger",
        "capture reports cannot say why a backward missed compiled autograd's cache",
    ),
    "Dynamo allowed-callable ids": (
        "torch._dynamo.trace_rules:_allowed_callable_ids",
        "benchmarks cannot count allow_in_graph growth",
    ),
    "fake-tensor grad context check": (
        "torch._subclasses.meta_utils:_grad_context_compatible",
        "the pytorch#186427 workaround is not applied (its probe finds nothing to fix)",
    ),
    "fake-tensor meta conversion": (
        "torch._subclasses.meta_utils:MetaConverter.meta_tensor",
        "the torch 2.14/2.15 static-context workaround is not applied",
    ),
    "Dynamo attribute source": (
        "torch._dynamo.source:AttrSource",
        "the torch 2.14/2.15 static-context and the .grad-dtype fakeification workarounds are not applied",
    ),
    "fake-tensor conversion": (
        "torch._subclasses.fake_tensor:FakeTensorConverter.from_real_tensor",
        "the .grad-dtype fakeification workaround is not applied (a leaf whose .grad has another dtype fails at capture)",
    ),
    "AOT plain tensor metadata": (
        "torch._functorch._aot_autograd.schemas:PlainTensorMeta",
        "the torch 2.14/2.15 static-context workaround is not applied",
    ),
    "symbolic contexts": (
        "torch.fx.experimental.symbolic_shapes:SubclassSymbolicContext",
        "the torch-side workarounds are not applied",
    ),
    "Dynamo frame compiler": (
        dynamo.FRAME_COMPILER + ".__call__",
        "a torch.compile-d optimizer step over plain parameters with subclass gradients is not refused on "
        "torch 2.14/2.15, where torch computes it wrong",
    ),
    "AOTAutogradCache key pickler": (
        caches.CACHE_PICKLER + "._format_global_for_cache_key",
        "CA graphs bypass AOTAutogradCache (a restarted job traces them again; Note [Warm start through torch's caches])",
    ),
    "Dynamo precompile records": (
        precompile.PRECOMPILE_PARTS["package"],
        "a restarted job traces each CA graph through Dynamo again before the caches hit "
        "(Note [Skipping Dynamo's trace of an unchanged CA graph])",
    ),
    "DDP Python reducer": (
        DDP_CLASS + "._register_accum_grad_hook",
        "a DistributedDataParallel module with its C++ reducer fails inside enable() with torch's error "
        "(set torch._dynamo.config.optimize_ddp='python_reducer' before building it)",
    ),
    "AOTAutogradCache key function": (
        caches.AOT_CACHE_KEY,
        "save_cache() writes no forward entry of a forward with a wrapper-subclass input (its key could not "
        "describe the subclass's code; Note [Keys by behaviour])",
    ),
    "AOTAutogradCache bypass": (
        "torch._functorch._aot_autograd.autograd_cache:BypassAOTAutogradCache",
        "a graph without a behaviour key fails its compile instead of bypassing torch's cache (Note [Keys by behaviour])",
    ),
    "fake tensor type": (
        "torch._subclasses.fake_tensor:FakeTensor",
        "no behaviour key can check a traced constant for fake values: every CA graph is compiled in every process",
    ),
    "FSDP2 compiled-autograd detection (2.11)": (
        FSDP2_CA_DETECTION,
        "nothing to do: FSDP2 from 2.12 on has no compiled-autograd mode",
    ),
    "aten tracing on fake tensors": (
        "torch.fx.experimental.proxy_tensor:make_fx",
        "no CA graph and no subclass-input forward is reused across processes (no behaviour key; Note [Keys by behaviour])",
    ),
    "AOT lazy backward compiler": (
        "torch._functorch._aot_autograd.runtime_wrappers:_AutogradBackwardCompiler.get_or_compile",
        "save_cache() cannot write the cache entries of forwards whose backward ran under compiled autograd",
    ),
    "compile timers": (
        "torch._dynamo.utils:compilation_time_metrics",
        "the warm-start bench cannot split a first step into its compile phases",
    ),
    "inductor cache folder": (
        "torch._inductor.runtime.cache_dir_utils:cache_dir",
        "save_cache() without a path and the Dynamo traces of CA graphs kept for a restart (both in torch's cache folder) are unavailable",
    ),
    "inductor config": ("torch._inductor:config", "benchmarks cannot switch off the FX-graph cache when timing compiles"),
    "Dynamo run-only frames": (
        dynamo.SET_EVAL_FRAME,
        "regional pieces are entered through torch.compile's wrapper at every step (Note [Regional CA graphs], steady)",
    ),
    "Dynamo global-state guard": (
        dynamo.GLOBAL_STATE_GUARD,
        "regional pieces are entered through torch.compile's wrapper at every step (Note [Regional CA graphs], steady)",
    ),
    "Dynamo stance": (
        dynamo.STANCE + ".stance",
        "regional pieces are entered through torch.compile's wrapper at every step (Note [Regional CA graphs], steady)",
    ),
    "reference TwoTensor": (
        "torch.testing._internal.two_tensor:TwoTensor",
        "no built-in TwoTensor handler; the probe for a recycled .grad symbolic context finds nothing to fix",
    ),
    "inductor compiled output": (
        aot_autograd.INDUCTOR_OUTPUT,
        "none: enable() without a backend follows a forward it cannot name with torch.compile's default, inductor",
    ),
    "aot_eager forward compiler": (
        aot_autograd.AOT_EAGER_COMPILER,
        "enable() without a backend compiles the backward of an aot_eager forward with inductor "
        "(Note [Defaults follow the user] in config.py)",
    ),
    "TORCH_LOGS registry": (
        logs.LOG_REGISTRY,
        "TORCH_LOGS=subclass_ca still works (torch's module-name rule) but is not listed by TORCH_LOGS=help",
    ),
    "compile ids": (
        logs.COMPILE_ID,
        "subclass_ca's TORCH_TRACE entries are not filed with the CA graph they describe",
    ),
    "structured trace": (
        logs.STRUCTURED_TRACE,
        "a TORCH_TRACE run holds no subclass_ca entries (CA graphs, cache misses, warm-start hits, trust refusals)",
    ),
    "Dynamo local source": (
        "torch._dynamo.source:LocalSource",
        "the probe for a recycled .grad symbolic context (torch without _grad_context_compatible) finds nothing to fix",
    ),
}
"""Name -> (dotted path, what degrades without it)."""


def _one_path(name: str) -> str:
    """The dotted path of a feature that has exactly one (not a tuple of alternatives)."""
    path = FEATURES[name]
    if not isinstance(path, str):
        raise TypeError(f"feature {name!r} has alternatives {path!r}: look it up through the table, not by one path")
    return path


def _signature_problems() -> list[str]:
    problems = []
    params = tuple(inspect.signature(lookup(_one_path("AOT backward proxy"))).parameters)
    if not all(p in params for p in compiled_autograd.AOT_BACKWARD_PARAMS):
        problems.append(f"AOT backward proxy signature (got {params})")
    if "make_subclass_override" not in inspect.signature(lookup(_one_path("AOT epilogue wrapper"))).parameters:
        problems.append("make_subclass_override parameter of wrap_tensor_subclasses")
    init_params = inspect.signature(lookup(_one_path("compiled autograd compiler instance")).__init__).parameters
    if "compiler_fn" not in init_params:
        problems.append("compiler_fn parameter of AutogradCompilerInstance")
    fields = getattr(lookup(_one_path("AOT subclass creation metadata")), "__dataclass_fields__", {})
    problems += [f"SubclassCreationMeta.{f}" for f in aot_autograd.CREATION_META_FIELDS if f not in fields]
    return problems


def _present(dotted: str) -> bool:
    try:
        lookup(dotted)
    except (ImportError, AttributeError):
        return False
    return True


@functools.cache
def missing_features() -> tuple[str, ...]:
    """The torch internals subclass_ca needs that this torch lacks (``name (module:attr)``)."""
    missing = []
    for name, dotted in FEATURES.items():
        alternatives = (dotted,) if isinstance(dotted, str) else dotted
        if not any(_present(candidate) for candidate in alternatives):
            missing.append(f"{name} ({' or '.join(alternatives)})")
    if not missing:
        missing += _signature_problems()
    return tuple(missing)


def missing_optional_features() -> dict[str, str]:
    """Optional internals this torch lacks -> what degrades."""
    missing = {}
    for name, (dotted, degrades) in OPTIONAL_FEATURES.items():
        try:
            lookup(dotted)
        except (ImportError, AttributeError):
            missing[f"{name} ({dotted})"] = degrades
    return missing


_warned_untested: set[str] = set()
_supported: str | None = None
"""The torch version already checked (``require_support`` then costs one identity check)."""


def forget_support_check() -> None:
    """Check the feature table again on the next ``require_support()`` (tests that remove features)."""
    global _supported
    _supported = None
    missing_features.cache_clear()


def require_support() -> None:
    """Raise :class:`UnsupportedTorchError` unless every needed internal exists; warn once on an untested torch."""
    global _supported
    if _supported is TORCH_VERSION:
        return
    version.require_minimum(TORCH_VERSION)
    missing = missing_features()
    if missing:
        raise UnsupportedTorchError(
            f"subclass_ca supports torch {SUPPORTED_TORCH}; torch {TORCH_VERSION} lacks: "
            + "; ".join(missing)
            + ". Install a supported torch (e.g. pip install torch==2.15.0) or file an issue naming this torch version."
        )
    found = TORCH_VERSION
    if not version.is_tested(found) and found not in _warned_untested:
        _warned_untested.add(found)
        warnings.warn(
            f"subclass_ca: torch {found} is untested (tested: {', '.join(TESTED_TORCH)}); every torch internal "
            "subclass_ca needs is present, so it runs. Compare a few steps against eager before trusting it.",
            stacklevel=3,
        )
    _supported = found


def _effective(value: Any) -> Any:
    """What a call of ``value`` runs: torch's original for a resident gate outside its scope."""
    if isinstance(value, dict):
        return {key: _effective(item) for key, item in value.items()}
    scope = getattr(value, "__subclass_ca_gate__", None)
    if scope is not None and not scope.depth:
        return value.__subclass_ca_original__
    return value


def torch_state_snapshot(*, effective: bool = True) -> dict[str, Any]:
    """Everything ``enable()`` may touch, for exact before/after comparisons in tests.

    ``effective``: a resident gate outside its scope shows as the torch original it calls
    (Note [Resident patches]); ``False`` shows the objects themselves (exact after ``reset()``).
    """
    state = _raw_torch_state()
    return {key: _effective(value) for key, value in state.items()} if effective else state


def _raw_torch_state() -> dict[str, Any]:
    compiler_cls = lookup(_one_path("compiled autograd compiler instance"))
    return {
        "dynamo_config": dynamo.dynamo_config_snapshot(),
        "functorch_config": dynamo.functorch_config_snapshot(),
        "compiled_autograd": compiled_autograd.compiled_autograd_state(),
        "autograd_compiler": compiled_autograd.autograd_compiler(),
        "multithreading": torch._C._is_multithreading_enabled(),
        "proxy_call_aot_backward": compiler_cls.__dict__["proxy_call_aot_backward"],
        "begin_capture": compiler_cls.__dict__["begin_capture"],
        "end_capture": compiler_cls.__dict__["end_capture"],
        "ca_enable": lookup(compiled_autograd.CA_MODULE + ":_enable"),
        "allow_in_graph": lookup("torch._dynamo:allow_in_graph"),
        "autograd_function_ca_key": lookup(compiled_autograd.AUTOGRAD_FUNCTION_CTX).__dict__["_compiled_autograd_key"],
        "trace_wrapped": {m: lookup(m + ":trace_wrapped") for m in dynamo.TRACE_WRAPPED_USERS},
        "grad_context_compatible": getattr(lookup("torch._subclasses:meta_utils"), "_grad_context_compatible", None),
        "fake_from_real_tensor": lookup("torch._subclasses.fake_tensor:FakeTensorConverter").__dict__.get("from_real_tensor"),
        "module_level_epilogue": getattr(lookup(aot_autograd.RUNTIME_WRAPPERS), "_backward_epilogue_functional", None),
        "execution_engine": engine.execution_engine(),
        "verbose_logger": compiled_autograd.ca_verbose_log(),
        "grad_enabled": torch.is_grad_enabled(),
    }
