"""The runtime: the compiler compiled autograd calls, the compiled CA graph, and enable() blocks.

Note [enable() blocks and threads]
----------------------------------
Compiled autograd is process-wide in torch: one compiler is installed for the whole
process, and torch asserts when two threads each enter its context.  So an ``enable()``
block is owned by the thread that entered it; blocks nest freely in that thread, and a
second thread entering while the first is inside gets a clear :class:`SubclassCAError`
at enter (never torch's internal assertion, never the other thread's settings).

Each entry records what it acquired; an exit releases exactly that.  Blocks exited out of
order (an outer block while an inner one is still open) first close the inner ones, so
every torch attribute is back to torch's own object once the last block is gone, and then
raise :class:`SubclassCAError` naming the misuse; the inner block's own exit is then a no-op.
Settings never live in this module's state: they travel with the capture (Note [Settings
travel with the capture] in ``_epilogue.py``); the per-thread stack only supplies the
cache-key token of the innermost block (Note [Keeping CA caches apart]).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from . import _cacheable, _compat, _fsdp2, _split, diagnostics
from ._accumulate import accumulate_dummy_swap, accumulation_dtype, steal_subclass_accumulates
from ._epilogue import proxy_call_aot_backward, warn_fallback_once
from ._hooks import trace_wrapped_swaps
from ._nodes import raised_in_rebuild, retarget_to_opaque, subclass_nodes
from ._optimizer_step import frame_swaps
from .config import Config
from . import errors
from .errors import BackwardCompileError, GraphBreakError, SubclassCAError, UnsupportedSubclassError

__all__ = [
    "RUNTIME_PATCHES", "CACompiler", "cache_token", "Settings", "settings_for",
    "enter_block", "exit_block", "current_token", "capture_with",
]


class CompiledCAGraph:
    """The compiled CA graph, with one recovery path when compiling our rebuild nodes fails.

    If the first call fails *while compiling* (fullgraph: nothing has run yet) and the error
    was raised inside one of our rebuilds, ``on_unsupported="error"`` raises
    UnsupportedSubclassError naming the subclass types (no gradient produced), and
    ``"eager"`` recompiles the graph with those nodes opaque (one warning per subclass).
    Workarounds scoped to a CA graph run (Note [Workaround scopes]) apply around each call.
    A graph with FSDP2 hooks is split at them on its first run (:meth:`split_at_hooks`).
    """

    def __init__(
        self,
        graph_module: torch.fx.GraphModule,
        config: Config,
        fullgraph: bool,
        report: diagnostics.CaptureReport,
        compile_graph: Callable[[torch.fx.GraphModule], Any] | None = None,
    ) -> None:
        self._graph_module = graph_module
        self._compile_graph = compile_graph
        self._config = config
        self._report = report
        self._compiled = self._compile(fullgraph)
        self._checked = not fullgraph or not subclass_nodes(graph_module.graph)
        self._graph_breaks_allowed = not fullgraph
        self._workarounds = _compat.ca_graph_run_patches()
        for patches in self._workarounds:  # resident, acting only inside CA_GRAPH_RUN (Note [Workaround scopes])
            patches.install()
        self._first_run = True
        self._steady = False

    def _compile(self, fullgraph: bool) -> Any:
        if self._compile_graph is not None:  # the compiler of a torch.compile-d train step (flag style)
            return self._compile_graph(self._graph_module)
        config = self._config
        kwargs = _cacheable.compile_kwargs(self._graph_module, config.backend, config.compile_kwargs)
        return torch.compile(self._graph_module, backend=config.backend, fullgraph=fullgraph, **kwargs)

    def _call_in_scope(self, *args: Any, **kwargs: Any) -> Any:
        if not self._workarounds:
            return self._call(*args, **kwargs)
        _compat.CA_GRAPH_RUN.enter()
        try:
            return self._call(*args, **kwargs)
        finally:
            _compat.CA_GRAPH_RUN.exit()

    # The wrapper itself is never traced: inside a torch.compile-d train step Dynamo's frame
    # callback is active while compiled autograd runs this graph, and would trace any frame of
    # ours it enters; the disable wrapper is torch's own frame (about 1 µs).  The compiled graph
    # inside still runs compiled: its own torch.compile context re-enables Dynamo for its frame.
    __call__ = _compat.dynamo_disable(_call_in_scope)

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        if self._steady:
            # A fullgraph graph whose first run met no FSDP2 hook: nothing below can apply any more
            # (FSDP2 always puts its own autograd Functions in the graph, which are part of compiled
            # autograd's cache key, so a graph captured without them never runs with FSDP2).
            self._report.runs += 1
            return self._compiled(*args, **kwargs)
        # Note [FSDP2 under compiled autograd] in _fsdp2.py: detect FSDP2 hooks before the graph
        # runs, run the engine final callbacks eager hooks queue, check FSDP2 finished its backward.
        fsdp2_states = _fsdp2.prepare(self, args)
        if not self._graph_breaks_allowed:  # fullgraph: no eager code in the graph can queue a callback
            first = self._first_run
            result = self._run(*args, **kwargs)
            self._steady = first and not fsdp2_states and not self._graph_breaks_allowed
            return result
        with _fsdp2.final_callbacks():
            result = self._run(*args, **kwargs)
        _fsdp2.check_finished(fsdp2_states)
        return result

    def split_at_hooks(self, hooks: Any, reason: str, break_reason: str) -> None:
        """Split the graph at its FSDP2 / ``dynamo.disable``-d hooks, compile each piece whole (Note [Splitting the CA graph at FSDP2's hooks]).

        Falls back to :meth:`allow_graph_breaks` when the graph is compiled by a train step's own
        compiler (flag style: that compiler wants the whole graph) or has no split point.
        """
        if self._graph_breaks_allowed:
            return
        points = _split.split_points(self._graph_module, hooks) if self._compile_graph is None else []
        if not points:
            self.allow_graph_breaks(break_reason)
            return
        config = self._config

        def compile_piece(forward: Callable[..., Any], *, fullgraph: bool) -> Any:
            kwargs = _cacheable.compile_kwargs(forward.__self__, config.backend, config.compile_kwargs)
            return torch.compile(forward, backend=config.backend, fullgraph=fullgraph, **kwargs)

        split = _split.split_graph(self._graph_module, points, compile_piece, self._report)
        self._graph_breaks_allowed = True  # eager code (the hooks) runs between the pieces: final callbacks apply
        self._compiled = split
        self._checked = True
        self._report.fullgraph = False
        self._report.split_pieces = split.pieces
        self._report.split_hooks = split.hooks
        self._report.fallbacks.append(
            f"{reason}: the CA graph is split at its {split.hooks} hook call(s) into {split.pieces} piece(s), "
            "each compiled with fullgraph=True; the hooks run eagerly between them"
        )

    def allow_graph_breaks(self, reason: str) -> None:
        """Compile with graph breaks (fullgraph=False) from now on; the capture report records why."""
        if self._graph_breaks_allowed:
            return
        self._graph_breaks_allowed = True
        self._compiled = self._compile(False)
        self._checked = True
        self._report.fullgraph = False
        self._report.fallbacks.append(reason)

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        diagnostics.record_run(self._report)
        if self._first_run:
            return self._first(*args, **kwargs)
        return self._compiled(*args, **kwargs)

    def _first(self, *args: Any, **kwargs: Any) -> Any:
        """The first run compiles: recover from failures that are ours, list graph breaks."""
        breaks_before = _compat.graph_break_counts()
        try:
            result = self._compiled(*args, **kwargs)
        except Exception as error:
            if self._checked or not _compat.is_compile_failure(error):
                if _compat.is_graph_break(error) and not self._graph_breaks_allowed and not raised_in_rebuild(error):
                    raise _compile_error(error, args) from error
                raise
            result = self._recover(error, args, kwargs)
        self._checked = True
        self._first_run = False
        breaks = _compat.graph_break_counts()
        self._report.graph_breaks += sorted(r for r, n in breaks.items() if n > breaks_before.get(r, 0))
        return result

    def _recover(self, error: Exception, args: Any, kwargs: Any) -> Any:
        if not raised_in_rebuild(error):
            if _compat.is_graph_break(error) and not self._graph_breaks_allowed:
                raise _compile_error(error, args) from error
            raise error
        names = sorted({node.target._subclass_ca_type.__qualname__ for node in subclass_nodes(self._graph_module.graph)})
        if self._config.on_unsupported != "eager":
            last_line = str(error).strip().splitlines()[-1] if str(error).strip() else ""
            raise UnsupportedSubclassError(
                f"compiling the compiled-autograd graph failed inside the rebuild of {names} "
                f"({type(error).__name__}: {last_line}). "
                "No gradient was produced. Register a handler with a trace-safe rebuild, register it with "
                "mode='opaque', or pass enable(on_unsupported='eager') to rebuild eagerly."
            ) from error
        retarget_to_opaque(self._graph_module)
        self._compiled = self._compile(False)
        self._checked = True
        self._report.fullgraph = False
        for name in names:
            reason = f"{name}: rebuild could not be compiled ({type(error).__name__}); rebuilt eagerly (opaque)"
            self._report.fallbacks.append(reason)
            warn_fallback_once(name, reason)
        return self._compiled(*args, **kwargs)


# Note [Only real graph breaks become GraphBreakError]
# ----------------------------------------------------
# Dynamo reports every refusal as ``Unsupported``, but some are not code it could run eagerly
# between compiled pieces, so ``fullgraph=False`` would not fix them:
# * "Observed exception": the backward code itself raised while Dynamo traced it (e.g. torch's
#   AOT prologue when a compiled function returned several outputs needing grad and backward
#   ran on some only); run eagerly it raises too.  We say what raised, where, and whether the
#   raising code is torch's or one of our rebuild nodes;
# * "Failed to convert args/kwargs to proxy": a wrapper subclass without the flatten protocol
#   reached the graph; we name the class and the missing methods (the check registration does).
# * one of our own checks raised while Dynamo traced our code (e.g. HookOnSubclassError from a
#   hook's result): that error itself is raised, chained to Dynamo's.
# Everything else is a real graph break and becomes GraphBreakError (``fullgraph=False`` helps).

_NOT_GRAPH_BREAKS = ("Observed exception", "Failed to convert args/kwargs to proxy")


def _compile_error(error: BaseException, args: Any) -> SubclassCAError:
    """Our error for Dynamo's refusal to trace the CA graph (Note [Only real graph breaks become GraphBreakError])."""
    ours = _own_error_in_chain(error)
    if ours is not None:  # one of our checks refused while Dynamo traced it: that is the cause
        return type(ours)(str(ours))
    kind = _compat.graph_break_type(error)
    if kind.startswith("Failed to convert args/kwargs to proxy"):
        unflattenable = _wrappers_without_protocol(args)
        if unflattenable:
            return UnsupportedSubclassError(
                f"{', '.join(unflattenable)} reached the compiled-autograd graph but cannot be traced there: "
                f"{_missing_protocol_text(unflattenable)}. No gradient was produced. Define __tensor_flatten__ "
                "(inner tensor attribute names and a constant context) and __tensor_unflatten__(inner, ctx, "
                "outer_size, outer_stride) on the class, or run this backward outside subclass_ca.enable()."
            )
    if kind.startswith(_NOT_GRAPH_BREAKS):
        return _backward_raised_error(error, kind)
    return _graph_break_error(error)


def _own_error_in_chain(error: BaseException) -> SubclassCAError | None:
    """Our error inside Dynamo's: chained, or raised by traced code (Dynamo records only its repr)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, SubclassCAError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    observed = re.search(r"raised exception (\w+)\((.*)\)\s*$", str(error), re.MULTILINE)
    cls = getattr(errors, observed.group(1), None) if observed else None
    if isinstance(cls, type) and issubclass(cls, SubclassCAError):
        try:
            arguments = ast.literal_eval(f"({observed.group(2)},)")
        except (ValueError, SyntaxError):
            return None
        return cls(*arguments)
    return None


def _wrappers_without_protocol(args: Any) -> list[str]:
    names: set[str] = set()
    for value in _leaves(args):
        cls = type(value)
        if (
            isinstance(value, torch.Tensor)
            and cls not in (torch.Tensor, torch.nn.Parameter)
            and not _compat.is_traceable_wrapper_subclass(value)
            and getattr(cls, "__torch_dispatch__", None) is not getattr(torch.Tensor, "__torch_dispatch__", None)
        ):
            names.add(f"{cls.__module__}.{cls.__qualname__}")
    return sorted(names)


def _leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _leaves(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)
    else:
        yield value


def _missing_protocol_text(names: list[str]) -> str:
    plural = "they are wrapper subclasses" if len(names) > 1 else "it is a wrapper subclass"
    return f"{plural} (own __torch_dispatch__) without __tensor_flatten__/__tensor_unflatten__"


def _backward_raised_error(error: BaseException, kind: str) -> BackwardCompileError:
    text = str(error)
    raised = re.search(r"raised exception (.+)$", text, re.MULTILINE)
    what = raised.group(1).strip() if raised else (repr(error.__cause__) if error.__cause__ else kind)
    user_code = text.split("from user code:", 1)[1] if "from user code:" in text else ""
    lines = [line.strip() for line in user_code.strip().splitlines() if line.strip()]
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', user_code)
    where, whose = "", "torch's own backward code (compiled autograd's graph of torch's autograd nodes), not subclass_ca's"
    if len(lines) >= 2:
        where = f" at `{lines[1]}`"
    if "subclass_ca_" in user_code or any("/subclass_ca/" in path for path, _, _ in frames):
        whose = "subclass_ca's own code (a rebuild node or a handler's rebuild): please report it with this message"
    elif any("/torch/" not in path and not path.startswith("<") for path, _, _ in frames):
        path, line, name = next(f for f in frames if "/torch/" not in f[0] and not f[0].startswith("<"))
        whose = f"your code ({name} in {path.rsplit('/', 1)[-1]}:{line}), which Dynamo traced in the backward"
    return BackwardCompileError(
        f"compiling the compiled-autograd graph failed: the backward code raised {what}{where} while Dynamo "
        f"traced it. This is not a graph break: enable(fullgraph=False) would not fix it. It was raised by {whose}. "
        "No gradient was produced. Run the same step without subclass_ca.enable() (torch.compile alone) to see "
        "torch's own error for it: e.g. a compiled function that returns several outputs needing gradients, with "
        "backward() on only some of them, fails there too (call .detach() on the outputs you do not backward through)."
    )


def _graph_break_error(error: BaseException) -> GraphBreakError:
    text = str(error).strip()
    reason = text.splitlines()[0] if text else type(error).__name__
    explanation = re.search(r"^\s*Explanation: (.+)$", text, re.MULTILINE)
    if explanation:
        reason = f"{reason} ({explanation.group(1).strip().split('. ')[0].rstrip('.')})"
    user_code = text.split("from user code:", 1)[1] if "from user code:" in text else ""
    hook_kind = re.search(r"hook_type = '(\w+)'", user_code)
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', user_code)
    own = [(path, line, name) for path, line, name in frames if "/torch/" not in path and not path.startswith("<")]
    where = ""
    if own:
        path, line, name = own[0]
        kind = f"{hook_kind.group(1)} " if hook_kind else ""
        where = f" It is needed by the {kind}{name} ({path.rsplit('/', 1)[-1]}:{line})."
    elif "call_backward" in user_code and frames:
        path, line, name = frames[-1]
        where = (
            f" It is in the backward of a torch.autograd.Function the backward graph calls "
            f"(torch/{path.split('/torch/', 1)[-1]}:{line}, in {name}); DTensor's to_local/full_tensor, from_local "
            "and redistribute put theirs there when they run outside the compiled forward (e.g. a loss written on "
            "DTensors after the compiled model): compiling that code with the model avoids the break."
        )
    return GraphBreakError(
        f"the backward graph needs a graph break, which fullgraph=True (the default) refuses: {reason}.{where} "
        "No gradient was produced. This is typical of hooks that run Python Dynamo cannot trace (e.g. an "
        "optimizer step inside a post-accumulate-grad hook). Pass enable(fullgraph=False) to run that code "
        "eagerly between compiled pieces (the capture report lists the breaks), or make the hook traceable."
    )


class CACompiler:
    """The ``compiler_fn`` compiled autograd calls with each captured graph; it carries the settings.

    ``compile_graph`` compiles the graph instead of ``torch.compile(backend=config.backend)``:
    Dynamo's own compiler for a ``torch.compile``-d train step (flag style, see
    :func:`_adopt_flag_style_compiler`), or, with ``raw=True``, a test's or benchmark's function
    that must see the raw CA graph (no compiled-graph wrapper, no scoped workarounds).
    """

    def __init__(
        self,
        config: Config,
        compile_graph: Callable[[torch.fx.GraphModule], Any] | None = None,
        *,
        raw: bool = False,
    ) -> None:
        self.subclass_ca_config = config
        self._compile_graph = compile_graph
        self._raw = raw
        self._factory: Any = None

    @property
    def factory(self) -> Any:
        """What C++ autograd is handed while this compiler is active (built once, not per block)."""
        if self._factory is None:
            self._factory = _compat.compiler_factory(self)
        return self._factory

    def _capture(self, graph_module: torch.fx.GraphModule) -> Any:
        steal_subclass_accumulates(graph_module)  # Note [Subclass gradients and AccumulateGrad]
        nodes = subclass_nodes(graph_module.graph)
        config = self.subclass_ca_config
        fullgraph = config.fullgraph and not any(node.target._subclass_ca_mode == "opaque" for node in nodes)
        report = diagnostics.finish_capture(
            graph_nodes=len(graph_module.graph.nodes),
            fullgraph=fullgraph,
            ca_counters=_compat.ca_counters(),
            graph_code=graph_module.code,
        )
        if config.report:
            diagnostics.logger.warning("%s", report.summary())
        if self._raw and self._compile_graph is not None:
            return self._compile_graph(graph_module)
        return CompiledCAGraph(graph_module, config, fullgraph, report, self._compile_graph)

    # Note [Capture code is never traced] (_compat/compiled_autograd.py)
    __call__ = _compat.dynamo_disable(_capture)


# --- cache tokens (Note [Keeping CA caches apart] in _compat/compiled_autograd.py) -----

_cache_tokens: dict[tuple[Any, ...], int] = {}
_cache_tokens_lock = threading.Lock()


def _cache_key(config: Config) -> tuple[Any, ...]:
    return (
        config.backend,
        repr(sorted(config.compile_kwargs.items())),
        config.dynamic,
        config.strict,
        config.on_unsupported,
        config.fullgraph,
    )


def cache_token(config: Config, *, raw: bool = False) -> int:
    """A small int per distinct configuration: CA graphs are cached separately per token.

    ``raw``: for :func:`capture_with`, whose graphs go to a caller's compiler instead of ours.
    """
    key = (*_cache_key(config), raw)
    with _cache_tokens_lock:
        token = _cache_tokens.get(key)
        if token is None:
            token = _cache_tokens[key] = len(_cache_tokens)
        return token


# --- one compiler per configuration (Note [Interned settings] in api.py) ----------


class Settings:
    """One validated configuration with its compiler and cache token, shared by equal ``enable()`` calls."""

    __slots__ = ("config", "compiler", "token")

    def __init__(self, config: Config) -> None:
        self.config = config
        self.compiler = CACompiler(config)
        """Shared, so its ``factory`` is built once per configuration, not once per ``enable()``."""
        self.token = cache_token(config)


_settings: dict[tuple[Any, ...], Settings] = {}
_settings_lock = threading.Lock()


def settings_for(config: Config) -> Settings:
    """The :class:`Settings` of every configuration equal to ``config`` (the first one seen is kept).

    Equal means equal cache keys (:func:`cache_token`: compile kwargs compared by ``repr``) and
    the same ``report``, which is not part of the cache key but is read by the compiler.  The
    interned ``Config`` holds its own copy of ``compile_kwargs``.
    """
    key = (*_cache_key(config), config.report)
    found = _settings.get(key)
    if found is None:
        with _settings_lock:
            found = _settings.get(key)
            if found is None:
                interned = dataclasses.replace(config, compile_kwargs=dict(config.compile_kwargs))
                found = _settings[key] = Settings(interned)
    return found


# --- blocks (Note [enable() blocks and threads]) ----------------------------------


class _Entry:
    """One open block: what :func:`enter_block` acquired, released by :meth:`close`."""

    __slots__ = ("owner", "config", "token", "activation", "in_scope", "miss_log")

    def __init__(self, owner: object, config: Config, token: int) -> None:
        self.owner = owner
        self.config = config
        self.token = token
        self.activation: _compat.Activation | None = None
        """torch's compiled autograd, turned on (Note [Entering compiled autograd without a generator])."""
        self.in_scope = False
        self.miss_log = False

    def close(self, exc_info: tuple[Any, Any, Any]) -> bool:
        """Undo what :func:`enter_block` did, innermost first; every step runs even if one raises."""
        try:
            return _compat.deactivate(self.activation, exc_info) if self.activation is not None else False
        finally:
            try:
                if self.miss_log:
                    diagnostics.CACHE_MISS_LOG.release()
            finally:
                try:
                    if self.in_scope:
                        _compat.BLOCKS.exit()
                finally:
                    _release_process()


_local = threading.local()
_owner_lock = threading.Lock()
_owner_thread: int | None = None
_owner_entries = 0


def _entries() -> list[_Entry]:
    entries = getattr(_local, "entries", None)
    if entries is None:
        entries = _local.entries = []
    return entries


def current_token() -> int | None:
    """The cache-key token of this thread's innermost block (None outside enable(): torch's own keys)."""
    entries = getattr(_local, "entries", None)
    return entries[-1].token if entries else None


def _adopt_flag_style_compiler(compiler_fn: Any) -> Any:
    """Route a compiled train step's own compiled-autograd capture through this thread's block.

    With ``torch._dynamo.config.compiled_autograd = True``, every call of a ``torch.compile``-d
    function enters torch's ``compiled_autograd._enable(<its own compiler>)`` around the frame,
    so a ``loss.backward()`` inside it would be captured by stock CA.  Inside an ``enable()``
    block the compiler is wrapped in a :class:`CACompiler` carrying the block's settings: the
    capture goes through our epilogue and report, and the graph is still compiled by the
    step's own compiler (its backend).
    """
    entries = getattr(_local, "entries", None)
    if not entries or hasattr(compiler_fn, "subclass_ca_config"):
        return compiler_fn
    return CACompiler(entries[-1].config, compiler_fn)


RUNTIME_PATCHES = _compat.PatchSet(
    "subclass_ca runtime",
    lambda: [
        _compat.ca_enable_swap(_adopt_flag_style_compiler),
        _compat.aot_backward_swap(proxy_call_aot_backward),
        _compat.cache_key_swap(current_token),
        _compat.capture_accumulate_swap(accumulation_dtype),  # Note [Gradient dtype at accumulation]
        *trace_wrapped_swaps(),
        accumulate_dummy_swap(),
        *frame_swaps(),  # Note [Compiled optimizer steps over subclass gradients]
        *_compat.capture_watch_swaps(diagnostics.capture_abandoned),
        *([_cacheable.cache_global_swap()] if _compat.marked_cacheable_supported() else []),  # Note [Warm start through torch's caches]
    ],
    resident=True,
)
"""What the runtime changes in torch; resident, acting only while a block is open (Note [Resident patches])."""


def _claim_process(owner: object) -> None:
    global _owner_thread, _owner_entries
    me = threading.get_ident()
    with _owner_lock:
        if _owner_thread is not None and _owner_thread != me:
            holder = next((t.name for t in threading.enumerate() if t.ident == _owner_thread), str(_owner_thread))
            raise SubclassCAError(
                f"subclass_ca.enable() is already active in thread {holder!r}; compiled autograd is process-wide "
                "in torch (one compiler for the whole process), so a second thread cannot run its own block at the "
                f"same time (this is thread {threading.current_thread().name!r}). Run backward() of all threads "
                "inside one block in one thread, or serialize the blocks (e.g. with a lock around them)."
            )
        _owner_thread = me
        _owner_entries += 1


def _release_process() -> None:
    global _owner_thread, _owner_entries
    with _owner_lock:
        _owner_entries -= 1
        if _owner_entries == 0:
            _owner_thread = None


def enter_block(owner: object, config: Config, compiler: CACompiler, token: int, *, miss_log: bool) -> None:
    """Open one block for ``owner`` in this thread (see Note [enable() blocks and threads])."""
    _compat.require_support()
    _claim_process(owner)
    entry = _Entry(owner, config, token)
    try:
        RUNTIME_PATCHES.install()
        _compat.BLOCKS.enter()
        entry.in_scope = True
        if miss_log and diagnostics.miss_reasons_available():
            diagnostics.start_miss_log()
            entry.miss_log = True
        entry.activation = _compat.activate(compiler, compiler.factory, dynamic=config.dynamic)
    except BaseException:
        entry.close((None, None, None))
        raise
    _entries().append(entry)


_NESTED_JAGGED_REFUSAL = "NestedTensor support not implemented"
_FAKE_LIFT_REFUSAL = re.compile(r"Found tensor of type (?P<type><[^>]*>|\S+), which is not supported by FakeTensorMode")


def _translated(error: BaseException | None) -> SubclassCAError | None:
    """Our clear error for a torch refusal that escapes a block, or None (Note [Known torch refusals])."""
    if isinstance(error, NotImplementedError) and _NESTED_JAGGED_REFUSAL in str(error):
        return UnsupportedSubclassError(
            "nested jagged tensors (NJT, torch.nested with layout=torch.jagged) cannot be captured by compiled "
            "autograd in this torch: its C++ graph walk refuses nested tensors before anything runs, so no "
            "gradient was produced (stock compiled autograd refuses the same way). Run this backward outside "
            "subclass_ca.enable() (a torch.compile-d forward with an eager backward trains NJT correctly)."
        )
    lifted = _FAKE_LIFT_REFUSAL.search(str(error)) if isinstance(error, NotImplementedError) else None
    if lifted is not None and error.__cause__ is not None:
        cause = error.__cause__
        cause_text = (str(cause).strip().splitlines() or [""])[0]
        return BackwardCompileError(
            f"compiled autograd could not lift an input of this backward (a parameter, its .grad, a saved tensor or "
            f"an incoming gradient) of type {lifted['type']} to a fake tensor. Torch reports this as 'not supported by "
            f"FakeTensorMode', which points at the type; the cause is {type(cause).__name__}: {cause_text} "
            "No gradient was produced (the capture failed before the backward ran). Run this backward outside "
            "subclass_ca.enable() (a torch.compile-d forward with an eager backward) and report the cause, with the "
            "tensor's type, dtype and .grad, to subclass_ca."
        )
    return None


# Note [Known torch refusals]
# ---------------------------
# Some backwards are refused by torch's own compiled autograd with an error that does not say
# what to do (e.g. nested jagged tensors: ``NotImplementedError: NestedTensor support not
# implemented`` from the C++ graph walk, before any node runs), or with one that points away from
# the cause: compiled autograd turns *any* failure to fakeify a backward input into "Found tensor of
# type X, which is not supported by FakeTensorMode" and chains the real error as its cause (a
# .grad of another dtype was one, Note [A .grad of another dtype than its leaf]).  When such an
# error leaves an ``enable()`` block, the block re-raises it as the matching SubclassCAError, which
# names the cause and is chained to torch's.


def exit_block(owner: object, exc_info: tuple[Any, Any, Any]) -> bool:
    """Close ``owner``'s innermost block in this thread; inner blocks left open are closed first."""
    entries = _entries()
    if entries and entries[-1].owner is owner:  # the usual case: the innermost block exits
        suppressed = entries.pop().close(exc_info)
        if suppressed or exc_info[1] is None:
            return suppressed
        translated = _translated(exc_info[1])
        if translated is not None:
            raise translated from exc_info[1]
        return False
    position = next((i for i in range(len(entries) - 1, -1, -1) if entries[i].owner is owner), None)
    if position is None:
        return False  # already closed by an out-of-order exit of an outer block
    out_of_order = len(entries) - 1 - position
    while len(entries) > position:
        entry = entries.pop()
        entry.close(exc_info if len(entries) == position else (None, None, None))
    raise SubclassCAError(
        f"subclass_ca.enable() blocks exited out of order: an outer block exited while {out_of_order} inner "
        "block(s) were still open. subclass_ca closed them first and restored torch's state; their own exits "
        "do nothing now. Exit blocks in the reverse order of entering (use `with` statements)."
    )


@contextlib.contextmanager
def capture_with(compile_graph: Callable[[torch.fx.GraphModule], Any], *, config: Config | None = None) -> Iterator[None]:
    """Our epilogue proxy under compiled autograd with a caller's graph compiler.

    For measurements and tests that must see the raw CA graph: the graph goes to
    ``compile_graph`` as it is captured (no compiled-graph wrapper, no scoped workarounds).
    """
    config = config or Config()
    owner = object()
    enter_block(owner, config, CACompiler(config, compile_graph, raw=True), cache_token(config, raw=True), miss_log=False)
    try:
        yield
    finally:
        exit_block(owner, (None, None, None))
