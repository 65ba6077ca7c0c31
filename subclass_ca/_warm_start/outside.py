"""Forwards compiled outside an ``enable()`` block whose backward subclass_ca captured: saved and found by behaviour.

Note [Forwards compiled outside a block]
----------------------------------------
Most training loops compute the loss outside the block (``loss = model(x)``, then ``with enable():
loss.backward()``).  Such a forward is compiled by ``torch.compile`` alone, and two things kept it
out of the warm start: its AOTAutogradCache key is torch's own, which describes a wrapper-subclass
input by its type and metadata, not by the code its dispatch runs (Note [Keys by behaviour]), so
``save_cache()`` left its entry unwritten; and torch writes a forward's entry only once it compiles
its backward, which compiled autograd never asks for.  So every restart traced it again.

subclass_ca acts on such a forward only when its backward was captured by subclass_ca and saved;
a forward it never captured keeps torch's key, whatever this process does:

* **Observed.**  Outside every block, the key swap (``_compat.aot_key_swap``, installed when
  subclass_ca is imported, so that it sees the first step's forward) remembers, for a compile with
  a wrapper-subclass input, the graph and example inputs under torch's key: the last
  :data:`REMEMBERED` of them, and nothing is changed.
* **Saved.**  ``save_cache()`` meets each forward whose backward a block captured
  (``cacheable.complete_forward_entries``).  One that was compiled outside with torch's key and is
  remembered gets its behaviour key appended to that key, exactly as a forward compiled inside a
  block gets it, so its entry is written under the extended key; and a *marker* record named after
  torch's key joins the kept traces (signed the same way, into the folder and the cache file:
  Note [Trusting a compile cache] in ``trust.py``).
* **Restarted.**  A compile outside every block whose torch key has a marker this user signed
  (the cache folder's, or a loaded file's) gets its behaviour key appended, as inside a block, and
  finds the saved entry exactly when it computes what was saved: a changed forward is another
  torch key (no marker: torch's own path), a changed subclass or dispatch another behaviour key (a
  miss, then a fresh compile).  Where the behaviour key cannot be established (symbolic sizes)
  torch bypasses its cache for that compile.

The cache folder alone (no ``save_cache()`` call) does not warm such a forward, nor one compiled
inside a block: its entry exists only once its backward is compiled, and doing that unasked (at
exit) would charge every process that captures a backward for the compiles.  One ``save_cache()``
after the first steps is what it takes; docs/warm_start.md says so.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from typing import Any

from .. import _compat
from . import traced
from .fingerprint import Unstable, process_local
from .keys import aot_key_extension, behaviour_key, behaviour_keyed, remember_keyed

__all__ = ["REMEMBERED", "outside_extension", "key_for_save"]

REMEMBERED = 64
"""How many forwards compiled outside a block (with a wrapper-subclass input) are remembered until ``save_cache()``."""

_seen: collections.OrderedDict[str, tuple[Any, tuple[Any, ...]]] = collections.OrderedDict()
_lock = threading.Lock()


def outside_extension(module: Any, example_inputs: Sequence[Any], torch_key: str) -> str | None:
    """What to append to torch's key of a compile outside every block (Note [Forwards compiled outside a block]):
    its behaviour key where a marker this user signed names ``torch_key``, else None (remembered for ``save_cache()``
    when it has a wrapper-subclass input)."""
    if not any(_compat.is_traceable_wrapper_subclass(value) for value in example_inputs):
        return None
    if traced.marked(torch_key):
        return aot_key_extension(module, example_inputs, None)
    with _lock:
        _seen[torch_key] = (module, tuple(example_inputs))
        _seen.move_to_end(torch_key)
        while len(_seen) > REMEMBERED:
            _seen.popitem(last=False)
    return None


def key_for_save(forward_cls: Any) -> bool:
    """Give a captured forward compiled outside a block its behaviour key before ``save_cache()`` writes its entry,
    and mark it (Note [Forwards compiled outside a block]); False: not such a forward, or no key can be established."""
    torch_key = _compat.forward_cache_key(forward_cls)
    if torch_key is None or behaviour_keyed(torch_key):
        return False
    with _lock:
        seen = _seen.pop(torch_key, None)
    if seen is None:
        return False
    module, example_inputs = seen
    what = "a forward compiled outside a block"
    try:
        extended = _compat.extended_cache_key(torch_key, behaviour_key(module, example_inputs))
    except Unstable as why:
        process_local(what, str(why))
        return False
    if not _compat.rekey_pending_forward(forward_cls, extended):
        return False
    remember_keyed(extended)
    traced.mark(torch_key)
    return True
