"""torch's compiled autograd: turning it on, its cache, counters, logger and AOT-backward hook point."""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import re
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ._lookup import lookup
from ._patch import BLOCKS, CA_CAPTURE, AttributeSwap, CallSwap, gated
from .dynamo import dynamo_disable
from .workarounds import ca_capture_patches

if TYPE_CHECKING:
    from typing_extensions import TypeIs

__all__ = [
    "is_aot_backward_prologue",
    "CA_MODULE",
    "COMPILER_INSTANCE",
    "AOT_BACKWARD_PARAMS",
    "enable_compiled_autograd",
    "compiler_factory",
    "Activation",
    "activate",
    "deactivate",
    "fast_activation_supported",
    "ca_enable_swap",
    "compiled_autograd_state",
    "autograd_compiler",
    "reset_compiled_autograd",
    "clear_compiled_autograd_cache",
    "capture_watch_swaps",
    "capture_id",
    "ca_counters",
    "ca_verbose_log",
    "verbose_logger_swap",
    "stock_ca_compiler",
    "is_stock_make_subclass",
    "compiler_fn_of",
    "aot_backward_swap",
    "cache_key_swap",
    "hook_calls",
    "HOOK_CALLS",
    "static_size_args",
    "ca_graph_call_signature",
    "pasted_aot_prefix",
    "empty_graph_like",
    "is_op_overload",
    "mutates_an_argument",
]

CA_MODULE = "torch._dynamo.compiled_autograd"
COMPILER_INSTANCE = "torch._dynamo.compiled_autograd:AutogradCompilerInstance"
AOT_BACKWARD_PARAMS = ("pinputs", "psaved_tensors", "saved_tensors", "pctx", "ctx")
AUTOGRAD_FUNCTION_CTX = "torch.autograd.function:BackwardCFunction"
_C_CA = "torch._C:_dynamo.compiled_autograd"


def enable_compiled_autograd(compiler_fn: Callable[..., Any], *, dynamic: bool = True) -> Any:
    """torch's own context manager that routes ``backward()`` through compiled autograd."""
    return lookup(CA_MODULE + ":_enable")(compiler_fn, dynamic=dynamic)


# Note [Entering compiled autograd without a generator]
# -------------------------------------------------------
# torch's ``compiled_autograd._enable`` is a generator context manager that, on every enter,
# builds a ``functools.partial`` compiler factory, checks CUDA to import cudagraph_trees, and
# nests ``set_multithreading_enabled``: that is all of stock compiled autograd's enter+exit
# cost.  :func:`activate` / :func:`deactivate` perform the same steps as direct calls, in the
# same order and with the same end state (``tests/compat/test_activation.py`` compares them
# with torch's own), using a factory prepared once per compiler.  They do so only for an
# ``_enable`` whose source is one we have read (``KNOWN_ENABLE_SOURCES``: torch 2.13, 2.14
# and 2.15 have the identical function; 2.11 and 2.12 differ only in ``assert`` where 2.13 raises
# ``AssertionError`` itself, as deactivate() does); any other torch, and Dynamo's ``force_eager``
# stance, go through torch's own ``_enable``, so a torch change costs speed, never behaviour.

#: sha256 prefixes of the ``compiled_autograd._enable`` sources activate() reproduces.
KNOWN_ENABLE_SOURCES = frozenset({"537b7a55ad9c0f52", "8300c298412fbb55"})
_checked: tuple[Any, bool] = (None, False)
"""The ``_enable`` last fingerprinted and whether activate() reproduces it (one identity check per enter)."""
_cudagraph_trees_imported = False


def _torch_enable() -> Any:
    enable = lookup(CA_MODULE + ":_enable")
    return getattr(enable, "__subclass_ca_original__", enable)


def fast_activation_supported(enable: Any = None) -> bool:
    """True when :func:`activate` may reproduce ``enable`` (torch's ``_enable``) directly."""
    global _checked
    enable = _torch_enable() if enable is None else enable
    if _checked[0] is not enable:
        try:
            digest = hashlib.sha256(inspect.getsource(enable).encode()).hexdigest()[:16]
        except (OSError, TypeError):
            digest = ""
        _checked = (enable, digest in KNOWN_ENABLE_SOURCES)
    return _checked[1]


def compiler_factory(compiler_fn: Callable[..., Any]) -> Any:
    """What ``_enable`` hands C++ autograd for ``compiler_fn``: one capture instance per capture."""
    return functools.partial(lookup(COMPILER_INSTANCE), compiler_fn)


class Activation:
    """What :func:`activate` changed, for :func:`deactivate` to undo."""

    __slots__ = ("prior_compiler", "prior_dynamic", "prior_depth", "prior_multithreading", "torch_context")

    # set by activate()'s fast path only (torch_context is None there)
    prior_compiler: Any
    prior_dynamic: bool
    prior_depth: int
    prior_multithreading: bool

    def __init__(self) -> None:
        self.torch_context: Any = None


@functools.cache
def _modules() -> tuple[Any, Any, Any]:
    return lookup(CA_MODULE), lookup(_C_CA), lookup("torch._dynamo:eval_frame")


def activate(compiler_fn: Callable[..., Any], factory: Any, *, dynamic: bool) -> Activation:
    """Turn compiled autograd on with ``compiler_fn`` (``factory`` = :func:`compiler_factory` of it).

    Note [Entering compiled autograd without a generator].
    """
    global _cudagraph_trees_imported
    activation = Activation()
    ca, ca_c, eval_frame = _modules()
    enable = ca._enable
    enable = getattr(enable, "__subclass_ca_original__", enable)
    if eval_frame._stance.stance == "force_eager" or not fast_activation_supported(enable):
        context = enable(compiler_fn, dynamic=dynamic)
        context.__enter__()
        activation.torch_context = context
        return activation
    if not _cudagraph_trees_imported:
        if torch.cuda.is_available():
            importlib.import_module("torch._inductor.cudagraph_trees")
        _cudagraph_trees_imported = True
    activation.prior_compiler, activation.prior_dynamic = ca_c.set_autograd_compiler(factory, dynamic)
    if ca.snapshot_verbose_logging_enabled():
        ca_c.set_verbose_logger(ca.verbose_log)
    ca.compiled_autograd_enabled = True
    activation.prior_depth = ca.depth
    ca.depth += 1
    activation.prior_multithreading = torch._C._is_multithreading_enabled()
    torch._C._set_multithreading_enabled(False)
    return activation


def deactivate(activation: Activation, exc_info: tuple[Any, Any, Any]) -> bool:
    """Undo :func:`activate`; True when torch's own context suppressed the exception."""
    if activation.torch_context is not None:
        return bool(activation.torch_context.__exit__(*exc_info))
    ca, ca_c, _ = _modules()
    torch._C._set_multithreading_enabled(activation.prior_multithreading)
    if not activation.prior_compiler:
        ca.compiled_autograd_enabled = False
    ca_c.set_autograd_compiler(activation.prior_compiler, activation.prior_dynamic)
    ca.depth -= 1
    if ca.depth != activation.prior_depth:
        raise AssertionError("Nested Compiled Autograd Contexts must return before their parent context")
    return False


def ca_enable_swap(adopt: Callable[[Any], Any]) -> AttributeSwap:
    """``compiled_autograd._enable`` with its ``compiler_fn`` passed through ``adopt`` first.

    It is what Dynamo enters around each call of a ``torch.compile``-d function when
    ``torch._dynamo.config.compiled_autograd`` is set (``adopt`` leaves our own compilers alone).
    """

    def make(original: Any) -> Any:
        def _enable(compiler_fn: Any, *args: Any, **kwargs: Any) -> Any:
            return original(adopt(compiler_fn), *args, **kwargs)

        return gated(BLOCKS, original, _enable)

    return AttributeSwap(lambda: lookup(CA_MODULE), "_enable", make, own_only=False)


def compiled_autograd_state() -> dict[str, Any]:
    """Module-level compiled-autograd flags, for exact save/restore checks."""
    ca = lookup(CA_MODULE)
    return {
        name: getattr(ca, name)
        for name in ("compiled_autograd_enabled", "in_compiled_autograd_region", "depth")
        if hasattr(ca, name)
    }


def autograd_compiler() -> Any:
    """The compiler C++ autograd currently holds (read by setting and restoring it)."""
    setter = lookup(_C_CA + ".set_autograd_compiler")
    prior = setter(None, False)
    setter(*prior)
    return prior


def clear_compiled_autograd_cache() -> None:
    """Drop compiled autograd's graph cache only (keeps the installed compiler and counters)."""
    lookup(_C_CA + ".clear_cache")()


_CAPTURING = "_subclass_ca_capturing"
_capturing = threading.local()


def capture_id() -> int | None:
    """Compiled autograd's id of the latest capture begun in this thread (the ``compiled_autograd_id`` of its compile
    id, under which torch's own trace entries of that CA graph are filed), or None."""
    return getattr(_capturing, "id", None)


def _untraced(gate: Any) -> Any:
    """A gated capture entry point, dynamo.disable-d (Note [Capture code is never traced])."""
    disabled: Any = dynamo_disable(gate)  # a function object we tag with attributes of our own
    disabled.__subclass_ca_original__ = gate.__subclass_ca_original__
    disabled.__subclass_ca_gate__ = gate.__subclass_ca_gate__
    return disabled


def capture_watch_swaps(on_abandoned: Callable[[], None]) -> list[AttributeSwap]:
    """Call ``on_abandoned()`` for every compiled-autograd capture that fails.

    A capture is *abandoned* when ``begin_capture`` ran but ``end_capture`` never returned:
    torch refused to trace (double backward through a compiled region), a rebuild of ours
    raised, a hook failed...  torch calls ``close()`` on the compiler instance on success and
    on failure (C++ ``ClosingTHPObjectPtr``); ``close`` is an instance attribute, so it is
    wrapped per instance in ``begin_capture``.  ``on_abandoned`` must not raise.  See Note
    [Failed captures and the verbose logger] in ``diagnostics.py``.
    """

    def make_begin(original: Any) -> Any:
        @functools.wraps(original)
        def begin_capture(self: Any, *args: Any, **kwargs: Any) -> Any:
            close = getattr(self, "close", None)
            if close is not None:
                setattr(self, _CAPTURING, True)

                def close_and_report() -> Any:
                    try:
                        return close()
                    finally:
                        forget_real_tensors(self)
                        if self.__dict__.pop(_CAPTURING, False):
                            on_abandoned()

                self.close = close_and_report
            # the capture lifts every input to a fake tensor here: the workarounds for that act now
            for patches in ca_capture_patches():  # Note [Workaround scopes]
                patches.install()
            CA_CAPTURE.enter()
            try:
                return original(self, *args, **kwargs)
            finally:
                CA_CAPTURE.exit()
                _capturing.id = getattr(self, "id", None)  # compiled autograd's id of this capture (set by torch's begin)

        return _untraced(gated(BLOCKS, original, begin_capture))

    def make_end(original: Any) -> Any:
        @functools.wraps(original)
        def end_capture(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            self.__dict__.pop(_CAPTURING, None)  # reached only when the capture succeeded
            return result

        return _untraced(gated(BLOCKS, original, end_capture))

    locate = lambda: lookup(COMPILER_INSTANCE)  # noqa: E731
    return [AttributeSwap(locate, "begin_capture", make_begin), AttributeSwap(locate, "end_capture", make_end)]


# Note [A capture lets go of the real tensors]
# --------------------------------------------
# A capture lifts every input of the backward (parameters among them) to a fake tensor, and the fake
# mode's describer remembers each real tensor by a weak reference.  torch keeps the capture's compiler
# instance alive as long as its CA graph is cached (the graph's runtime wrapper closes over it, for its id
# and NaN checker), so those weak references outlive the capture.  A tensor subclass parameter with a weak
# reference cannot be swapped (``torch.utils.swap_tensors``), and ``module.to()`` / ``.cpu()`` swap subclass
# parameters: after one captured backward, Lightning's teardown (``model.cpu()``) and any ``model.to(dtype)``
# failed with "Cannot swap t1 because it has weakref associated with it" (stock compiled autograd too;
# ``torch.compile`` alone lets go).  Once the capture is closed nothing converts through that mode again, so
# its real-tensor lookups are cleared then.


def forget_real_tensors(instance: Any) -> None:
    """Drop a closed capture's weak references to the real tensors it lifted (Note [A capture lets go of the
    real tensors]).  A torch without the describer's lookups keeps them (nothing to clear)."""
    converter = getattr(getattr(instance, "fake_tensor_mode", None), "fake_tensor_converter", None)
    describer = getattr(getattr(converter, "meta_converter", None), "describer", None)
    for lookup_name in ("lookup_tensor", "lookup_storage"):
        remembered = getattr(describer, lookup_name, None)
        if remembered is not None:
            remembered.clear()


def reset_compiled_autograd() -> None:
    """Drop compiled autograd's graph cache (forces the next backward to recapture)."""
    lookup(CA_MODULE).reset()


def ca_counters() -> dict[str, int]:
    return dict(lookup("torch._dynamo.utils:counters")["compiled_autograd"])


def ca_verbose_log() -> Any:
    """torch's own verbose compiled-autograd logger when the user enabled it (TORCH_LOGS), else None."""
    ca = lookup(CA_MODULE)
    enabled = getattr(ca, "snapshot_verbose_logging_enabled", None)
    if enabled is None or not enabled():
        return None
    return getattr(ca, "verbose_log", None)


def verbose_logger_swap(make: Callable[[Any], Any]) -> CallSwap:
    """Compiled autograd's C++ verbose logger (where torch says *why* a backward missed its cache)."""
    return CallSwap(
        get=ca_verbose_log,
        set=lookup(_C_CA + ".set_verbose_logger"),
        make=make,
        label="torch._C._dynamo.compiled_autograd.set_verbose_logger",
    )


def stock_ca_compiler(backend: Any, **compile_kwargs: Any) -> Callable[..., Any]:
    """The compiler_fn torch documents: ``lambda gm: torch.compile(gm, backend=..., fullgraph=True)``."""
    return lambda gm: torch.compile(gm, backend=backend, fullgraph=True, **compile_kwargs)


def is_stock_make_subclass(target: Any) -> bool:
    """True for the anonymous ``make_subclass`` closure stock CA emits per epilogue call."""
    return getattr(target, "__name__", None) == "make_subclass" and getattr(target, "__module__", None) == CA_MODULE


_PASTED_AOT_NODE = re.compile(r"^(aot\d+(?:_\d+)?_)[A-Za-z_]")
"""How ``proxy_call_aot_backward`` names the nodes it pastes from an AOT backward graph
(``make_unique``: ``aot<aot id>[_<repeat>]_<node name>``, the same on torch 2.11-2.15)."""


def is_aot_backward_prologue(target: Any) -> bool:
    """The prologue compiled autograd calls before each pasted AOT backward (``proxy_call_aot_backward``'s
    ``call_aot_bwd_prologue``, one closure per call over its AOT function's prologue; torch 2.11-2.15)."""
    return getattr(target, "__name__", None) == "call_aot_bwd_prologue" and getattr(target, "__module__", None) == CA_MODULE


def pasted_aot_prefix(name: str) -> str | None:
    """The ``aot<id>_`` prefix of a node compiled autograd pasted from an AOT backward (None: not pasted)."""
    match = _PASTED_AOT_NODE.match(name)
    return match.group(1) if match else None


def is_op_overload(target: object) -> TypeIs[torch._ops.OpOverload]:
    """A node target that is one overload of a torch operator (``aten.mul.Tensor``)."""
    return isinstance(target, torch._ops.OpOverload)


def mutates_an_argument(target: Any) -> bool:
    """Whether an operator overload writes into one of its arguments (True for anything without a schema)."""
    schema = getattr(target, "_schema", None) if is_op_overload(target) else None
    return schema is None or schema.is_mutable


def empty_graph_like(graph: torch.fx.Graph, owner: torch.fx.GraphModule) -> torch.fx.Graph:
    """An empty FX graph owned by ``owner`` that generates code the way ``graph`` does (its codegen and tracer class)."""
    empty = torch.fx.Graph(
        owning_module=owner, tracer_cls=getattr(graph, "_tracer_cls", None), tracer_extras=getattr(graph, "_tracer_extras", None)
    )
    codegen = getattr(graph, "_codegen", None)
    if codegen is not None:
        empty.set_codegen(codegen)
    return empty


def compiler_fn_of(compiler: Any) -> Any:
    """The ``compiler_fn`` a compiled-autograd capture (an AutogradCompilerInstance) will call."""
    return getattr(compiler, "compiler_fn", None)


def aot_backward_swap(wrapper: Callable[..., Any]) -> AttributeSwap:
    """``AutogradCompilerInstance.proxy_call_aot_backward`` routed through ``wrapper(compiler, ctx, call)``.

    ``call`` runs torch's original with the same arguments; ``ctx`` is the autograd ctx of
    the AOT backward node.
    """

    def make(original: Any) -> Any:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def proxy_call_aot_backward(compiler: Any, *args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(compiler, *args, **kwargs)
            return wrapper(compiler, bound.arguments["ctx"], lambda: original(compiler, *args, **kwargs))

        # Note [Capture code is never traced]: inside a torch.compile-d train step that calls
        # backward(), Dynamo's frame callback is still active while compiled autograd captures, so
        # it would compile our capture-time Python as user frames, with guards that can reuse one
        # subclass output's argument slice for the next one.  Every entry point torch calls into
        # during a capture is therefore dynamo.disable-d.
        return _untraced(gated(BLOCKS, original, proxy_call_aot_backward))

    return AttributeSwap(lambda: lookup(COMPILER_INSTANCE), "proxy_call_aot_backward", make)


_CACHE_KEY_MARK = 0x5CA  # "subclass_ca" marker ahead of our token in an autograd function's CA key


def cache_key_swap(current_token: Callable[[], int | None]) -> AttributeSwap:
    """Fold ``current_token()`` into every custom autograd function's compiled-autograd cache key.

    Note [Keeping CA caches apart]: compiled autograd's graph cache is process-global and
    not keyed by the compiler, so a graph captured by stock CA (or under other settings)
    would otherwise be reused.  AOT backward nodes contribute ``ctx._compiled_autograd_key()``
    to the cache key; only its leading id is a static key (the rest are lifted as symints),
    so the token is hashed into it (62 bits fit C++'s ssize_t).  ``None``: torch's own key.
    """

    def make(original: Any) -> Any:
        # gated inline (one frame less on every backward): BLOCKS closed -> torch's key, unchanged
        def _compiled_autograd_key(ctx: Any) -> Any:
            key = original(ctx)
            if not BLOCKS.depth:
                return key
            token = current_token()
            if token is None:
                return key
            return (hash((key[0], _CACHE_KEY_MARK, token)) & ((1 << 62) - 1), *key[1:])

        _compiled_autograd_key.__subclass_ca_original__ = original  # type: ignore[attr-defined]
        _compiled_autograd_key.__subclass_ca_gate__ = BLOCKS  # type: ignore[attr-defined]
        return _compiled_autograd_key

    return AttributeSwap(lambda: lookup(AUTOGRAD_FUNCTION_CTX), "_compiled_autograd_key", make)


HOOK_CALLS = ("torch._dynamo.external_utils:call_hook", "torch._dynamo.external_utils:call_backward")
"""What a CA graph node calls to run a hook object from its ``hooks`` argument (tensor/pre/post hooks,
and the backward of a custom autograd Function, whose ctx is the hook object)."""


def hook_calls() -> tuple[Callable[..., Any], ...]:
    """The functions CA graph nodes call with a hook object as first argument (``call_hook``, ``call_backward``)."""
    return tuple(lookup(dotted) for dotted in HOOK_CALLS)


def ca_graph_call_signature(args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """What a CA graph's call passes beyond its cache key: its sizes, scalars and hook types, or None when unknown.

    Compiled autograd calls a cached CA graph ``(inputs, sizes, scalars, hooks, packed_data)``; the
    graph's structure and its inputs' kinds are its cache key, so equal sizes and scalars give
    its pieces inputs of equal shapes.  The hooks are objects new at every call (an AOT backward's
    node, say), described by their types.  None (never equal) when the call passes packed saved
    tensors or a scalar as a tensor, or has another layout.
    """
    if len(args) != 5 or not all(isinstance(arg, (list, tuple)) for arg in args) or args[4]:
        return None
    if any(isinstance(scalar, torch.Tensor) for scalar in args[2]):
        return None
    return tuple(map(_size_value, args[1])), tuple(args[2]), tuple(map(type, args[3]))


def _size_value(size: Any) -> Any:
    """One entry of a CA graph's sizes as an int: since torch 2.13 a dynamic size comes as a ``(0, size)`` tensor."""
    return size.size(1) if isinstance(size, torch.Tensor) else size


def static_size_args(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """A CA graph's call arguments with every size as a plain int (Note [Static-first CA graphs] in ``_compiler.py``).

    Compiled autograd passes the CA graph ``(inputs, sizes, scalars, hooks, ...)``; since torch 2.13 each
    size it made dynamic comes as a ``(0, size)`` tensor marked maybe-dynamic, which Dynamo turns into a
    symbol even under ``torch.compile(dynamic=False)``.  As an int (what the graph's
    ``unwrap_maybe_dynamic_int`` also accepts, and all older torch passes), Dynamo specialises it.
    """
    if len(args) < 2 or not isinstance(args[1], list):
        return args
    return (args[0], list(map(_size_value, args[1])), *args[2:])

