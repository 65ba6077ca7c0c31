"""FSDP2 (``fully_shard``) support inside the compiled CA graph: detection, graph breaks, final callbacks.

Note [FSDP2 under compiled autograd]
------------------------------------
FSDP2 drives its backward with three kinds of hooks, all wrapped in
``torch._dynamo.disable`` on torch 2.13 (``_fsdp_common._dynamo_disable``; the
compiled-autograd-aware code paths of older releases are gone; on 2.11 FSDP2 still records at its
first forward whether compiled autograd is on, which a block makes "off" since these hooks run
eagerly here: ``_compat.fsdp2_eager_hooks_swap``):

* a tensor pre-hook ``FSDPState._pre_backward`` on each FSDP module's outputs: it
  all-gathers (unshards) the parameters and *queues the root's post-backward final
  callback* with ``Variable._execution_engine.queue_callback``;
* ``RegisterPostBackwardFunction`` applied to each module's grad-requiring inputs: its
  backward reduce-scatters the unsharded gradients into sharded DTensor ``.grad`` and
  reshards the parameters;
* the final callback ``FSDPState._root_post_backward_final_callback``: it runs
  ``post_backward`` for every group whose inputs did not require grad (typically the
  first layer, fed by data) and resets the iteration state.

Compiled autograd lifts the hooks into the CA graph as ``call_hook`` nodes.  Two things
then go wrong with stock torch:

1. ``fullgraph=True`` (what the docs recommend and what ``enable()`` uses) fails to
   compile: Dynamo refuses to trace a ``dynamo.disable``-d hook.  Loud, not wrong.
2. ``fullgraph=False`` (torch.compile's default) compiles with a graph break at each hook,
   which then runs eagerly -- but the eager ``queue_callback`` goes to the C++ engine,
   which never runs final callbacks queued while a CA graph runs.  The root callback is
   lost: the first layer keeps its unsharded plain ``Parameter`` and its local,
   un-reduced ``Tensor`` gradient, and FSDP2 believes the callback is still queued, so it
   never queues it again.  Silently wrong.

What ``enable()`` does about it (``_graph.CompiledCAGraph`` calls :func:`prepare` before,
:func:`final_callbacks` around and :func:`check_finished` after every run):

* Before each run it looks at the hook objects compiled autograd passes to the graph.
  If any belongs to FSDP2 (a bound ``FSDPState`` method or a
  ``RegisterPostBackwardFunction`` ctx), the graph is split at the hook calls on its first
  run, each piece compiled with ``fullgraph=True`` and the hooks run eagerly between them
  (Note [Splitting the CA graph at FSDP2's hooks] in ``_split.py``) -- the hooks cannot be
  traced on this torch -- and the capture report records why and into how many pieces.
  Nothing else in the CA graph changes: our subclass rebuild nodes stay in the compiled
  pieces.  (A graph compiled by a train step's own compiler is compiled with graph breaks
  at the hooks, ``fullgraph=False``, instead.)
* Around every run of a split graph or one with graph breaks (a ``fullgraph`` graph runs no eager code,
  and pays nothing), ``Variable._execution_engine`` is swapped for an object of the same
  engine type whose ``queue_callback`` collects into a list; after the graph returns,
  the collected callbacks run in FIFO order (callbacks queued by callbacks too), which
  is what the eager engine does at the end of ``backward()``.  Traced code is
  unaffected: Dynamo still sees an engine and routes a *traced* ``queue_callback`` to
  compiled autograd's own final-callback list.
* After the graph and its callbacks, every FSDP2 state must be back to IDLE (nothing
  left unsharded or queued); otherwise :class:`FSDP2UnsupportedError` says the gradients
  of that backward are not reduced -- a net for torch changes we do not know about.
* Before the graph runs (so before any gradient is produced or accumulated) the FSDP2
  configuration is checked; what cannot be made correct on this torch raises
  :class:`FSDP2UnsupportedError` naming FSDP2 and the reason.  The engine swap lasts only
  while one of our CA graphs runs; a backward outside ``enable()`` is never touched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from . import _compat
from ._nodes import hook_arg
from .errors import FSDP2UnsupportedError

__all__ = ["hook_owners", "prepare", "check_finished", "final_callbacks", "check_supported", "GRAPH_BREAK_REASON", "SPLIT_REASON"]

GRAPH_BREAK_REASON = (
    "FSDP2: fully_shard hooks are dynamo.disable-d on torch {version}; the CA graph is compiled with a graph "
    "break at each of them (fullgraph=False) and the engine's final callbacks are run after the graph"
)
SPLIT_REASON = "FSDP2: fully_shard hooks are dynamo.disable-d on torch {version}"
"""Start of the capture report's reason when the graph is split (Note [Splitting the CA graph at FSDP2's hooks])."""


def hook_owners(hooks: Sequence[Any]) -> list[Any]:
    """The FSDP2 states / param groups behind ``hooks`` (compiled autograd's hook list), in order."""
    return _compat.fsdp2_owners(hooks or ())


def check_supported(owners: Sequence[Any]) -> None:
    """Raise :class:`FSDP2UnsupportedError` for an FSDP2 setup this torch cannot run correctly under CA.

    Called before the CA graph's first run, so a refusal leaves parameters and gradients untouched.
    """
    problem = _compat.final_callback_redirect_problem()
    if problem is not None:
        raise FSDP2UnsupportedError(
            f"FSDP2 (fully_shard) under compiled autograd needs its root post-backward callback to run, and "
            f"on torch {_compat.TORCH_VERSION} subclass_ca cannot redirect it: {problem}. No gradient was "
            "produced. Run this backward outside subclass_ca.enable() (eager FSDP2 with a torch.compile-d "
            "forward is correct), or install torch 2.13."
        )


def prepare(graph: Any, args: Sequence[Any]) -> list[Any]:
    """Before a CA graph runs: detect FSDP2 hooks, check support, split the graph at them; the FSDP2 states found."""
    hooks = hook_arg(args)
    if not hooks or not _compat.fsdp2_loaded():
        return []
    owners = hook_owners(hooks)
    if not owners:
        return []
    check_supported(owners)
    version = _compat.TORCH_VERSION
    graph.split_at_hooks(hooks, SPLIT_REASON.format(version=version), GRAPH_BREAK_REASON.format(version=version))
    return _compat.fsdp2_states(owners)


def check_finished(states: Sequence[Any]) -> None:
    """After the graph and its final callbacks: every FSDP2 state must be back to IDLE.

    A safety net for torch changes this module does not know about: FSDP2 left mid-backward
    means unsharded parameters and un-reduced gradients, which must never pass silently.
    """
    problems = _compat.fsdp2_unfinished(states)
    if problems:
        raise FSDP2UnsupportedError(
            "FSDP2 (fully_shard) did not finish its backward under compiled autograd on torch "
            f"{_compat.TORCH_VERSION}: " + "; ".join(problems) + ". The gradients of this backward are NOT "
            "reduce-scattered: do not step the optimizer. Run this backward outside subclass_ca.enable() and "
            "report this torch version (see docs/distributed.md)."
        )


def run_callbacks(callbacks: list[Callable[[], None]]) -> None:
    """Run engine final callbacks FIFO, including any a callback queues, then clear the list."""
    index = 0
    while index < len(callbacks):
        callbacks[index]()
        index += 1
    callbacks.clear()


@contextlib.contextmanager
def final_callbacks() -> Iterator[list[Callable[[], None]]]:
    """Collect ``queue_callback`` calls made by eager code while the block runs; run them at its end.

    On an exception the collected callbacks are dropped (the eager engine does not run them
    either when backward raises).
    """
    callbacks: list[Callable[[], None]] = []
    with _compat.collect_engine_callbacks(callbacks):
        yield callbacks
        run_callbacks(callbacks)
