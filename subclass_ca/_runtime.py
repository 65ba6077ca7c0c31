"""enable() blocks: turning compiled autograd on and off per thread, and the runtime's patches of torch.

The compiler compiled autograd calls lives in ``_compiler.py``, the compiled CA graph in
``_graph.py``, our errors for torch's refusals in ``_translate.py``.

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

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from . import _compat, diagnostics
from ._accumulate import accumulate_dummy_swap, accumulation_dtype
from ._compiler import CACompiler, cache_token
from ._ddp import before_ddp_forward
from ._epilogue import proxy_call_aot_backward
from ._hooks import trace_wrapped_swaps
from ._optimizer_step import frame_swaps
from ._translate import translated
from ._warm_start import cacheable as _cacheable
from ._warm_start.keys import aot_key_extension, remember_keyed
from ._warm_start.outside import outside_extension
from .config import Config
from .errors import SubclassCAError

__all__ = ["RUNTIME_PATCHES", "KEY_PATCHES", "enter_block", "exit_block", "current_token", "capture_with"]


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
        *([accumulate_dummy_swap()] if _compat.accumulate_grad_is_functional() else []),  # Note [Parameters that cannot allocate]
        *frame_swaps(),  # Note [Compiled optimizer steps over subclass gradients]
        *_compat.capture_watch_swaps(diagnostics.capture_abandoned),
        *([_cacheable.cache_global_swap()] if _compat.marked_cacheable_supported() else []),  # Note [Warm start through torch's caches]
        *([_compat.guard_requires_grad_swap()] if _compat.precompile_supported() else []),  # Note [Skipping Dynamo's trace of an unchanged CA graph]
        *([_compat.fsdp2_eager_hooks_swap(_compat.BLOCKS)] if _compat.fsdp2_loaded() and _compat.fsdp2_ca_detection_supported() else []),  # Note [FSDP2 under compiled autograd] (torch 2.11)
        *([_compat.pre_forward_swap(before_ddp_forward)] if _compat.ddp_supported() else []),  # Note [DDP under compiled autograd]
    ],
    resident=True,
)
"""What the runtime changes in torch; resident, acting only while a block is open (Note [Resident patches])."""

KEY_PATCHES = _compat.PatchSet(
    "subclass_ca cache keys",
    lambda: [_compat.aot_key_swap(aot_key_extension, outside_extension, remember_keyed, _compat.BLOCKS)]
    if _compat.aot_key_swap_supported() else [],
    resident=True,
)
"""torch's AOTAutogradCache key, extended by behaviour inside blocks (Note [Keys by behaviour]) and, outside them,
for a forward a saved cache names (Note [Forwards compiled outside a block]): installed when subclass_ca is
imported, so that it sees the first step's forward, which most loops compute before their first block."""


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
        KEY_PATCHES.install()  # again after a reset() put torch's own back
        _compat.BLOCKS.enter()
        entry.in_scope = True
        if miss_log and diagnostics.miss_reasons_available():
            diagnostics.start_miss_log()
            entry.miss_log = True
        entry.activation = _compat.activate(compiler, compiler.factory, dynamic=config.dynamic is True)  # Note [Static-first CA graphs]
    except BaseException:
        entry.close((None, None, None))
        raise
    _entries().append(entry)



def exit_block(owner: object, exc_info: tuple[Any, Any, Any]) -> bool:
    """Close ``owner``'s innermost block in this thread; inner blocks left open are closed first."""
    entries = _entries()
    if entries and entries[-1].owner is owner:  # the usual case: the innermost block exits
        suppressed = entries.pop().close(exc_info)
        if suppressed or exc_info[1] is None:
            return suppressed
        ours = translated(exc_info[1])
        if ours is not None:
            raise ours from exc_info[1]
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


KEY_PATCHES.install()  # Note [Forwards compiled outside a block]: before the first step's forward
