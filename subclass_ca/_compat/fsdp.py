"""FSDP2 (``fully_shard``) internals: its state and hook types, and whether it finished a backward."""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Sequence
from typing import Any

from ._lookup import lookup

__all__ = ["FSDP2_TYPES", "FSDP2_CA_DETECTION", "fsdp2_ca_detection_supported", "fsdp2_eager_hooks_swap", "fsdp2_loaded", "fsdp2_owners", "fsdp2_types", "fsdp2_state_of_hook", "fsdp2_states", "fsdp2_unfinished"]

FSDP2_TYPES = {
    "FSDPModule": "torch.distributed.fsdp:FSDPModule",
    "FSDPState": "torch.distributed.fsdp._fully_shard._fsdp_state:FSDPState",
    "RegisterPreBackwardFunction": "torch.distributed.fsdp._fully_shard._fsdp_state:RegisterPreBackwardFunction",
    "RegisterPostBackwardFunction": "torch.distributed.fsdp._fully_shard._fsdp_param_group:RegisterPostBackwardFunction",
}


FSDP2_PACKAGE = "torch.distributed.fsdp._fully_shard"


def fsdp2_loaded() -> bool:
    """Whether FSDP2 was imported at all (no FSDP2 hook can exist before); a dict lookup."""
    return FSDP2_PACKAGE in sys.modules


@functools.cache
def fsdp2_types() -> dict[str, type]:
    """FSDP2's state and backward-hook Function classes on this torch ({} when absent)."""
    found: dict[str, type] = {}
    for name, dotted in FSDP2_TYPES.items():
        try:
            found[name] = lookup(dotted)
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
    if module.startswith(FSDP2_PACKAGE):
        return hook
    return None


_PLAIN_HOOK_KINDS: set[Any] = set()
"""Hook kinds (see :func:`_hook_kind`) already found to have no FSDP2 owner."""


def _hook_kind(hook: Any) -> Any:
    """What decides :func:`fsdp2_state_of_hook` for ``hook``: its owner's type, module or own type."""
    owner = getattr(hook, "__self__", None)
    if owner is not None:
        return type(owner)
    if isinstance(hook, types.FunctionType):
        return hook.__module__
    return type(hook)


def fsdp2_owners(hooks: Sequence[Any]) -> list[Any]:
    """The FSDP2 owners of compiled autograd's hook list, in order (kinds found plain are skipped fast)."""
    owners = []
    for hook in hooks:
        kind = _hook_kind(hook)
        if kind in _PLAIN_HOOK_KINDS:
            continue
        owner = fsdp2_state_of_hook(hook)
        if owner is None:
            if len(_PLAIN_HOOK_KINDS) > 4096:  # generated autograd-function types: keep it bounded
                _PLAIN_HOOK_KINDS.clear()
            _PLAIN_HOOK_KINDS.add(kind)
        else:
            owners.append(owner)
    return owners


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


FSDP2_CA_DETECTION = "torch.distributed.fsdp._fully_shard._fsdp_state:detect_compiled_autograd"
"""torch 2.11 only: FSDP2 reads "is compiled autograd on" once, at its root's lazy init (the first forward),
into ``_fsdp_common._compiled_autograd_enabled``, and then skips tensor-subclass all-gather extensions
(``fsdp_pre_all_gather``) for the whole process."""


def fsdp2_ca_detection_supported() -> bool:
    try:
        lookup(FSDP2_CA_DETECTION)
        return hasattr(lookup("torch.distributed.fsdp._fully_shard._fsdp_common"), "_compiled_autograd_enabled")
    except (ImportError, AttributeError):
        return False


def fsdp2_eager_hooks_swap(scope: Any) -> Any:
    """Inside ``scope``, FSDP2's lazy init records compiled autograd as off: subclass_ca runs its hooks eagerly.

    Note [FSDP2 under compiled autograd] in ``subclass_ca/_fsdp2.py``: the CA graph is split at FSDP2's
    hooks and they run as in eager FSDP2, which is what torch 2.12 and later FSDP2 do anyway; on 2.11 the
    recorded flag would make those eager hooks skip a subclass's all-gather extension (an NF4 shard then
    reaches ``fsdp.all_gather_copy_in``, which torchao does not implement).
    """
    from ._patch import AttributeSwap, gated

    module_name, _, attr = FSDP2_CA_DETECTION.partition(":")
    common = lookup("torch.distributed.fsdp._fully_shard._fsdp_common")

    def make(original: Any) -> Any:
        def detect_compiled_autograd() -> None:
            original()
            common._compiled_autograd_enabled = False

        return gated(scope, original, detect_compiled_autograd)

    return AttributeSwap(lambda: lookup(module_name), attr, make)
