"""DistributedDataParallel inside ``enable()`` blocks, whatever ``torch._dynamo.config.optimize_ddp`` says.

Note [DDP under compiled autograd]
----------------------------------
DDP all-reduces gradients from hooks its C++ reducer puts on each parameter's AccumulateGrad;
compiled autograd cannot capture those and refuses the backward ("not compatible with C++ DDP
Reducer").  torch's answer is ``optimize_ddp="python_reducer"``, read when the DDP module is
*constructed*: the all-reduce then runs from post-accumulate-grad hooks (functional collectives)
that compiled autograd captures into the CA graph.  Users build their DDP module once, outside
any block, so a flag set inside one would come too late, and one set process-wide changes what
the program does outside blocks.

So the switch is per module and per use: a DDP module whose forward runs inside a block with the
C++ reducer is moved to torch's Python reducer for that forward (the C++ reducer's hooks removed,
torch's own Python hooks registered: the code ``python_reducer`` runs); the first forward of that
module outside every block moves it back to a fresh C++ reducer, built as its constructor builds
it.  A loop that enters a block every step switches once.  ``no_sync()``, ``find_unused_parameters``
and comm hooks registered with ``register_comm_hook`` carry over (the Python reducer reads the
same module attributes).  What the Python reducer does not implement (``static_graph=True``,
``mixed_precision``, delayed all-reduce) raises :class:`DDPUnsupportedError` naming it, before any
gradient.  Costs: the Python reducer all-reduces per parameter (functional collectives); subclass_ca
buckets them again (Note [Bucketing the Python reducer's all-reduces]); benchmarks/ has the figures.

Note [Bucketing the Python reducer's all-reduces]
-------------------------------------------------
The Python reducer issues one all-reduce per parameter, with a wait right after it: per step, as many
collectives as trainable parameters, where the C++ reducer sends a few buckets.  torch's answer lives
in inductor: post-grad passes fuse the reducer's all-reduces into buckets and move each wait to its
first use, and torch's ``python_reducer`` mode switches them on *process-wide* when it builds the
module (``_fuse_ddp_communication``, with the module's ``bucket_cap_mb``).  A module we move to the
Python reducer never went through that constructor, so the CA graphs compiled while it is there get
those options, scoped to their own ``torch.compile`` (inductor's ``options``), the module's own bucket
size included.  The size travels with the capture, never in module state: a CA graph reads it at its first run
from its own hooks (each post-accumulate-grad hook of the Python reducer closes over its DDP module), and every
compile of that graph (whole, its regional or split pieces, a recompile with graph breaks) uses it, whatever DDP
forward runs before or after; two captures of modules with different sizes compile with their own, and a graph
holding the hooks of several DDP modules takes the smallest size among them (a bucket never exceeds what any of
them asked for).  One choice differs from torch's default: a bucket is one *coalesced* all-reduce, not a
concatenated one.  Concatenation hands each gradient back as a view into the bucket's buffer, and a
wrapper subclass whose parts must share an offset (TwoTensor) then fails to rebuild its gradient
(Dynamo reports it as "Attempt to trace generator"); coalescing keeps every gradient its own tensor.
The passes only match the reducer's pattern (divide, all-reduce, wait, copy into ``.grad``); other
all-reduces in the graph keep their place and only their waits may move later.
``aot_eager`` (``enable()``'s default) runs AOT's graph op by op with none of inductor's passes, so there
the CA graph is compiled by torch's ``aot_eager`` with a forward compiler that runs the same two passes
first: still op by op, one collective per bucket (on two ranks the gradients are bitwise those of
per-parameter all-reduces, tests/test_ddp.py; with more ranks a collective library may order a bucket's
sums differently, as DDP's own buckets may).  Options a user passes win; ``mode=``
excludes ``options`` in ``torch.compile``, so a block compiled with a mode keeps one collective per
parameter, as does any other backend, and a CA graph handed to a ``torch.compile``-d train step's own
compiler (flag style).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from . import _compat
from .errors import DDPUnsupportedError

__all__ = ["before_ddp_forward", "bucket_mb_of_hooks", "with_bucketing"]

_SWITCHED = "_subclass_ca_python_reducer"


def before_ddp_forward(module: Any) -> None:
    """Pick the reducer a DDP forward needs: the Python one inside a block, the module's own outside."""
    if _compat.BLOCKS.depth > 0:
        if not _compat.uses_python_reducer(module):
            unsupported = _compat.ddp_features(module)
            if unsupported:
                raise DDPUnsupportedError(
                    f"DistributedDataParallel with {', '.join(unsupported)} cannot run inside subclass_ca.enable(): "
                    "compiled autograd needs torch's Python reducer, which does not implement it. Build the DDP module "
                    "without it, or run this model's backward outside enable()."
                )
            _compat.to_python_reducer(module)
            setattr(module, _SWITCHED, True)
    elif getattr(module, _SWITCHED, False):
        _compat.to_cpp_reducer(module)
        setattr(module, _SWITCHED, False)


def bucket_mb_of_hooks(hooks: Iterable[Any] | None) -> int | None:
    """The bucket size a CA graph with these hooks compiles with: the smallest of the DDP modules whose Python
    reducer registered them, None (no bucketing) where none did (Note [Bucketing the Python reducer's
    all-reduces])."""
    sizes = {_compat.bucket_size_mb(module) for module in map(_compat.reducer_module, hooks or ()) if module is not None}
    return min(sizes) if sizes else None


def with_bucketing(backend: Any, kwargs: Mapping[str, Any], bucket_mb: int | None) -> tuple[Any, Mapping[str, Any]]:
    """The backend and ``torch.compile`` keywords of a CA graph (or piece) captured with ``bucket_mb``
    (:func:`bucket_mb_of_hooks`), bucketing the Python reducer's all-reduces by it where that applies (Note [Bucketing
    the Python reducer's all-reduces]); the user's own options win."""
    if bucket_mb is None:
        return backend, kwargs
    if backend == "inductor" and "mode" not in kwargs:
        options = _compat.bucketing_options(bucket_mb)
        return backend, {**kwargs, "options": {**options, **(kwargs.get("options") or {})}} if options else kwargs
    if backend == "aot_eager":
        return _compat.bucketing_aot_eager(bucket_mb) or backend, kwargs
    return backend, kwargs
