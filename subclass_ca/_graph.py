"""The compiled CA graph: the callable compiled autograd runs for each captured backward."""

from __future__ import annotations

from collections.abc import Callable
from types import MethodType
from typing import Any, cast

import torch

from . import _compat, _ddp, _fsdp2, _regional, _split, diagnostics
from ._epilogue import warn_fallback_once
from ._hook_order import hooks_to_run_eagerly, mutating_hook_calls, order_hooks_after_reads
from ._nodes import hook_arg, raised_in_rebuild, retarget_to_opaque, subclass_nodes, subclass_type_of
from ._translate import compile_error, grad_dtype_refusal
from ._warm_start import cacheable as _cacheable
from ._warm_start.keys import cross_process_key
from ._warm_start.traced import TracedGraph, TracedPiece, compile_traced
from .config import Config
from .errors import UnsupportedSubclassError

__all__ = ["CompiledCAGraph"]


def _dynamic(config: Config) -> bool | None:
    """``torch.compile``'s ``dynamic``: False never lets Dynamo mark a size dynamic (Note [Static-first CA graphs] in
    ``_compiler.py``); None is torch's own default."""
    return False if config.dynamic is False else None


def _sizes(config: Config) -> dict[str, bool]:
    """``dynamic=False`` never lets Dynamo mark a size dynamic either (Note [Static-first CA graphs] in ``_compiler.py``)."""
    return {"dynamic": False} if config.dynamic is False else {}


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
        self._traced: TracedGraph | None = None
        self._behaviour: str | None = None
        """The graph's key across processes, from its first call's inputs (Note [Keys by behaviour])."""
        self._lazy_fullgraph = fullgraph
        self._compiled: Any = None  # compiled at the first call, whose inputs give the behaviour key
        self._checked = not fullgraph or not subclass_nodes(graph_module.graph)
        self._graph_breaks_allowed = not fullgraph
        self._workarounds = _compat.ca_graph_run_patches()
        for patches in self._workarounds:  # resident, acting only inside CA_GRAPH_RUN (Note [Workaround scopes])
            patches.install()
        self._first_run = True
        self._steady = False
        self._hooks_eager = False
        """Its parameter hooks run eagerly between compiled pieces (Note [Optimizer steps compiled into the CA graph])."""
        self._static_sizes = config.dynamic is False  # Note [Static-first CA graphs] in _compiler.py
        self._ddp_bucket_mb: int | None = None
        """Read from the graph's own hooks at its first run, used by every compile of this graph (Note [Bucketing the
        Python reducer's all-reduces])."""

    def _compile(self, fullgraph: bool) -> Any:
        self._traced = None
        if self._compile_graph is not None:  # the compiler of a torch.compile-d train step (flag style)
            return self._compile_graph(self._graph_module)
        config = self._config
        kwargs = _cacheable.compile_kwargs(self._graph_module, config)
        backend, kwargs = _ddp.with_bucketing(config.backend, kwargs, self._ddp_bucket_mb)  # Note [Bucketing the Python reducer's all-reduces]
        if fullgraph:  # Note [Skipping Dynamo's trace of an unchanged CA graph]
            self._traced = compile_traced(self._graph_module, config, kwargs, self._behaviour, **_sizes(config))
            if self._traced is not None:
                return self._traced.compiled
        return torch.compile(self._graph_module, backend=backend, fullgraph=fullgraph, dynamic=_dynamic(config), **kwargs)

    def _regional(self) -> Any:
        """The graph cut into regional pieces, or None where it is compiled whole (Note [Regional CA graphs])."""
        config = self._config
        if not (self._lazy_fullgraph and config.regional and self._compile_graph is None) or "mode" in config.compile_kwargs:
            return None
        return _regional.regional_graph(self._graph_module, self._compile_piece, self._report)

    def _compile_piece(self, forward: MethodType, *, fullgraph: bool, first_args: tuple[Any, ...] | None = None) -> Any:
        """One piece of a split or regional graph (its GraphModule's bound ``forward``), compiled as the whole graph
        would be.  ``first_args``: a regional piece's first call's inputs, which key its kept trace (Note [Regional
        CA graphs], warm start)."""
        config = self._config
        piece = cast(torch.fx.GraphModule, forward.__self__)
        kwargs = _cacheable.compile_kwargs(piece, config)
        backend, kwargs = _ddp.with_bucketing(config.backend, kwargs, self._ddp_bucket_mb)
        if fullgraph and first_args is not None and config.persistent_caches:
            behaviour = cross_process_key("a regional piece", piece, first_args)
            traced = compile_traced(piece, config, kwargs, behaviour, **_sizes(config))
            if traced is not None:
                return TracedPiece(traced)
        return torch.compile(forward, backend=backend, fullgraph=fullgraph, dynamic=_dynamic(config), **kwargs)

    def _call_in_scope(self, *args: Any, **kwargs: Any) -> Any:
        if self._static_sizes:
            args = _compat.static_size_args(args)
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
        if self._first_run and self._compiled is None:  # before anything splits or compiles the graph
            self._ddp_bucket_mb = _ddp.bucket_mb_of_hooks(hook_arg(args))
            # Note [Hooks run after every read of the tensor they are given]: args[0] is the graph's inputs list
            order_hooks_after_reads(self._graph_module, args[0] if args and isinstance(args[0], list) else None,
                                    hook_arg(args))
            self._parameter_hooks_eagerly(args)
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
        self._split_at(points, reason)

    def _split_at(self, points: list[torch.fx.Node], reason: str) -> None:
        split = _split.split_graph(self._graph_module, points, self._compile_piece, self._report)
        self._traced = None
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
        refusal = grad_dtype_refusal(args)  # read now: the graph empties its inputs list
        kept = list(args[0]) if args and isinstance(args[0], list) and not self._hooks_eager else None
        try:
            result = self._first_call(*args, **kwargs)
        except Exception as error:
            if refusal is not None and _compat.is_graph_break(error):
                raise refusal from error
            if self._steps_eagerly(error, args):
                if kept is not None:
                    args[0][:] = kept  # nothing ran: the retry gets the inputs the failed compile may have emptied
                return self._first(*args, **kwargs)
            if self._checked or not _compat.is_compile_failure(error):
                if _compat.is_graph_break(error) and not self._graph_breaks_allowed and not raised_in_rebuild(error):
                    raise compile_error(error, args) from error
                raise
            result = self._recover(error, args, kwargs)
        self._checked = True
        self._first_run = False
        breaks = _compat.graph_break_counts()
        self._report.graph_breaks += sorted(r for r, n in breaks.items() if n > breaks_before.get(r, 0))
        return result

    def _parameter_hooks_eagerly(self, args: tuple[Any, ...]) -> None:
        """Split the graph at the parameter hooks whose steps are not compiled in (Note [Optimizer steps compiled
        into the CA graph] in ``_compat/optimizer_tracing.py``, *Which backend* and *Which parameters*)."""
        if self._compile_graph is not None:
            return
        inputs = args[0] if args and isinstance(args[0], list) else None
        inductor = self._config.backend == "inductor"
        traceable = _compat.steps_compile_in()  # this torch can compile the steps in (feature-detected)
        hooks = hook_arg(args)
        points = hooks_to_run_eagerly(self._graph_module, inputs, hooks, steps_in_graph=inductor and traceable)
        if not points:
            return
        others = _split.split_points(self._graph_module, hooks)  # FSDP2's and dynamo.disable-d hooks split too
        order = {node: index for index, node in enumerate(self._graph_module.graph.nodes)}
        if not inductor:
            why = (f"compiled with {self._config.backend!r}, the graph would keep every updated parameter and optimizer "
                   "state alive to its end (AOTAutograd applies in-place updates there; inductor writes them in place)")
        elif not traceable:
            why = f"this torch ({_compat.TORCH_VERSION}) cannot compile an optimizer step into the graph"
        else:
            why = ("the graph holds a wrapper subclass (a compiled step over TwoTensor came out 6e-3 off; torch 2.14 "
                   "fails an NF4-QLoRA graph with the steps in)")
        self._hooks_eager = True
        self._split_at(sorted({*points, *others}, key=order.__getitem__),
                       f"{len(points)} hook(s) handed a parameter (optimizer-in-backward) run eagerly: {why}")

    def _steps_eagerly(self, error: Exception, args: tuple[Any, ...]) -> bool:
        """The first compile of a graph with parameter hooks compiled in failed (nothing ran): split the graph at
        those hooks, which then run eagerly between compiled pieces, and try once more (Note [Optimizer steps
        compiled into the CA graph] in ``_compat/optimizer_tracing.py``); False when that does not apply."""
        if self._compile_graph is not None or self._hooks_eager:
            return False
        if not _compat.is_aliased_subclass_mutation(error):  # AOT refuses while compiling: nothing ran (others may have)
            return False
        points = mutating_hook_calls(self._graph_module, hook_arg(args))
        if not points:
            return False
        cause = ("AOTAutograd cannot compile an in-place update of an input that another input of the graph aliases "
                 "(a view the forward saved)")
        self._hooks_eager = True
        self._split_at(points, f"{len(points)} hook(s) handed a parameter (optimizer-in-backward) run eagerly: {cause}")
        return True

    def _behaviour_key(self, args: tuple[Any, ...]) -> str | None:
        """The key under which this graph's compile may cross processes (Note [Keys by behaviour]); None: never cached."""
        config = self._config
        if not config.persistent_caches:
            return None  # no persistent cache serves this graph: nothing to key
        hook_calls = _compat.hook_calls()
        hooked = any(node.op == "call_function" and node.target in hook_calls for node in self._graph_module.graph.nodes)
        refuse = "it calls hooks or a custom Function's backward (Python that may act outside the graph)" if hooked else None
        return cross_process_key("a CA graph", self._graph_module, args, refuse=refuse)

    def _first_call(self, *args: Any, **kwargs: Any) -> Any:
        if self._compiled is None:
            regional = self._compiled = self._regional()
            if regional is not None:
                try:
                    return regional(*args, **kwargs)
                except Exception as error:
                    if not regional.ran_nothing:
                        raise
                    self._whole_after_regional(error)
        if self._compiled is None:  # compiled whole: its key across processes first (a regional graph needs none)
            self._behaviour = self._behaviour_key(args)
            self._compiled = self._compile(self._lazy_fullgraph)
        traced = self._traced
        if traced is None:
            return self._compiled(*args, **kwargs)
        result = traced.run_first(*args, **kwargs)
        self._compiled = traced.compiled  # the recording's, or (refused) one compiled without it
        return result

    def _whole_after_regional(self, error: Exception) -> None:
        """The first regional piece failed before anything ran: the graph is compiled whole (Note [Regional CA graphs])."""
        self._compiled = None
        self._report.regional_pieces = self._report.regional_compiles = 0
        cause = getattr(error, "inner_exception", None) or error  # Dynamo's BackendCompilerFailed wraps the backend's
        first_line = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
        self._report.fallbacks.append(
            f"regional pieces: the first piece failed to compile ({type(cause).__name__}: {first_line[:200]}); "
            "the CA graph is compiled whole"
        )

    def _recover(self, error: Exception, args: Any, kwargs: Any) -> Any:
        if not raised_in_rebuild(error):
            if _compat.is_graph_break(error) and not self._graph_breaks_allowed:
                raise compile_error(error, args) from error
            raise error
        names = sorted({subclass_type_of(node).__qualname__ for node in subclass_nodes(self._graph_module.graph)})
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
