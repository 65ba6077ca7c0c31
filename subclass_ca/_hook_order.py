"""Hooks handed a tensor that outlives the backward run after every read of that tensor (eager's order).

Note [Hooks run after every read of the tensor they are given]
--------------------------------------------------------------
A post-accumulate-grad hook is handed the parameter itself, so that it can change it: torchtune's
optimizer-in-backward steps one optimizer per parameter there, updating the parameter in place.
In eager autograd the hook runs after its AccumulateGrad node, and a compiled region's backward is
one autograd node, so every read of the parameter inside that region's backward (``x @ a @ b``
reads ``b`` for the gradient of ``a``) has happened before any hook of the region runs; a read that
came later would trip the version counter.

Compiled autograd pastes each region's AOT backward into the CA graph and then moves every
AccumulateGrad node and its post-accumulate-grad hooks up to where the gradient is produced
(torch's ``reorder_accumulate_grad_nodes`` / ``reorder_post_acc_grad_hook_nodes``, pytorch#121735).
Inside a pasted region that is *before* the other reads of the parameter: ``b``'s optimizer step
updates ``b`` in place, then the gradient of ``a`` is computed from the updated ``b``.  Nothing
checks a version counter in the graph, so the model trains wrong, silently, under either
``fullgraph`` setting (stock compiled autograd too).

:func:`order_hooks_after_reads` restores eager's guarantee as a rule on the graph, before anything
compiles it (whole, split at FSDP2's hooks, or traced by a train step's compiler): every hook call
that is handed a tensor from outside the backward (one of the graph's ``inputs``) moves to just
after the last node that reads that tensor or an alias of it.  Aliases are found without running
anything:

* the graph's other inputs that share storage with it, read from the real inputs on the graph's first
  run (an AOT region may save ``b.t()`` computed in the forward rather than ``b``: another input,
  the same memory); compiled autograd's cache key holds the autograd graph, so a cached graph is
  run with the same saved tensors of the same parameters;
* the outputs of every AOT backward prologue that is handed the tensor (the prologue passes saved
  tensors through, or unwraps a subclass into its inner tensors: which output is which is AOT's
  business, so all of them count -- the hook then runs where eager runs it, after the region);
* the results of view operators (an ``OpOverload`` whose schema returns an alias) and ``getitem``
  of any alias, transitively.

A moved hook keeps its relative order with the other hooks of the same anchor, and its ``hooks[i]``
read stays where it was.  A hook whose result is used cannot be moved past a reader that comes after one of its users;
that raises :class:`HookOrderError` naming the hook and the tensor -- never a reordered graph that
computes something else.  The rule is for post-accumulate-grad hooks, the hooks handed a parameter:
every other hook (tensor hooks, node pre/post hooks) and a custom Function's backward is handed
gradients or its own saved tensors and already runs where eager runs it.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence

import torch

from . import _compat
from ._nodes import INPUTS_ARG, hook_object, subclass_nodes
from .errors import HookOrderError

__all__ = ["mutating_hook_calls", "hooks_to_run_eagerly", "order_hooks_after_reads"]

_POST_ACCUMULATE_GRAD = "post_acc_grad_hook"
"""compiled autograd's ``hook_type`` of a post-accumulate-grad hook call."""


def _handed(hook: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes a hook call hands its hook (every argument node but ``hooks[i]``, the hook itself)."""
    return [node for node in hook.all_input_nodes if node is not hook.args[0]]


def _input_reads(graph: torch.fx.Graph) -> dict[torch.fx.Node, int]:
    """``inputs[i]`` nodes and their ``i``: tensors that live outside this backward (parameters, saved tensors)."""
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    if len(placeholders) <= INPUTS_ARG:
        return {}
    inputs = placeholders[INPUTS_ARG]
    return {
        user: user.args[1]
        for user in inputs.users
        if user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], int)
    }


def _storages(value: object) -> set[int]:
    """Identities of the memory a (maybe wrapper-subclass) tensor's plain tensors live in."""
    if not isinstance(value, torch.Tensor):
        return set()
    if _compat.is_traceable_wrapper_subclass(value):
        names, _ = value.__tensor_flatten__()
        return set().union(*(_storages(getattr(value, name)) for name in names))
    try:
        return {value.untyped_storage()._cdata}
    except (RuntimeError, NotImplementedError):  # no storage of its own (e.g. sparse): nothing to compare
        return set()


def _same_memory(reads: dict[torch.fx.Node, int], inputs: Sequence[object] | None) -> dict[torch.fx.Node, set[torch.fx.Node]]:
    """Per input read, the other input reads whose tensors share memory with it (empty without real inputs)."""
    if inputs is None:
        return {}
    by_storage: dict[int, set[torch.fx.Node]] = {}
    storages: dict[torch.fx.Node, set[int]] = {}
    for node, index in reads.items():
        storages[node] = _storages(inputs[index]) if index < len(inputs) else set()
        for storage in storages[node]:
            by_storage.setdefault(storage, set()).add(node)
    return {node: set().union(*(by_storage[s] for s in found)) - {node} for node, found in storages.items() if found}


def _returns_alias(node: torch.fx.Node) -> bool:
    target = node.target
    if node.op != "call_function":
        return False
    if target is operator.getitem:
        return True
    if not _compat.is_op_overload(target):
        return False
    return any(ret.alias_info is not None and not ret.alias_info.is_write for ret in target._schema.returns)


def _aliases(tensor: torch.fx.Node, same_memory: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """``tensor`` and every node that may alias it (Note [Hooks run after every read of the tensor they are given])."""
    found = {tensor, *same_memory}
    pending = list(found)
    while pending:
        node = pending.pop()
        for user in node.users:
            if user.op != "call_function":
                continue
            if _compat.is_aot_backward_prologue(user.target):
                new: Iterable[torch.fx.Node] = [user, *user.users]
            elif _returns_alias(user):
                new = [user]
            else:
                continue
            for alias in new:
                if alias not in found:
                    found.add(alias)
                    pending.append(alias)
    return found


def _hook_calls(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """Post-accumulate-grad hook calls: the hooks handed the parameter itself (every other hook gets gradients)."""
    calls = _compat.hook_calls()
    return [
        node for node in graph.nodes
        if node.op == "call_function" and node.target in calls and node.kwargs.get("hook_type") == _POST_ACCUMULATE_GRAD
    ]


def _describe(hook: torch.fx.Node) -> str:
    kind = hook.kwargs.get("hook_type", getattr(hook.target, "__name__", "hook"))
    source = hook.args[0] if hook.args else None
    slot = ""
    if isinstance(source, torch.fx.Node) and source.target is operator.getitem and len(source.args) > 1:
        slot = f" hooks[{source.args[1]}]"
    return f"{kind}{slot} ({hook.name})"


def mutating_hook_calls(graph_module: torch.fx.GraphModule, hooks: Sequence[object] = ()) -> list[torch.fx.Node]:
    """The hook calls handed a tensor from outside the backward (which they may update in place), in graph order.

    ``hooks``: the graph's hook objects on its first run, where known: DDP's Python reducer's hooks (which
    all-reduce ``.grad`` and never write the parameter) are left where compiled autograd put them.
    """
    input_reads = _input_reads(graph_module.graph)
    return [
        hook for hook in _hook_calls(graph_module.graph)
        if any(arg in input_reads for arg in _handed(hook))
        and not _compat.is_reducer_hook(hook_object(hook, hooks))
    ]


def _hands_a_subclass(hook: torch.fx.Node, reads: dict[torch.fx.Node, int], inputs: Sequence[object] | None,
                      rebuilt: set[torch.fx.Node]) -> bool:
    """Whether the hook's parameter, or the gradient accumulated into it, is (or may be) a wrapper subclass."""
    accumulate = _compat.call_accumulate_grad()
    for param in (arg for arg in _handed(hook) if arg in reads):
        index = reads[param]
        if inputs is None or index >= len(inputs) or _compat.is_traceable_wrapper_subclass(inputs[index]):
            return True
        accumulations = [user for user in param.users if user.op == "call_function" and user.target is accumulate]
        if not accumulations:  # accumulated some other way (a subclass gradient's own accumulation): assume so
            return True
        for node in accumulations:
            parts = _compat.accumulate_node_parts(node.args)
            grad = parts[2] if parts is not None else None
            while isinstance(grad, torch.fx.Node) and grad.target is operator.getitem:
                grad = grad.args[0]
            if grad is None or grad in rebuilt:
                return True
    return False


def hooks_to_run_eagerly(graph_module: torch.fx.GraphModule, inputs: Sequence[object] | None, hooks: Sequence[object],
                         *, steps_in_graph: bool) -> list[torch.fx.Node]:
    """The parameter hooks that must run eagerly between compiled pieces rather than be compiled into the graph.

    All of them unless ``steps_in_graph`` (the backend updates in place) and the graph holds no wrapper subclass
    (among its inputs, or a gradient it rebuilds) (Note [Optimizer steps compiled into the CA graph] in
    ``_compat/optimizer_tracing.py``).
    """
    found = mutating_hook_calls(graph_module, hooks)
    if not steps_in_graph or not found:
        return found
    if inputs is None or any(_compat.is_traceable_wrapper_subclass(value) for value in inputs):
        return found  # a wrapper subclass anywhere in the graph's inputs (a frozen NF4 base, a TwoTensor parameter)
    reads = _input_reads(graph_module.graph)
    rebuilt = set(subclass_nodes(graph_module.graph))
    return [hook for hook in found if _hands_a_subclass(hook, reads, inputs, rebuilt)]


def order_hooks_after_reads(graph_module: torch.fx.GraphModule, inputs: Sequence[object] | None = None,
                            hooks: Sequence[object] = ()) -> int:
    """Move each hook handed an input tensor after the last read of that tensor; the number of hooks moved.

    ``inputs``: the graph's real ``inputs`` list on its first run, which tells which inputs share memory
    (without it, only the aliases the graph shows are found); ``hooks``: its hook objects (see
    :func:`mutating_hook_calls`).  Recompiles ``graph_module``'s code when
    anything moved.  Raises :class:`HookOrderError` where the order cannot be kept (Note [Hooks run after
    every read of the tensor they are given]).
    """
    graph = graph_module.graph
    input_reads = _input_reads(graph)
    moved_hooks = mutating_hook_calls(graph_module, hooks)
    if not moved_hooks:
        return 0
    hook_set = set(moved_hooks)
    same_memory = _same_memory(input_reads, inputs)
    position = {node: index for index, node in enumerate(graph.nodes)}
    moves: list[tuple[torch.fx.Node, torch.fx.Node]] = []
    for hook in moved_hooks:
        anchor = hook
        for tensor in (arg for arg in _handed(hook) if arg in input_reads):
            readers = {
                user for alias in _aliases(tensor, same_memory.get(tensor, set())) for user in alias.users if user is not hook and user not in hook_set
            }
            last = max(readers, key=position.__getitem__, default=hook)
            if position[last] <= position[anchor]:
                continue
            first_use = min(hook.users, key=position.__getitem__, default=None)
            if first_use is not None and position[first_use] < position[last]:
                raise HookOrderError(
                    f"compiled autograd scheduled the {_describe(hook)} hook, which is handed the tensor {tensor.name} "
                    f"from outside the backward, before {last.name} reads that tensor, and the hook's result is used "
                    f"by {first_use.name} before that read, so eager autograd's order (the hook after every read of "
                    "its tensor) cannot be restored. No gradient was produced. Make the hook return None (update its "
                    "tensor in place) or register it so that it is not handed that tensor."
                )
            anchor = last
        if anchor is not hook:
            moves.append((hook, anchor))
    # reversed: hooks sharing an anchor keep their order (each append lands right after the anchor)
    for hook, anchor in reversed(moves):
        anchor.append(hook)
    if moves:
        graph.lint()
        graph_module.recompile()
    return len(moves)
