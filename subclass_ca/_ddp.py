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
``mixed_precision``, delayed all-reduce) raises :class:`SubclassCAError` naming it, before any
gradient.  Costs: the Python reducer all-reduces per parameter (functional collectives, which
inductor may fuse), not per bucket; benchmarks/ has the figure.
"""

from __future__ import annotations

from typing import Any

from . import _compat
from .errors import SubclassCAError

__all__ = ["before_ddp_forward"]

_SWITCHED = "_subclass_ca_python_reducer"


def before_ddp_forward(module: Any) -> None:
    """Pick the reducer a DDP forward needs: the Python one inside a block, the module's own outside."""
    inside = _compat.BLOCKS.depth > 0
    if inside and not _compat.uses_python_reducer(module):
        unsupported = _compat.ddp_features(module)
        if unsupported:
            raise SubclassCAError(
                f"DistributedDataParallel with {', '.join(unsupported)} cannot run inside subclass_ca.enable(): "
                "compiled autograd needs torch's Python reducer, which does not implement it. Build the DDP module "
                "without it, or run this model's backward outside enable()."
            )
        _compat.to_python_reducer(module)
        setattr(module, _SWITCHED, True)
    elif not inside and getattr(module, _SWITCHED, False):
        _compat.to_cpp_reducer(module)
        setattr(module, _SWITCHED, False)

