"""Every touch of torch private API lives here, feature-detected.

A torch upgrade that moves one of these pieces breaks in this module only, and
``require_support()`` turns the breakage into one :class:`UnsupportedTorchError`
naming the torch version and the missing piece (raised by ``enable()`` before any
backward runs).  See Note [How we hook the backward epilogue] in ``_capture.py``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .errors import UnsupportedTorchError

__all__ = [
    "TORCH_VERSION",
    "SUPPORTED_TORCH",
    "require_support",
    "missing_features",
]

TORCH_VERSION: str = torch.__version__
#: The torch versions this module has been written and tested against.
SUPPORTED_TORCH: str = ">=2.13,<2.14"

_AOT_BACKWARD_PARAMS = ("pinputs", "psaved_tensors", "saved_tensors", "pctx", "ctx")
_CREATION_META_FIELDS = (
    "flat_tensor_start_idx",
    "arg_count",
    "attrs",
    "outer_size",
    "outer_stride",
    "meta",
    "original_subclass_type",
)


def _lookup(dotted: str) -> Any:
    module_name, _, attr_path = dotted.partition(":")
    value: Any = sys.modules.get(module_name) or importlib.import_module(module_name)
    for part in attr_path.split(".") if attr_path else ():
        value = getattr(value, part)
    return value


_REQUIRED = {
    "compiled autograd entry point": "torch._dynamo.compiled_autograd:_enable",
    "compiled autograd compiler instance": "torch._dynamo.compiled_autograd:AutogradCompilerInstance",
    "AOT backward proxy": "torch._dynamo.compiled_autograd:AutogradCompilerInstance.proxy_call_aot_backward",
    "AOT backward module extraction": "torch._dynamo.compiled_autograd:extract_bw_module",
    "AOT subclass creation metadata": "torch._functorch._aot_autograd.schemas:SubclassCreationMeta",
    "AOT plain tensor metadata": "torch._functorch._aot_autograd.schemas:PlainTensorMeta",
    "AOT epilogue wrapper": "torch._functorch._aot_autograd.subclass_utils:wrap_tensor_subclasses",
    "proxy-mode suspension": "torch.fx.experimental.proxy_tensor:disable_proxy_modes_tracing",
    "fake-mode suspension": "torch._subclasses.fake_tensor:unset_fake_temporarily",
    "fake-mode detection": "torch._guards:detect_fake_mode",
    "allow_in_graph": "torch._dynamo:allow_in_graph",
    "dynamo disable": "torch._dynamo:disable",
    "traceable wrapper subclass protocol": "torch.utils._python_dispatch:is_traceable_wrapper_subclass",
    "dynamo counters": "torch._dynamo.utils:counters",
    "autograd function CA cache key": "torch.autograd.function:BackwardCFunction._compiled_autograd_key",
}


@functools.cache
def missing_features() -> tuple[str, ...]:
    """Names of the torch internals subclass_ca needs that this torch lacks."""
    missing = []
    for name, dotted in _REQUIRED.items():
        try:
            _lookup(dotted)
        except (ImportError, AttributeError):
            missing.append(f"{name} ({dotted})")
    if not missing:
        method = _lookup(_REQUIRED["AOT backward proxy"])
        params = tuple(inspect.signature(method).parameters)
        if not all(p in params for p in _AOT_BACKWARD_PARAMS):
            missing.append(f"AOT backward proxy signature (got {params})")
        epilogue_wrap = _lookup(_REQUIRED["AOT epilogue wrapper"])
        if "make_subclass_override" not in inspect.signature(epilogue_wrap).parameters:
            missing.append("make_subclass_override parameter of wrap_tensor_subclasses")
        meta_cls = _lookup(_REQUIRED["AOT subclass creation metadata"])
        fields = getattr(meta_cls, "__dataclass_fields__", {})
        missing += [f"SubclassCreationMeta.{f}" for f in _CREATION_META_FIELDS if f not in fields]
    return tuple(missing)


def require_support() -> None:
    """Raise :class:`UnsupportedTorchError` unless every needed internal exists."""
    missing = missing_features()
    if missing:
        raise UnsupportedTorchError(
            f"subclass_ca needs torch {SUPPORTED_TORCH}; torch {TORCH_VERSION} lacks: "
            + "; ".join(missing)
            + ". Install a supported torch (pip install torch==2.13.0) or file an issue "
            "naming this torch version."
        )


# --- compiled autograd -------------------------------------------------------


def compiled_autograd_module() -> Any:
    return _lookup("torch._dynamo.compiled_autograd")


def enable_compiled_autograd(compiler_fn: Callable[..., Any], *, dynamic: bool) -> Any:
    """torch's own context manager that routes ``backward()`` through compiled autograd."""
    return compiled_autograd_module()._enable(compiler_fn, dynamic=dynamic)


def compiled_autograd_state() -> dict[str, Any]:
    """Module-level compiled-autograd flags, for exact save/restore checks."""
    ca = compiled_autograd_module()
    return {
        name: getattr(ca, name)
        for name in ("compiled_autograd_enabled", "in_compiled_autograd_region", "depth")
        if hasattr(ca, name)
    }


def torch_state_snapshot() -> dict[str, Any]:
    """Everything ``enable()`` may touch, for exact before/after comparisons in tests."""
    setter = torch._C._dynamo.compiled_autograd.set_autograd_compiler
    prior = setter(None, False)
    setter(*prior)
    dynamo = importlib.import_module("torch._dynamo")
    compiler_cls = _lookup(_REQUIRED["compiled autograd compiler instance"])
    return {
        "dynamo_config": dynamo_config_snapshot(),
        "functorch_config": functorch_config_snapshot(),
        "compiled_autograd": compiled_autograd_state(),
        "autograd_compiler": prior,
        "multithreading": torch._C._is_multithreading_enabled(),
        "proxy_call_aot_backward": compiler_cls.__dict__["proxy_call_aot_backward"],
        "allow_in_graph": dynamo.allow_in_graph,
        "autograd_function_ca_key": _lookup("torch.autograd.function:BackwardCFunction").__dict__["_compiled_autograd_key"],
        "grad_enabled": torch.is_grad_enabled(),
    }


_CACHE_KEY_MARK = 0x5CA  # "subclass_ca" marker ahead of our token in an autograd function's CA key


@contextlib.contextmanager
def cache_key_token(token: int) -> Iterator[None]:
    """Append ``token`` to every custom autograd function's compiled-autograd cache key.

    Compiled autograd's graph cache is process-global and not keyed by the compiler: a
    graph captured by stock CA (or by an ``enable()`` with other settings) would otherwise be
    reused.  AOT backward nodes contribute ``ctx._compiled_autograd_key()`` (ints) to the
    cache key, so while this is active those nodes — and thus every graph that holds one —
    are cached separately per token.  Re-entrant: the innermost token applies.
    """
    ctx_cls = _lookup("torch.autograd.function:BackwardCFunction")
    original = ctx_cls.__dict__["_compiled_autograd_key"]

    def _compiled_autograd_key(ctx: Any) -> Any:
        # only the leading id is a static key (the rest are lifted as symints), so the token is
        # folded into it: a 62-bit hash of (function id, mark, token) fits C++'s ssize_t
        function_id, *rest = original(ctx)
        return (hash((function_id, _CACHE_KEY_MARK, token)) & ((1 << 62) - 1), *rest)

    ctx_cls._compiled_autograd_key = _compiled_autograd_key
    try:
        yield
    finally:
        ctx_cls._compiled_autograd_key = original


def clear_compiled_autograd_cache() -> None:
    """Drop compiled autograd's graph cache only (keeps the installed compiler and counters)."""
    torch._C._dynamo.compiled_autograd.clear_cache()


def reset_compiled_autograd() -> None:
    """Drop compiled autograd's graph cache (forces the next backward to recapture)."""
    compiled_autograd_module().reset()


def set_ca_verbose_logger(logger: Any) -> bool:
    """Give compiled autograd's C++ verbose logger (an object with ``.debug(msg)``; None: off).

    It is where torch reports *why* a backward missed the compiled-autograd cache.
    Returns False where this torch has no such hook.
    """
    setter = getattr(getattr(torch._C, "_dynamo", None), "compiled_autograd", None)
    setter = getattr(setter, "set_verbose_logger", None)
    if setter is None:
        return False
    setter(logger)
    return True


def ca_verbose_log() -> Any:
    """torch's own verbose compiled-autograd logger when the user enabled it (TORCH_LOGS), else None."""
    ca = compiled_autograd_module()
    enabled = getattr(ca, "snapshot_verbose_logging_enabled", None)
    if enabled is None or not enabled():
        return None
    return getattr(ca, "verbose_log", None)


def ca_counters() -> dict[str, int]:
    return dict(_lookup("torch._dynamo.utils:counters")["compiled_autograd"])


def allowed_callable_count() -> int | None:
    """Size of Dynamo's allow_in_graph id set (None where torch hides it)."""
    try:
        ids = _lookup("torch._dynamo.trace_rules:_allowed_callable_ids")
    except (ImportError, AttributeError):
        return None
    try:
        return len(ids())
    except TypeError:
        return len(ids)


def stock_compiled_autograd(compiler_fn: Callable[..., Any], *, dynamic: bool = True) -> Any:
    """torch's own compiled autograd with its stock epilogue (for benchmarks and comparisons)."""
    return compiled_autograd_module()._enable(compiler_fn, dynamic=dynamic)


def stock_ca_compiler(backend: Any, **compile_kwargs: Any) -> Callable[..., Any]:
    """The compiler_fn torch documents: ``lambda gm: torch.compile(gm, backend=..., fullgraph=True)``."""
    return lambda gm: torch.compile(gm, backend=backend, fullgraph=True, **compile_kwargs)


def is_stock_make_subclass(target: Any) -> bool:
    """True for the anonymous ``make_subclass`` closure stock CA emits per epilogue call."""
    return (
        getattr(target, "__name__", None) == "make_subclass"
        and getattr(target, "__module__", None) == "torch._dynamo.compiled_autograd"
    )


@functools.lru_cache(maxsize=8)
def _cached_signature(fn: Callable[..., Any]) -> inspect.Signature:
    return inspect.signature(fn)


class AotBackwardPatch:
    """Replace ``AutogradCompilerInstance.proxy_call_aot_backward`` with a wrapper.

    ``wrapper(original, compiler, ctx, call)`` gets the original method, the compiler
    instance, the autograd ctx of the AOT backward node and a zero-argument ``call``
    that runs the original with the same arguments.
    """

    def __init__(self, wrapper: Callable[..., Any]) -> None:
        self._wrapper = wrapper
        self._cls = _lookup(_REQUIRED["compiled autograd compiler instance"])
        self._original: Any = None

    def install(self) -> None:
        original = self._cls.__dict__["proxy_call_aot_backward"]
        signature = _cached_signature(original)  # install runs on every enable() entry: keep it cheap
        wrapper = self._wrapper

        @functools.wraps(original)
        def proxy_call_aot_backward(compiler: Any, *args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(compiler, *args, **kwargs)
            return wrapper(
                compiler, bound.arguments["ctx"], lambda: original(compiler, *args, **kwargs)
            )

        proxy_call_aot_backward.__subclass_ca_original__ = original  # type: ignore[attr-defined]
        self._original = original
        self._cls.proxy_call_aot_backward = proxy_call_aot_backward

    def uninstall(self) -> None:
        self._cls.proxy_call_aot_backward = self._original

    @staticmethod
    def current() -> Any:
        cls = _lookup(_REQUIRED["compiled autograd compiler instance"])
        return cls.__dict__["proxy_call_aot_backward"]


@contextlib.contextmanager
def swapped_epilogue(ctx: Any, make_epilogue: Callable[[Any], Any]) -> Iterator[None]:
    """Temporarily replace the AOT function's backward epilogue for one trace."""
    forward_cls = ctx._forward_cls
    original = forward_cls.__dict__.get("_bw_epilogue_fn")
    inherited = original is None
    if inherited:
        original = forward_cls._bw_epilogue_fn
    forward_cls._bw_epilogue_fn = make_epilogue(original)
    try:
        yield
    finally:
        if inherited:
            del forward_cls._bw_epilogue_fn
        else:
            forward_cls._bw_epilogue_fn = original


_stable_prologues: dict[tuple[int, ...], Any] = {}
_PROLOGUE_NAME = "call_aot_bwd_prologue"


@contextlib.contextmanager
def stable_prologue_callables() -> Iterator[None]:
    """Reuse one allow_in_graph prologue callable per AOT function across recaptures.

    Stock CA wraps a fresh ``call_aot_bwd_prologue`` closure in ``allow_in_graph`` on every
    capture, growing Dynamo's allowed-callable id set forever.  The closure only closes over
    the AOT function's constant ``_bw_prologue_fn``, so the first one is reused.
    """
    dynamo = importlib.import_module("torch._dynamo")
    original = dynamo.allow_in_graph

    def allow_in_graph(fn: Any) -> Any:
        if getattr(fn, "__name__", None) != _PROLOGUE_NAME or not getattr(fn, "__closure__", None):
            return original(fn)
        key = tuple(id(cell.cell_contents) for cell in fn.__closure__)
        cached = _stable_prologues.get(key)
        if cached is None:
            # keep the closure alive so the ids in the key can never be reused
            cached = _stable_prologues[key] = (original(fn), fn.__closure__)
        return cached[0]

    dynamo.allow_in_graph = allow_in_graph
    try:
        yield
    finally:
        dynamo.allow_in_graph = original


def has_subclass_grads(ctx: Any) -> bool:
    forward_cls = getattr(ctx, "_forward_cls", None)
    return getattr(forward_cls, "maybe_subclass_metadata", None) is not None


def aot_id(ctx: Any) -> Any:
    return getattr(ctx._forward_cls, "_aot_id", None)


def backward_output_examples(ctx: Any) -> list[Any] | None:
    """The AOT backward graph's output values (fake tensors/symints) recorded at trace time."""
    extract = _lookup(_REQUIRED["AOT backward module extraction"])
    try:
        bw_module = extract(ctx._forward_cls)
    except Exception:  # noqa: BLE001 - lazily compiled or cached backward: no graph
        return None
    graph = getattr(bw_module, "graph", None)
    if graph is None:
        return None
    output = next((n for n in graph.nodes if n.op == "output"), None)
    if output is None:
        return None
    values = []
    for arg in output.args[0]:
        if isinstance(arg, torch.fx.Node):
            if "val" not in arg.meta:
                return None
            values.append(arg.meta["val"])
        else:
            values.append(arg)
    return values


def creation_meta_types() -> tuple[type, type, type | None]:
    """(SubclassCreationMeta, PlainTensorMeta, OpaqueMeta or None)."""
    schemas = _lookup("torch._functorch._aot_autograd.schemas")
    return schemas.SubclassCreationMeta, schemas.PlainTensorMeta, getattr(schemas, "OpaqueMeta", None)


# --- tracing helpers ---------------------------------------------------------


def to_proxy(compiler: Any, value: Any) -> Any:
    return compiler.to_proxy(value)


def create_call_node(compiler: Any, target: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    return compiler.fx_tracer.create_proxy(
        kind="call_function", target=target, args=tuple(args), kwargs=kwargs
    )


def bind_dummy(compiler: Any, dummy: torch.Tensor, proxy: Any) -> None:
    compiler.bind_objects_to_proxies([dummy], [proxy])


@contextlib.contextmanager
def outside_tracing() -> Iterator[None]:
    """Suspend compiled autograd's proxy and fake modes (to run real/foreign-fake code)."""
    disable_proxy = _lookup("torch.fx.experimental.proxy_tensor:disable_proxy_modes_tracing")
    unset_fake = _lookup("torch._subclasses.fake_tensor:unset_fake_temporarily")
    with disable_proxy(), unset_fake():
        yield


@contextlib.contextmanager
def without_proxy_tracing() -> Iterator[None]:
    disable_proxy = _lookup("torch.fx.experimental.proxy_tensor:disable_proxy_modes_tracing")
    with disable_proxy():
        yield


def fake_mode_of(values: Sequence[Any]) -> Any:
    return _lookup("torch._guards:detect_fake_mode")(list(values))


def size_hint(value: Any) -> Any:
    """A concrete int for a SymInt (its hint); ints and None pass through."""
    if isinstance(value, torch.SymInt):
        return value.node.hint if value.node.has_hint() else value.node.require_hint()
    return value


def allow_in_graph(fn: Callable[..., Any]) -> Callable[..., Any]:
    return _lookup("torch._dynamo:allow_in_graph")(fn)


def dynamo_disable(fn: Callable[..., Any]) -> Callable[..., Any]:
    return _lookup("torch._dynamo:disable")(fn)


def is_traceable_wrapper_subclass(value: Any) -> bool:
    return bool(_lookup("torch.utils._python_dispatch:is_traceable_wrapper_subclass")(value))


def is_traceable_wrapper_subclass_type(cls: type) -> bool:
    checker = getattr(
        importlib.import_module("torch.utils._python_dispatch"),
        "is_traceable_wrapper_subclass_type",
        None,
    )
    if checker is not None:
        return bool(checker(cls))
    return hasattr(cls, "__tensor_flatten__") and hasattr(cls, "__tensor_unflatten__")


def dynamo_config_snapshot() -> dict[str, Any]:
    return dict(torch._dynamo.config.get_config_copy())


def functorch_config_snapshot() -> dict[str, Any]:
    return dict(_lookup("torch._functorch:config").get_config_copy())


def two_tensor_type() -> type | None:
    """torch's reference TwoTensor (lives in torch.testing._internal), or None."""
    try:
        return _lookup("torch.testing._internal.two_tensor:TwoTensor")
    except (ImportError, AttributeError):
        return None


def is_compile_failure(error: BaseException) -> bool:
    """True for errors Dynamo or a backend raise while *compiling* (nothing has run yet)."""
    exc = importlib.import_module("torch._dynamo.exc")
    return isinstance(error, exc.TorchDynamoException)


# --- autograd-engine final callbacks and FSDP2 hooks (Note [FSDP2 under compiled autograd], _fsdp2.py) ---

import threading as _threading  # noqa: E402  (kept beside its only users)

_engine_lock = _threading.Lock()
_engine_local = _threading.local()
_engine_swaps = 0
_engine_saved: Any = None
_collecting_engine: Any = None


def final_callback_redirect_problem() -> str | None:
    """Why engine final callbacks cannot be redirected on this torch (None: they can)."""
    holder = getattr(torch.autograd, "Variable", None)
    engine = getattr(holder, "_execution_engine", None)
    if engine is None or not callable(getattr(engine, "queue_callback", None)):
        return "torch.autograd.Variable._execution_engine.queue_callback is missing"
    try:
        type("_Probe", (type(engine),), {})
    except TypeError as error:
        return f"the autograd engine type {type(engine).__qualname__} cannot be subclassed ({error})"
    return None


def _engine_with_sink() -> Any:
    """One process-wide engine object that behaves as torch's, except ``queue_callback``.

    It subclasses torch's engine type (so Dynamo still recognises it) and routes
    ``queue_callback`` to the calling thread's sink while one is active.
    """
    global _collecting_engine
    if _collecting_engine is None:
        base = type(torch.autograd.Variable._execution_engine)

        def queue_callback(self: Any, callback: Callable[[], None]) -> None:
            sinks = getattr(_engine_local, "sinks", None)
            if sinks:
                sinks[-1].append(callback)
                return
            base.queue_callback(self, callback)

        cls = type("SubclassCACollectingEngine", (base,), {"queue_callback": queue_callback, "__module__": __name__})
        _collecting_engine = cls()
    return _collecting_engine


@contextlib.contextmanager
def collect_engine_callbacks(sink: list[Callable[[], None]]) -> Iterator[None]:
    """While active on this thread, ``Variable._execution_engine.queue_callback(cb)`` appends to ``sink``.

    torch 2.13's engine never runs final callbacks queued by eager code (hooks that
    Dynamo graph-breaks on) while a compiled-autograd graph runs; the caller runs them.
    """
    global _engine_swaps, _engine_saved
    holder = torch.autograd.Variable
    with _engine_lock:
        if _engine_swaps == 0:
            _engine_saved = holder.__dict__.get("_execution_engine", holder._execution_engine)
            holder._execution_engine = _engine_with_sink()
        _engine_swaps += 1
    sinks = getattr(_engine_local, "sinks", None)
    if sinks is None:
        sinks = _engine_local.sinks = []
    sinks.append(sink)
    try:
        yield
    finally:
        sinks.pop()
        with _engine_lock:
            _engine_swaps -= 1
            if _engine_swaps == 0:
                holder._execution_engine = _engine_saved
                _engine_saved = None


def execution_engine() -> Any:
    """The object ``torch.autograd.Variable._execution_engine`` currently holds."""
    return torch.autograd.Variable._execution_engine


@functools.cache
def fsdp2_types() -> dict[str, type]:
    """FSDP2's state and backward-hook Function classes on this torch ({} when absent)."""
    found: dict[str, type] = {}
    for name, dotted in (
        ("FSDPModule", "torch.distributed.fsdp:FSDPModule"),
        ("FSDPState", "torch.distributed.fsdp._fully_shard._fsdp_state:FSDPState"),
        ("RegisterPreBackwardFunction", "torch.distributed.fsdp._fully_shard._fsdp_state:RegisterPreBackwardFunction"),
        ("RegisterPostBackwardFunction", "torch.distributed.fsdp._fully_shard._fsdp_param_group:RegisterPostBackwardFunction"),
    ):
        try:
            found[name] = _lookup(dotted)
        except (ImportError, AttributeError):
            continue
    return found


def fsdp2_state_of_hook(hook: Any) -> Any:
    """The FSDP2 state or param group behind a compiled-autograd hook object, else None.

    FSDP2 registers its pre-backward as a bound ``FSDPState._pre_backward`` tensor hook and
    its post-backward as ``RegisterPostBackwardFunction`` (whose ctx carries ``param_group``).
    """
    types = fsdp2_types()
    state_cls = types.get("FSDPState")
    owner = getattr(hook, "__self__", None)
    if state_cls is not None and isinstance(owner, state_cls):
        return owner
    forward_cls = getattr(type(hook), "_forward_cls", None) or getattr(hook, "_forward_cls", None)
    for name in ("RegisterPostBackwardFunction", "RegisterPreBackwardFunction"):
        cls = types.get(name)
        if cls is not None and isinstance(forward_cls, type) and issubclass(forward_cls, cls):
            return getattr(hook, "param_group", None) or getattr(hook, "state", None) or forward_cls
    module = getattr(getattr(hook, "__func__", hook), "__module__", "") or ""
    if module.startswith("torch.distributed.fsdp._fully_shard"):
        return hook
    return None


def fsdp2_states(owners: Sequence[Any]) -> list[Any]:
    """Every FSDPState reachable from hook owners (states, or param groups via their modules), root's included."""
    state_cls = fsdp2_types().get("FSDPState")
    if state_cls is None:
        return []
    found: dict[int, Any] = {}
    for owner in owners:
        if not isinstance(owner, state_cls):
            continue
        found.setdefault(id(owner), owner)
        for state in getattr(getattr(owner, "_state_ctx", None), "all_states", ()) or ():
            found.setdefault(id(state), state)
    return list(found.values())


def fsdp2_unfinished(states: Sequence[Any]) -> list[str]:
    """FSDP2 states that did not finish their backward (not IDLE, or the root callback still queued)."""
    problems = []
    for state in states:
        training = getattr(state, "_training_state", None)
        name = getattr(training, "name", str(training))
        if name != "IDLE":
            modules = ", ".join(type(m).__name__ for m in getattr(state, "_modules", ())) or "?"
            problems.append(f"FSDP state of ({modules}) is {name}")
        for group in getattr(state, "_fsdp_param_groups", ()) or ():
            group_state = getattr(getattr(group, "_training_state", None), "name", "IDLE")
            if group_state != "IDLE":
                problems.append(f"param group {getattr(group, '_module_fqn', '?')!s} is {group_state}")
        if getattr(getattr(state, "_state_ctx", None), "post_backward_final_callback_queued", False):
            problems.append("the root post-backward final callback is still queued")
    return sorted(set(problems))


# --- torch-side workarounds, installed only inside enable() (docs/design.md "Cases stock compiled autograd gets wrong") ---

_workaround_lock = _threading.Lock()
_workaround_depth = 0
_workaround_saved: list[tuple[Any, str, Any]] = []


_probe_results: dict[int, tuple[Any, bool]] = {}


def _subclass_grad_context_bug() -> bool:
    """Cached :func:`_probe_subclass_grad_context_bug`, per identity of torch's function."""
    try:
        compatible = importlib.import_module("torch._subclasses.meta_utils")._grad_context_compatible
    except (ImportError, AttributeError):
        return False
    compatible = getattr(compatible, "__subclass_ca_original__", compatible)
    cached = _probe_results.get(id(compatible))
    if cached is None or cached[0] is not compatible:
        cached = _probe_results[id(compatible)] = (compatible, _probe_subclass_grad_context_bug())
    return cached[1]


def _probe_subclass_grad_context_bug() -> bool:
    """True where FakeTensor conversion reuses a plain tensor's symbolic context for its subclass ``.grad``.

    torch 2.13's ``meta_utils._grad_context_compatible`` only compares view-base structure,
    so a plain ``nn.Parameter`` whose ``.grad`` is a wrapper subclass (a TwoTensor grad
    flowing into a plain Linear) asserts ``Expected SubclassSymbolicContext or None, got
    StatefulSymbolicContext`` the first time Dynamo fakeifies it with that grad (second
    backward with ``retain_graph=True``, or grad accumulation).  Fixed upstream by
    pytorch/pytorch#186427; detected here by probing the function, not by version alone.
    """
    try:
        meta_utils = importlib.import_module("torch._subclasses.meta_utils")
        compatible = meta_utils._grad_context_compatible
        compatible = getattr(compatible, "__subclass_ca_original__", compatible)  # probe torch's, also inside enable()
        symbolic_shapes = importlib.import_module("torch.fx.experimental.symbolic_shapes")
        context = symbolic_shapes.StatelessSymbolicContext(dynamic_sizes=[symbolic_shapes.DimDynamic.STATIC])
    except (ImportError, AttributeError, TypeError):
        return False
    import types as _types

    probe = _types.SimpleNamespace(is_view=False, base=None, attrs={"a": None}, is_traceable_wrapper_subclass=True)
    try:
        return bool(compatible(context, probe))
    except Exception:  # noqa: BLE001 - a different implementation: leave it alone
        return False


def _patched_grad_context_compatible(original: Callable[..., bool]) -> Callable[..., bool]:
    symbolic_shapes = importlib.import_module("torch.fx.experimental.symbolic_shapes")

    @functools.wraps(original)
    def _grad_context_compatible(symbolic_context: Any, grad_desc: Any) -> bool:
        # A subclass grad needs a SubclassSymbolicContext: treat any other as incompatible so
        # meta_utils builds a fresh all-dynamic one from the grad (what upstream does since #186427).
        if getattr(grad_desc, "is_traceable_wrapper_subclass", False) and not isinstance(
            symbolic_context, symbolic_shapes.SubclassSymbolicContext
        ):
            return False
        return original(symbolic_context, grad_desc)

    _grad_context_compatible.__subclass_ca_original__ = original  # type: ignore[attr-defined]
    return _grad_context_compatible


def torch_workarounds() -> list[str]:
    """The torch-side workarounds :func:`installed_workarounds` applies on this torch."""
    found = []
    if _subclass_grad_context_bug():
        found.append("meta_utils._grad_context_compatible: subclass .grad of a plain tensor (pytorch#186427)")
    return found


@contextlib.contextmanager
def installed_workarounds() -> Iterator[None]:
    """Apply the torch-side workarounds while active (re-entrant; the outermost exit restores exactly)."""
    global _workaround_depth
    with _workaround_lock:
        if _workaround_depth == 0 and _subclass_grad_context_bug():
            meta_utils = importlib.import_module("torch._subclasses.meta_utils")
            original = meta_utils.__dict__["_grad_context_compatible"]
            _workaround_saved.append((meta_utils, "_grad_context_compatible", original))
            meta_utils._grad_context_compatible = _patched_grad_context_compatible(original)
        _workaround_depth += 1
    try:
        yield
    finally:
        with _workaround_lock:
            _workaround_depth -= 1
            if _workaround_depth == 0:
                while _workaround_saved:
                    owner, name, original = _workaround_saved.pop()
                    setattr(owner, name, original)


def call_accumulate_grad() -> Callable[..., Any]:
    """The function compiled autograd's AccumulateGrad nodes call (``external_utils.call_accumulate_grad``)."""
    return _lookup("torch._dynamo.external_utils:call_accumulate_grad")


# Dynamo's deferred tensor hooks (Note [Hooks on subclass intermediates] in _capture.py).
_TRACE_WRAPPED_USERS = ("torch._dynamo.variables.tensor", "torch._dynamo._trace_wrapped_higher_order_op")
_trace_wrapped_depth = 0
_trace_wrapped_saved: list[tuple[Any, Any]] = []


def original_trace_wrapped() -> Callable[..., Any]:
    """torch's own ``trace_wrapped`` (also while :func:`swapped_trace_wrapped` is active)."""
    if _trace_wrapped_saved:
        return _trace_wrapped_saved[0][1]
    return _lookup("torch._dynamo._trace_wrapped_higher_order_op:trace_wrapped")


@contextlib.contextmanager
def swapped_trace_wrapped(replacement: Callable[..., Any]) -> Iterator[None]:
    """Route Dynamo's deferred tensor hooks through ``replacement`` while active (re-entrant, exact restore).

    Swaps the ``trace_wrapped`` name in the modules that call it when Dynamo registers a
    hook under compiled autograd; a torch without them is left alone.
    """
    global _trace_wrapped_depth
    with _workaround_lock:
        if _trace_wrapped_depth == 0:
            for name in _TRACE_WRAPPED_USERS:
                try:
                    module = importlib.import_module(name)
                except ImportError:
                    continue
                if callable(module.__dict__.get("trace_wrapped")):
                    _trace_wrapped_saved.append((module, module.__dict__["trace_wrapped"]))
            for module, _ in _trace_wrapped_saved:
                module.trace_wrapped = replacement
        _trace_wrapped_depth += 1
    try:
        yield
    finally:
        with _workaround_lock:
            _trace_wrapped_depth -= 1
            if _trace_wrapped_depth == 0:
                for module, original in _trace_wrapped_saved:
                    module.trace_wrapped = original
                _trace_wrapped_saved.clear()
