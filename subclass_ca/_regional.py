"""Regional compiled autograd: a CA graph cut at its pasted AOT backwards, each distinct piece compiled once.

Note [Regional CA graphs]
-------------------------
A model compiled region by region (``block.compile()`` per transformer block, as torchtune and
torchtitan do) gives compiled autograd one pasted AOT backward per block.  Compiled whole, the CA
graph makes Dynamo, AOTAutograd and inductor compile every block's backward again: the cold start
grows with depth while compile-only compiles one block and reuses it.  So a CA graph with repeated
regions is cut into pieces and each *distinct* piece is compiled once:

* **Cut.** A piece starts at each call of an AOT backward's prologue (compiled autograd's
  ``call_aot_bwd_prologue``) and runs to the next one: one block's backward, its epilogue (the
  subclass rebuilds), its accumulations, and the autograd nodes between it and the next block.
  What precedes the first prologue (the loss's backward, a head outside every region: the *head*)
  runs eagerly on its own, as compile-only runs it, so the first block's piece is like the others
  and shares their compile instead of costing one of its own.  The head's accumulations (nodes
  nothing uses) move to just after the first compiled piece: a first piece that fails to compile
  has then run nothing with an effect, and the whole graph can still run once (recovery).  A head
  with another effect (an in-place node whose result is used) joins the first piece instead.
  Every read of the graph's inputs (``inputs[i]``, ``sizes[i]``, ``hooks[i]``, ...) moves to one
  eager piece that runs first and then empties the ``inputs`` list (as the compiled whole graph
  does), so pieces take tensors, not list slots: two blocks differ only in which tensors they get.
  What follows the last block's backward (an embedding's) stays in that block's piece.
* **Identity.** Two pieces share a compile only when they compute the same thing, never by names:
  the same nodes in the same order calling the same objects (a function by its code and the very
  objects its closure holds, so two prologues of one AOT function match and those of two functions
  do not), the same constants (numbers, strings, dtypes and devices by value; a tensor by dtype,
  shape, stride and device, and by contents up to 64 elements; a larger tensor, and any other
  object, only when it is the very same object: its contents are never read), the same pattern of
  which node feeds which; and, decided at the first run, the same input metadata (type, size,
  stride, dtype, device, requires_grad, a wrapper subclass's inner tensors and flatten context).
  One ``torch.compile`` per distinct (piece, inputs) serves every piece that matches it.
* **When.** Only graphs that gain: at least two prologues and a repeated piece, compiled whole by
  subclass_ca with ``fullgraph=True`` (not a train step's own compiler, flag style), no hook calls
  (a hook object is Python state the identity cannot compare), no ``mode=`` compile option
  (``reduce-overhead``'s CUDA graphs record the whole backward best as one graph), and
  ``enable(regional=True)``, the default.  Everything else keeps the single graph; a graph split at
  FSDP2's hooks keeps that split (Note [Splitting the CA graph at FSDP2's hooks]).
* **Fusion** stops at a piece's edge: inductor fuses within a block's backward (where nearly all of
  it is) but not across two blocks.  Each piece is one entry into a compiled frame per run (its
  guards, AOT's runtime wrapper), which a whole graph pays once; see *steady* for what it costs.
* **Steady.**  ``torch.compile``'s wrapper around a frame costs more than the frame's guards (its
  Python: stance, flags, dispatch-key guard), about 20 us a piece on this project's CPU, which on
  the depth sweep's NF4 block (D = 64, a few small kernels) was most of what the whole graph saves
  over compile-only.  So a run whose pieces are known compiled calls each piece's frame directly in
  Dynamo's run-only mode (``torch._dynamo.run``'s: a frame's compiled code runs when its guards
  pass; nothing compiles, and a frame whose guards miss runs its FX code as plain Python, which
  computes the same).  Known compiled: the last run went through the wrapper at the default
  stance, which compiles whatever its guards miss, and this run passes equal sizes and scalars and
  hooks of the same types (``_compat.ca_graph_call_signature``; compiled autograd's cache key is
  the rest) under the same global state (Dynamo's own global-state guard), still at the default
  stance.  Anything else (new sizes, another thread count or grad mode, ``set_stance``) runs
  through the wrapper again; a call that passes packed saved tensors never runs run-only.
* **Sizes.** Static-first sizes stay so: a size passed into a piece as an int specialises it; a
  size compiled autograd made dynamic arrives as its own (maybe-dynamic) input and stays symbolic.
* **First run.** The whole graph compiled at once fails before any of it runs; pieces compile as
  they are reached, so a piece that fails to compile after others ran cannot be retried whole:
  :class:`RegionalCompileError` says which and that the earlier pieces' gradients were
  accumulated.  A failure in the first compiled piece (nothing with an effect ran) compiles the
  graph whole instead, which then fails or recovers as any whole graph does; the capture report
  says so.  (One case: a wrapper subclass whose views are not views, such as an ``expand`` that
  materialises one inner tensor, hands the first piece a gradient AOTAutograd cannot trace as an
  input, since a piece may write into its inputs where the whole graph wrote into an intermediate.)
* **Warm start.**  Each distinct piece is compiled as a whole CA graph is: its AOTAutogradCache
  key goes through the never-stale key swap (Note [Keys by behaviour]), or the cache is bypassed,
  and it keeps its Dynamo trace (Note [Skipping Dynamo's trace of an unchanged CA graph]) under a
  record key holding the piece's behaviour key on its first call's inputs: one record and one key
  computation per distinct piece, not per block.  A restart whose piece has the same key installs
  the record and runs it without tracing; a changed block body, or a changed subclass dispatch the
  piece reaches, is another key, so a restart never reuses a stale piece, and an unchanged restart
  takes every distinct piece from a record or the cache (tests/warm_start/test_never_stale.py runs a
  regional program in every form).
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable
from typing import Any

import torch

from . import _compat, diagnostics
from ._cut import Cut, cut, is_input_index
from .errors import RegionalCompileError

__all__ = ["RegionalGraph", "regional_graph", "piece_identity", "prologues"]


_READS = 0
"""Piece number of the eager piece that reads the graph's inputs."""
_HEAD = 1
"""Piece number of the eager head: what precedes the first prologue, less its sinks (Note [Regional CA graphs], cut)."""
_SINKS = 2
"""Piece number of the head's sinks (its accumulations), run eagerly after the first compiled piece."""
_FIRST_REGION = 3


def prologues(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The calls of pasted AOT backwards' prologues, in graph order (each starts a region)."""
    return [node for node in graph.nodes if node.op == "call_function" and _compat.is_aot_backward_prologue(node.target)]


def _is_prologue(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and _compat.is_aot_backward_prologue(node.target)


def _head_sinks(graph: torch.fx.Graph, second: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The head's sinks (nodes no other node uses: its accumulations), moved to just before ``second``.

    None when the head does something else with an effect (an impure node whose result is used):
    then it cannot run apart from the first region without changing what a failed first compile leaves.
    """
    sinks = []
    for node in graph.nodes:
        if _is_prologue(node):
            break
        if node.op in ("placeholder", "output") or is_input_index(node):
            continue
        if not node.users:
            sinks.append(node)
        elif node.is_impure():
            return None
    for node in sinks:
        second.prepend(node)  # nothing uses a sink, and all it uses is defined before the first prologue
    return sinks


def _partitions(graph: torch.fx.Graph, sinks: list[torch.fx.Node] | None) -> dict[torch.fx.Node, int]:
    """Node -> piece: input reads, the eager head and its ``sinks``, then one piece per prologue on.

    With ``sinks`` None (a head that cannot run apart) what precedes the first prologue joins its piece.
    """
    piece: dict[torch.fx.Node, int] = dict.fromkeys(sinks or (), _SINKS)
    current, prologues_seen = (_FIRST_REGION if sinks is None else _HEAD), 0
    for node in graph.nodes:
        if node.op in ("placeholder", "output") or node in piece:
            continue
        if is_input_index(node):
            piece[node] = _READS
            continue
        if _is_prologue(node):
            current = _FIRST_REGION + prologues_seen
            prologues_seen += 1
        piece[node] = current
    return piece


def _callable_identity(target: Any) -> Any:
    """What a node calls, as an identity: a function by its code and its closure's objects (never its name)."""
    code = getattr(target, "__code__", None)
    if code is None:
        return ("object", id(target))
    closure = tuple(id(cell.cell_contents) for cell in (target.__closure__ or ()))
    defaults = tuple(id(value) for value in (target.__defaults__ or ()))
    return ("function", id(code), closure, defaults, id(getattr(target, "__globals__", None)))


def _constant_identity(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        plain = value.detach()
        return ("tensor", str(plain.dtype), tuple(plain.shape), tuple(plain.stride()), str(plain.device),
                plain.cpu().flatten().tolist() if plain.numel() <= 64 else id(value))
    if value is None or isinstance(value, (bool, int, float, str, complex, torch.dtype, torch.device, torch.layout,
                                           torch.memory_format)):
        return (type(value).__name__, repr(value))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_constant_identity(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((repr(k), _constant_identity(v)) for k, v in value.items()))
    if isinstance(value, slice):
        return ("slice", repr(value))
    return ("object", id(value))


def piece_identity(module: torch.fx.GraphModule) -> tuple[Any, ...]:
    """What a piece computes, comparable between pieces of one graph (Note [Regional CA graphs], identity)."""
    index: dict[torch.fx.Node, int] = {}
    described: list[Any] = []

    def argument(value: Any) -> Any:
        if isinstance(value, torch.fx.Node):
            return ("node", index[value])
        if isinstance(value, (list, tuple)):
            return (type(value).__name__, tuple(argument(v) for v in value))
        if isinstance(value, dict):
            return ("dict", tuple((repr(k), argument(v)) for k, v in value.items()))
        return _constant_identity(value)

    for position, node in enumerate(module.graph.nodes):
        index[node] = position
        if node.op == "placeholder":
            described.append(("placeholder",))
        elif node.op == "get_attr":
            described.append(("get_attr", _constant_identity(operator.attrgetter(node.target)(module))))
        elif node.op == "output":
            described.append(("output", argument(node.args)))
        else:
            target = _callable_identity(node.target) if node.op == "call_function" else (node.op, node.target)
            described.append((node.op, target, argument(node.args), argument(node.kwargs)))
    return tuple(described)


def _input_identity(value: Any) -> Any:
    """The metadata of one piece input that Dynamo guards on (Note [Regional CA graphs], identity)."""
    if isinstance(value, torch.Tensor):
        described: tuple[Any, ...] = (type(value), tuple(value.shape), tuple(value.stride()) if value.layout == torch.strided else None,
                     value.dtype, value.device, value.requires_grad)
        if _compat.is_traceable_wrapper_subclass(value):
            names, context = value.__tensor_flatten__()
            described += (repr(context), tuple(_input_identity(getattr(value, name)) for name in names))
        return described
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_input_identity(v) for v in value))
    if value is None or isinstance(value, (bool, int, float, str)):
        return (type(value), value)
    return (type(value), id(value))


class _RunMode(threading.local):
    run_only = False
    """Whether this thread's run enters the pieces' frames directly (Note [Regional CA graphs], steady)."""


class _Slot:
    """One compiled piece of the top level: at its first call it adopts the compiled callable of its identity."""

    def __init__(self, graph: RegionalGraph, module: torch.fx.GraphModule, number: int, identity: tuple[Any, ...]) -> None:
        self._graph = graph
        self._module = module
        self._identity = identity
        self._compiled: Any = None
        self._frame: Any = None
        """The function whose frame holds the compiled code, called as is in run-only mode (Note [Regional CA graphs], steady)."""
        self.number = number

    def __call__(self, *args: Any) -> Any:
        compiled = self._compiled
        if compiled is not None:
            if self._graph.mode.run_only:
                return self._frame(*args)
            return compiled(*args)
        self._compiled, self._frame = self._graph.compiled_for(self._identity, args, self._module)
        try:
            return self._compiled(*args)
        except Exception as error:
            self._compiled = None
            self._graph.failed(self, error)
            raise


class RegionalGraph:
    """A CA graph run as an eager top level calling its pieces, each distinct piece compiled once."""

    def __init__(self, pieces: Cut, identities: dict[int, tuple[Any, ...]], compile_piece: Callable[..., Any],
                 report: diagnostics.CaptureReport) -> None:
        """Install every piece of ``pieces`` (detached, code generated) on its top level: the reads, the head and its
        sinks eager, each region a slot that compiles its ``identities`` entry once (Note [Regional CA graphs])."""
        self.top = pieces.top
        self._forward = pieces.top.forward
        self._compile_piece = compile_piece
        self._report = report
        self._compiled: dict[tuple[Any, Any], Any] = {}
        self._ran = 0
        """Compiled pieces that ran during the current first run (see :meth:`failed`)."""
        self.ran_nothing = False
        """Whether the first run failed before anything with an effect ran (its inputs are restored)."""
        self._first = True
        self.mode = _RunMode()
        self._verified: tuple[Any, Any] | None = None
        """The call signature and global state the pieces last ran compiled with."""
        slots = []
        for number, module in pieces:
            if number == _READS:
                names = [node.name for node in module.graph.nodes if node.op == "placeholder"]
                pieces.install(number, _reads_then_release(module.forward, names.index("inputs") if "inputs" in names else None))
            elif number in (_HEAD, _SINKS):
                pieces.install(number, module.forward)  # eager, as compile-only runs it (Note [Regional CA graphs], cut)
            else:
                slots.append(_Slot(self, module, number - _FIRST_REGION + 1, identities[number]))
                pieces.install(number, slots[-1])
        self._slots = tuple(slots)
        self.pieces = len(slots)
        report.regional_pieces = len(slots)

    @property
    def compiles(self) -> int:
        """Distinct compiled pieces so far."""
        return len(self._compiled)

    def compiled_for(self, identity: tuple[Any, ...], args: tuple[Any, ...], module: torch.fx.GraphModule) -> tuple[Any, Any]:
        """The compiled piece of this identity on inputs like ``args``, and the function whose frame holds its
        compiled code; the first piece of each distinct pair keys and compiles it (a kept trace included)."""
        key = (identity, tuple(_input_identity(a) for a in args))
        found = self._compiled.get(key)
        if found is None:
            compiled = self._compile_piece(module.forward, fullgraph=True, first_args=args)
            found = self._compiled[key] = (compiled, module.forward)
            self._report.regional_compiles = len(self._compiled)
        self._ran += 1
        return found

    def failed(self, slot: _Slot, error: Exception) -> None:
        """A piece's first call failed: re-raise as is when nothing ran before it, else say what already ran."""
        if self._ran <= 1:
            return
        raise RegionalCompileError(
            f"regional piece {slot.number} of {self.pieces} of the backward failed on its first run, after "
            f"{self._ran - 1} earlier piece(s) ran and accumulated their gradients ({type(error).__name__}: "
            f"{str(error).strip().splitlines()[0] if str(error).strip() else ''}). Zero the gradients before the "
            "next step; enable(regional=False) compiles the whole backward before running any of it, so it fails "
            "before any gradient."
        ) from error

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Note [Regional CA graphs], steady: a run through torch.compile's wrapper at its default stance compiles
        # whatever its guards miss, so its signature and global state are known compiled
        signature = (_compat.ca_graph_call_signature(args)
                     if _compat.run_only_supported() and _compat.default_stance() else None)
        if not self._first:
            verified = self._verified
            if signature is not None and verified is not None and signature == verified[0] and verified[1].check():
                return self._run_only(*args, **kwargs)
            state = _compat.global_state_guard() if signature is not None else None
            result = self._forward(*args, **kwargs)
            if signature is not None:
                self._verified = (signature, state)
            return result
        kept = list(args[0]) if args and isinstance(args[0], list) else None  # the inputs, for a retry as a whole
        self._ran = 0
        state = _compat.global_state_guard() if signature is not None else None
        try:
            result = self._forward(*args, **kwargs)
        except Exception:
            if kept is not None and self._ran <= 1:
                args[0][:] = kept  # nothing ran: the caller may run the whole graph on the same inputs
                self.ran_nothing = True
            raise
        self._first = False
        if signature is not None:
            self._verified = (signature, state)
        return result

    def _run_only(self, *args: Any, **kwargs: Any) -> Any:
        """One run whose pieces enter their compiled frames directly (Note [Regional CA graphs], steady)."""
        prior = _compat.enter_run_only()
        self.mode.run_only = True
        try:
            return self._forward(*args, **kwargs)
        finally:
            self.mode.run_only = False
            _compat.exit_run_only(prior)


def _reads_then_release(forward: Callable[..., Any], inputs_position: int | None) -> Callable[..., Any]:
    """The eager reads piece; afterwards the ``inputs`` list is emptied, as the whole compiled graph empties it."""

    def read(*args: Any) -> Any:
        values = forward(*args)
        if inputs_position is not None and isinstance(args[inputs_position], list):
            args[inputs_position].clear()
        return values

    return read


def regional_graph(
    graph_module: torch.fx.GraphModule,
    compile_piece: Callable[..., Any],
    report: diagnostics.CaptureReport,
) -> RegionalGraph | None:
    """``graph_module`` as a :class:`RegionalGraph`, or None where regions would not pay (Note [Regional CA graphs])."""
    graph = graph_module.graph
    starts = prologues(graph)
    if len(starts) < 2:
        return None
    hook_calls = _compat.hook_calls()
    if any(node.op == "call_function" and node.target in hook_calls for node in graph.nodes):
        return None
    sinks = _head_sinks(graph, starts[1])
    if sinks:
        graph_module.recompile()  # the whole graph stays runnable as is (recovery, regional=False) with its sinks moved
    piece = _partitions(graph, sinks)
    pieces = cut(graph_module, piece, deferred_codegen=True)
    identities = {number: piece_identity(module) for number, module in pieces if number >= _FIRST_REGION}
    if len(set(identities.values())) == len(identities):
        return None  # nothing repeats: one graph compiles and fuses best
    pieces.detach()
    for _, module in pieces:
        _compat.generate_code(module)
    _compat.generate_code(pieces.top)  # with no GraphModule children left, only its own code
    return RegionalGraph(pieces, identities, compile_piece, report)
