"""One exception hierarchy for subclass_ca.

Every message names the offending subclass or handler and says what to do next,
so a user never has to read our source to fix their code.
"""

from __future__ import annotations

__all__ = [
    "SubclassCAError",
    "UnsupportedTorchError",
    "RegistrationError",
    "DuplicateHandlerError",
    "RebuildError",
    "MetadataMismatchError",
    "UnsupportedSubclassError",
    "FSDP2UnsupportedError",
    "DDPUnsupportedError",
    "HookOnSubclassError",
    "HookOrderError",
    "GraphBreakError",
    "BackwardCompileError",
    "RegionalCompileError",
    "CompiledOptimizerStepError",
    "CacheFileError",
    "UntrustedCacheWarning",
]


class SubclassCAError(RuntimeError):
    """Base class of every error subclass_ca raises on purpose."""


class UnsupportedTorchError(SubclassCAError):
    """The installed torch lacks an internal hook subclass_ca needs."""


class RegistrationError(SubclassCAError, TypeError):
    """A handler registration was invalid (wrong class, signature or mode)."""


class DuplicateHandlerError(RegistrationError):
    """A handler for this class is already registered and ``replace`` was not set."""


class RebuildError(SubclassCAError):
    """A handler's ``rebuild`` raised, or returned something that is not the subclass."""


class MetadataMismatchError(RebuildError):
    """A rebuilt subclass differs from the metadata recorded at capture (type, size, stride, dtype, device)."""


class UnsupportedSubclassError(SubclassCAError):
    """A subclass cannot be rebuilt inside the compiled-autograd graph."""


class FSDP2UnsupportedError(SubclassCAError):
    """An FSDP2 (``fully_shard``) configuration that cannot be made correct on this torch."""


class DDPUnsupportedError(SubclassCAError):
    """A DistributedDataParallel module with a setting torch's Python reducer, which compiled autograd needs, does not
    implement (``static_graph=True``, ``mixed_precision``, delayed all-reduce; Note [DDP under compiled autograd])."""


class HookOnSubclassError(SubclassCAError):
    """A tensor or module backward hook inside the compiled region that cannot be captured as eager runs it."""


class HookOrderError(SubclassCAError):
    """A hook handed a parameter cannot run after every read of it, as eager autograd runs it (Note [Hooks run after
    every read of the tensor they are given] in ``_hook_order.py``)."""


class GraphBreakError(SubclassCAError):
    """The backward graph needs a graph break (code Dynamo cannot trace) while ``fullgraph=True``."""


class BackwardCompileError(SubclassCAError):
    """Compiling the backward graph failed for a reason that is not a graph break (``fullgraph=False`` would not help)."""


class RegionalCompileError(BackwardCompileError):
    """A regional piece of the backward failed on its first run after earlier pieces ran (their gradients accumulated)."""


class CompiledOptimizerStepError(SubclassCAError):
    """A ``torch.compile``-d optimizer step over plain parameters with subclass gradients, on a torch that computes it wrong."""


class CacheFileError(SubclassCAError):
    """A compile-cache file (``save_cache``/``load_cache``) is corrupt, not signed by this user's key, not ours,
    or from another torch / subclass_ca (Note [Trusting a compile cache] in ``_warm_start/trust.py``)."""


class UntrustedCacheWarning(RuntimeWarning):
    """Cached code was not used because this user did not write it: a cache folder another user owns or
    others may write, or a kept-trace record not signed with this user's key.  The job compiles afresh."""
