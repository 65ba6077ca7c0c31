"""Dynamo, FX tracing and fake-tensor internals used while building and compiling CA graphs."""

from __future__ import annotations

import contextlib
import functools
import importlib
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from ._lookup import lookup
from ._patch import BLOCKS, AttributeSwap, gated

if TYPE_CHECKING:
    from typing_extensions import TypeIs

__all__ = [
    "allow_in_graph",
    "dynamo_disable",
    "is_dynamo_disabled",
    "is_traceable_wrapper_subclass",
    "is_traceable_wrapper_subclass_type",
    "is_compile_failure",
    "is_graph_break",
    "release_tracer",
    "graph_break_type",
    "graph_break_counts",
    "dynamo_config_snapshot",
    "functorch_config_snapshot",
    "two_tensor_type",
    "allowed_callable_count",
    "to_proxy",
    "create_call_node",
    "bind_dummy",
    "outside_tracing",
    "without_proxy_tracing",
    "fake_mode_of",
    "size_hint",
    "dynamo_counters",
    "compiled_autograd_flag",
    "unique_graph_count",
    "uncached_compiles",
    "TRACE_WRAPPED",
    "TRACE_WRAPPED_USERS",
    "FRAME_COMPILER",
    "frame_compile_swap",
    "run_only_supported",
    "enter_run_only",
    "exit_run_only",
    "global_state_guard",
    "default_stance",
]

TRACE_WRAPPED = "torch._dynamo._trace_wrapped_higher_order_op:trace_wrapped"
#: What Dynamo calls for every frame it is about to compile (a cache miss), fullgraph or not.
FRAME_COMPILER = "torch._dynamo.convert_frame:ConvertFrameAssert"
#: Modules that call ``trace_wrapped`` by name when Dynamo defers a hook to the backward (tensor hooks;
#: full backward module hooks through ``BackwardHookVariable`` in ``variables.distributed``).
TRACE_WRAPPED_USERS = (
    "torch._dynamo.variables.tensor",
    "torch._dynamo._trace_wrapped_higher_order_op",
    "torch._dynamo.variables.distributed",
)


SET_EVAL_FRAME = "torch._C._dynamo.eval_frame:set_eval_frame"
GLOBAL_STATE_GUARD = "torch._C._dynamo.guards:GlobalStateGuard"
STANCE = "torch._dynamo.eval_frame:_stance"


@functools.cache
def run_only_supported() -> bool:
    """Whether this torch has Dynamo's run-only frame mode and its global-state guard (every torch we support)."""
    try:
        lookup(SET_EVAL_FRAME), lookup(GLOBAL_STATE_GUARD), lookup(STANCE).stance
    except (ImportError, AttributeError):
        return False
    return True


def enter_run_only() -> Any:
    """Dynamo's run-only mode on this thread (``torch._dynamo.run``'s): a frame with compiled code runs it when
    its guards pass, any other frame runs as plain Python and nothing compiles.  Returns what
    :func:`exit_run_only` restores."""
    return lookup(SET_EVAL_FRAME)(False)


def exit_run_only(prior: Any) -> None:
    lookup(SET_EVAL_FRAME)(prior)


def global_state_guard() -> Any:
    """Dynamo's guard on the global state it compiles under (grad mode, autocast, deterministic algorithms...);
    ``.check()`` says whether the state is still the one it was made in."""
    return lookup(GLOBAL_STATE_GUARD)()


def default_stance() -> bool:
    """Whether ``torch.compiler.set_stance`` is at its default (compiled code runs, misses compile)."""
    stance = lookup(STANCE)
    return stance.stance == "default" and not stance.skip_guard_eval_unsafe


def allow_in_graph(fn: Callable[..., Any]) -> Callable[..., Any]:
    return cast(Callable[..., Any], lookup("torch._dynamo:allow_in_graph")(fn))


def dynamo_disable(fn: Callable[..., Any]) -> Callable[..., Any]:
    return cast(Callable[..., Any], lookup("torch._dynamo:disable")(fn))


def is_dynamo_disabled(fn: Any) -> bool:
    """Whether ``fn`` (or the function of a bound method) was wrapped by ``torch._dynamo.disable``.

    Dynamo marks its disable wrapper with ``_torchdynamo_disable = True``; Dynamo refuses to trace
    such a callable under ``fullgraph=True`` and graph-breaks at it otherwise.
    """
    return bool(getattr(fn, "_torchdynamo_disable", False) or getattr(getattr(fn, "__func__", None), "_torchdynamo_disable", False))


class TraceableWrapper(Protocol):
    """The traceable wrapper subclass protocol's instance side (what torch's own stubs of ``Tensor`` lack)."""

    def __tensor_flatten__(self) -> tuple[list[str], Any]: ...


def is_traceable_wrapper_subclass(value: object) -> TypeIs[TraceableWrapper]:
    """Whether ``value`` is a wrapper subclass instance with ``__tensor_flatten__``/``__tensor_unflatten__`` (a tensor
    typed ``torch.Tensor`` narrows to one with ``__tensor_flatten__``)."""
    return bool(lookup("torch.utils._python_dispatch:is_traceable_wrapper_subclass")(value))


def is_traceable_wrapper_subclass_type(cls: type) -> bool:
    checker = getattr(importlib.import_module("torch.utils._python_dispatch"), "is_traceable_wrapper_subclass_type", None)
    if checker is not None:
        return bool(checker(cls))
    return hasattr(cls, "__tensor_flatten__") and hasattr(cls, "__tensor_unflatten__")


def is_compile_failure(error: BaseException) -> bool:
    """True for errors Dynamo or a backend raise while *compiling* (nothing has run yet)."""
    return isinstance(error, lookup("torch._dynamo.exc:TorchDynamoException"))


def is_graph_break(error: BaseException) -> bool:
    """True for Dynamo's refusal to trace some code (what ``fullgraph=False`` would break the graph at)."""
    return isinstance(error, lookup("torch._dynamo.exc:Unsupported"))


_TRACER_OUTPUT_ATTRIBUTE = "_torch_dynamo_tracer_output"
"""Where Dynamo leaves the failed trace (its output graph: guards, fake tensors) on the exception it raises."""


def release_tracer(error: BaseException) -> None:
    """Let an error raised by Dynamo, and the errors it chains, go of the failed trace and its frames' locals.

    The trace (and the finished frames of its traceback) hold the fake tensors and guards of the graph's inputs,
    with weak references to the real ones (parameters among them), for as long as the user holds the error; a
    subclass parameter with a weak reference cannot be swapped, so a trainer that moves the model while handling
    the error (Lightning's teardown calls ``model.cpu()``) failed with "Cannot swap" instead.  The messages and
    traceback lines stay; frames still running are skipped (``traceback.clear_frames``).
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if getattr(current, _TRACER_OUTPUT_ATTRIBUTE, None) is not None:
            setattr(current, _TRACER_OUTPUT_ATTRIBUTE, None)
        traceback.clear_frames(current.__traceback__)
        current = current.__cause__ or current.__context__


def graph_break_type(error: BaseException) -> str:
    """Dynamo's short, context-free name for a refusal (``gb_type``; the first line of its text on older torch)."""
    kind = getattr(error, "gb_type", None)
    if isinstance(kind, str) and kind:
        return kind
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def graph_break_counts() -> dict[str, int]:
    """Dynamo's graph-break reasons so far in this process, with counts."""
    return dict(lookup("torch._dynamo.utils:counters")["graph_break"])


def dynamo_config_snapshot() -> dict[str, Any]:
    return dict(lookup("torch._dynamo:config").get_config_copy())


def functorch_config_snapshot() -> dict[str, Any]:
    return dict(lookup("torch._functorch:config").get_config_copy())


def two_tensor_type() -> type | None:
    """torch's reference TwoTensor (lives in torch.testing._internal), or None."""
    try:
        return cast(type, lookup("torch.testing._internal.two_tensor:TwoTensor"))
    except (ImportError, AttributeError):
        return None


def allowed_callable_count() -> int | None:
    """Size of Dynamo's allow_in_graph id set (None where torch hides it)."""
    try:
        ids = lookup("torch._dynamo.trace_rules:_allowed_callable_ids")
    except (ImportError, AttributeError):
        return None
    try:
        return len(ids())
    except TypeError:
        return len(ids)


# --- building CA graph nodes -------------------------------------------------


def to_proxy(compiler: Any, value: Any) -> Any:
    return compiler.to_proxy(value)


def create_call_node(compiler: Any, target: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    return compiler.fx_tracer.create_proxy(kind="call_function", target=target, args=tuple(args), kwargs=kwargs)


def bind_dummy(compiler: Any, dummy: torch.Tensor, proxy: Any) -> None:
    compiler.bind_objects_to_proxies([dummy], [proxy])


@contextlib.contextmanager
def outside_tracing() -> Iterator[None]:
    """Suspend compiled autograd's proxy and fake modes (to run real/foreign-fake code)."""
    disable_proxy = lookup("torch.fx.experimental.proxy_tensor:disable_proxy_modes_tracing")
    unset_fake = lookup("torch._subclasses.fake_tensor:unset_fake_temporarily")
    with disable_proxy(), unset_fake():
        yield


@contextlib.contextmanager
def without_proxy_tracing() -> Iterator[None]:
    with lookup("torch.fx.experimental.proxy_tensor:disable_proxy_modes_tracing")():
        yield


def fake_mode_of(values: Sequence[Any]) -> Any:
    return lookup("torch._guards:detect_fake_mode")(list(values))


def size_hint(value: Any) -> Any:
    """A concrete int for a SymInt (its hint); ints and None pass through."""
    if isinstance(value, torch.SymInt):
        return value.node.hint if value.node.has_hint() else value.node.require_hint()
    return value


# --- for tooling: counters and compile caches ---------------------------------


def compiled_autograd_flag() -> Any:
    """``torch._dynamo.config.compiled_autograd = True`` while active (read when ``torch.compile(fn)`` builds fn)."""
    return lookup("torch._dynamo:config").patch(compiled_autograd=True)


def dynamo_counters() -> Any:
    """Dynamo's process-wide counters (``counters[group][name]``)."""
    return lookup("torch._dynamo.utils:counters")


def unique_graph_count() -> int:
    """Graphs Dynamo has compiled in this process (``counters["stats"]["unique_graphs"]``)."""
    return int(dynamo_counters()["stats"].get("unique_graphs", 0))


@contextlib.contextmanager
def uncached_compiles(*, min_recompile_limit: int = 64) -> Iterator[None]:
    """Compile for real (no FX-graph or AOT-autograd cache hits) with room for recompiles: for timing compiles."""
    dynamo_config = lookup("torch._dynamo:config")
    with contextlib.ExitStack() as stack:
        stack.enter_context(dynamo_config.patch(recompile_limit=max(min_recompile_limit, dynamo_config.recompile_limit)))
        stack.enter_context(lookup("torch._inductor:config").patch(fx_graph_cache=False))
        stack.enter_context(lookup("torch._functorch:config").patch(enable_autograd_cache=False))
        yield


def frame_compile_swap(check: Callable[[dict[str, Any]], None]) -> AttributeSwap:
    """``ConvertFrameAssert.__call__`` calling ``check(frame.f_locals)`` before Dynamo compiles a frame, inside blocks.

    Runs on cache misses only (compiled code is looked up in C before Python is called); an
    exception from ``check`` propagates to the caller of the compiled function unchanged, before
    anything of the frame ran.
    """

    def make(original: Any) -> Any:
        @functools.wraps(original)
        def __call__(self: Any, frame: Any, *args: Any, **kwargs: Any) -> Any:
            check(getattr(frame, "f_locals", None) or {})
            return original(self, frame, *args, **kwargs)

        return gated(BLOCKS, original, __call__)

    return AttributeSwap(lambda: lookup(FRAME_COMPILER), "__call__", make)
