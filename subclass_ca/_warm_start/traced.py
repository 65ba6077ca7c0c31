"""Keep Dynamo's trace of each CA graph, so that a restarted process runs an unchanged one without tracing it.

Note [Skipping Dynamo's trace of an unchanged CA graph]
--------------------------------------------------------
With the caches warm (Note [Warm start through torch's caches] in ``cacheable.py``) a restarted
job still pays, per CA graph, Dynamo's trace of the graph's generated code: AOTAutogradCache is
keyed by the graph Dynamo outputs, so it can only be asked once that trace is done.  The trace
is the same in every process when the CA graph is: so we keep it, keyed as we key the graph.

* **What is kept.** A CA graph compiled with ``backend="inductor"`` (no ``mode``, whole graph)
  is compiled with a recording (torch's own precompile package): Dynamo writes into it the
  frame's guards and its transformed code, and the compiled graph is a *bundled* AOT entry
  (its kernels included).  ``save_cache()`` serializes the records of this process's graphs,
  one file each in the cache folder and, with a path, inside the cache file.
* **The key** is what the graph does: our build and torch's, the Python version, the settings'
  cache key, the graph's generated code, a key line per global that code reads (modules and
  importable objects by name; compiled autograd's ops, AOT prologues and our rebuild callables
  by ``keys.key_of``, which describes what they do), the values of its constants, and the
  Dynamo, AOTAutograd and inductor configs (``fingerprint.describe``: sets sorted, no addresses).
  Anything else (a global or config value we cannot describe) makes the graph unrecorded.  The canonical form of CA graphs (``_canonical.py``) makes the first
  restart's graph the cold run's.
* **Replay.** A captured graph whose key has a record gets the record installed on its own
  code object: the compiled graph under the frame's globals, the guards loaded against them.
  Its first call checks the guards like any compiled frame and runs the compiled graph: no
  trace, no AOT or inductor work.  A call the guards refuse (other sizes, dtypes, grad mode,
  global state) is traced and compiled as usual, so a record is never stale.
* **What the replayed frame does not guard.** Globals (the key covers them) and the type of
  ``self`` (a class made per graph module; the record sits on that module's own code).
  ``requires_grad`` of subclass inputs needs a fix in torch's guard pickler
  (``_compat.guard_requires_grad_swap``).
* **Only this user's records.** A record is read from the cache folder only when the folder is
  this user's alone and the record is a regular file carrying this user's signature (Note
  [Trusting a compile cache] in ``trust.py``); records from a cache file were checked by
  ``load_cache``.  Each record remembers where it came from (:class:`Record`): one that
  ``load_cache(..., trust_unsigned_code=True)`` let in is replayed by this process only and never
  signed again, into the folder or into a file.
* **Refusals.** A frame whose guards cannot be serialized (on torch 2.13 a hook closing over a
  local tensor; an object known by identity) makes torch give up the recording and fail the
  compile; that graph is compiled again without one (once, in the run that records) and is
  never replayed.
"""

from __future__ import annotations

import dataclasses
import hmac
import os
import threading
from typing import Any

import torch

from .. import _compat, diagnostics
from ..config import Config
from ..errors import CacheFileError
from . import trust
from .keys import graph_key

__all__ = ["Record", "TracedGraph", "TracedPiece", "compile_traced", "MARKER_PREFIX", "marked", "mark", "trace_count", "holds_records", "signable_records", "add_records", "write_records",
           "records_folder", "stats"]

stats = {"recorded": 0, "replayed": 0, "refused": 0}
"""This process: graphs compiled with a recording, graphs whose record was installed, recordings torch gave up."""

_SUBDIR = "subclass_ca_traced"
_RECORD_MAGIC = b"subclass_ca kept trace 1\n"
_PURPOSE = b"subclass_ca kept trace"
_pending: dict[str, Any] = {}
_lock = threading.Lock()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Record:
    """A kept trace this process holds, and where it came from (Note [Trusting a compile cache] in ``trust.py``)."""

    data: bytes = dataclasses.field(repr=False)
    own: bool
    """This process compiled the graph and made the record."""
    verified_with: bytes | None = dataclasses.field(default=None, repr=False)  # a secret: never in a repr
    """A record read from a cache file: the key its signature verified under; None: let in unverified by the opt-in."""

    def may_sign(self, signing_key: bytes) -> bool:
        """Whether a file or folder signed with ``signing_key`` may hold it: never what the opt-in alone let in."""
        return self.own or (self.verified_with is not None and hmac.compare_digest(self.verified_with, signing_key))


_records: dict[str, Record] = {}

MARKER_PREFIX = "forward-"
"""Records named so are markers, not kept traces (Note [Forwards compiled outside a block] in ``outside.py``)."""
_MARKER = b"subclass_ca forward outside a block 1\n"


def marked(torch_key: str) -> bool:
    """Whether a marker this user signed (the cache folder's, or a loaded file's) names a forward compiled outside a
    block by torch's AOTAutogradCache key."""
    return _find(MARKER_PREFIX + torch_key) == _MARKER


def mark(torch_key: str) -> None:
    """This process saves the entry of a forward compiled outside a block: its marker joins the records
    ``save_cache()`` signs."""
    name = MARKER_PREFIX + torch_key
    held = _records.get(name)
    if held is None or not held.own:
        _records[name] = Record(data=_MARKER, own=True)


def trace_count(records: dict[str, Any]) -> int:
    """How many of ``records`` are kept traces (the rest are markers)."""
    return sum(not name.startswith(MARKER_PREFIX) for name in records)


def _folders() -> tuple[str, str]:
    cache = _compat.cache_dir()
    return cache, os.path.join(cache, _SUBDIR)


def records_folder() -> str:
    """Where this process keeps its traces: ``<torch's cache folder>/subclass_ca_traced``."""
    return _folders()[1]


def _signing_key(folder: str) -> bytes | None:
    try:
        return trust.resolve_key()
    except trust.KeyUnavailable as error:
        trust.warn_once("key", folder, f"subclass_ca: kept traces in {folder} are neither read nor written: {error}")
        return None


def _unsafe_folder(cache: str, folder: str) -> bool:
    problem = trust.folder_problem(cache, folder)
    if problem is not None:
        trust.warn_once(
            "folder", folder,
            f"subclass_ca: not reading or writing kept traces in {folder}: {problem}, so someone else could put code "
            "there that this job would run. This run traces its CA graphs afresh, as stock compiled autograd does. "
            f"Fix: make the folders yours alone (chown, then chmod go-w {cache} {folder}) or set "
            "TORCHINDUCTOR_CACHE_DIR to a folder of your own. (torch's own cache entries there are torch's to read.)",
        )
        return True
    return False


def _find(key: str) -> bytes | None:
    """The record of ``key``: from a loaded cache file, else from the cache folder if this user wrote it there."""
    found = _records.get(key)
    if found is not None:
        return found.data
    cache, folder = _folders()
    path = os.path.join(folder, key)
    if not os.path.lexists(path) or _unsafe_folder(cache, folder):
        return None
    signing_key = _signing_key(folder)
    if signing_key is None:
        return None
    try:
        data = trust.read_private_file(path, what="the kept-trace record")
    except CacheFileError as error:
        trust.warn_once("record", folder, f"subclass_ca: a kept trace in {folder} was ignored: {error}")
        return None
    if data is None:
        return None
    record = _unsealed(signing_key, key, data)
    if record is None:
        trust.warn_once(
            "record", folder,
            f"subclass_ca: ignored the kept trace {path}: it is not signed with your key (key id "
            f"{trust.key_id(signing_key)}), so someone else, or a job under another {trust.KEY_ENV}, wrote it. "
            "This CA graph is traced afresh. Delete the file if you did not expect it.",
        )
    return record


def _sealed(signing_key: bytes, key: str, record: bytes) -> bytes:
    return _RECORD_MAGIC + trust.sign(signing_key, _PURPOSE, key.encode(), record) + record


def _unsealed(signing_key: bytes, key: str, data: bytes) -> bytes | None:
    """The record in ``data`` if it is signed with ``signing_key`` under its name ``key``; None otherwise."""
    if not data.startswith(_RECORD_MAGIC):
        return None
    signature, record = data[len(_RECORD_MAGIC):len(_RECORD_MAGIC) + 32], data[len(_RECORD_MAGIC) + 32:]
    return record if trust.verify(signing_key, signature, _PURPOSE, key.encode(), record) else None


class TracedGraph:
    """A CA graph compiled with a recording, or with a record installed: the callable and what to do on refusal."""

    def __init__(self, graph_module: torch.fx.GraphModule, options: dict[str, Any] | None, dynamic: bool | None, key: str) -> None:
        self._forward = graph_module.forward
        backend = _compat.flat_input_backend(_compat.inductor_backend(options, dynamic))
        self._compiles = 0

        def counted_backend(*args: Any, **kwargs: Any) -> Any:
            # A second compile of the frame (other inputs, e.g. another subclass type) is not what
            # the key describes: the recording is dropped (Note [Keys by behaviour]).
            self._compiles += 1
            if self._compiles > 1:
                self._drop_recording()
            return backend(*args, **kwargs)

        self._backend = counted_backend
        self._dynamic = dynamic
        self.key = key
        self._recording: Any = None
        recorded = _find(key)
        self.package = None
        if recorded is not None:
            try:
                _compat.install_frame(recorded, self._forward.__func__.__code__, self._forward.__globals__)  # type: ignore[attr-defined]  # a bound method (the graph module's forward)
                stats["replayed"] += 1
                diagnostics.record_warm_start("hit", self.key)
            except Exception:  # noqa: BLE001  -- a record this torch cannot load: trace and compile as without one
                recorded = None
        if recorded is None:
            diagnostics.record_warm_start("miss", self.key)
            self.package = _compat.new_package(self._forward)
        self.compiled = self._optimize(self.package)

    def _optimize(self, package: Any) -> Any:
        return _compat.dynamo_optimize(self._backend, dynamic=self._dynamic, package=package,
                                       guard_filter=_keep_guards)(self._forward)

    def refused(self) -> bool:
        """Whether torch gave up the recording while compiling (its guards cannot be serialized)."""
        return self.package is not None and _compat.recording_bypassed(self.package)

    def without_recording(self) -> Any:
        """The same graph compiled without a recording (after :meth:`refused`)."""
        self.package = None
        stats["refused"] += 1
        diagnostics.record_warm_start("refused", self.key, "its guards cannot be serialized")
        self.compiled = self._optimize(None)
        return self.compiled

    def _drop_recording(self) -> None:
        with _lock:
            if self._recording is not None and _pending.get(self.key) is self._recording:
                del _pending[self.key]
        self._recording = None

    def run_first(self, *args: Any, **kwargs: Any) -> Any:
        """The first call: a recording torch gave up compiles again without one; a finished one waits for
        ``save_cache()``."""
        try:
            result = self.compiled(*args, **kwargs)
        except Exception:
            if not self.refused():
                raise
            result = self.without_recording()(*args, **kwargs)  # its guards cannot be kept: compiled as usual
        self.compiled_once()
        return result

    def compiled_once(self) -> None:
        """The first call succeeded: the recording (if any) is complete and waits for ``save_cache()``."""
        if self.package is not None and self._compiles <= 1:
            self._recording = self.package
            with _lock:
                _pending[self.key] = self.package
            stats["recorded"] += 1
            diagnostics.record_warm_start("recorded", self.key)
            self.package = None


class TracedPiece:
    """A regional piece compiled through a recording or a replay, as a plain callable: its first call is
    :meth:`TracedGraph.run_first`, every later one the compiled frame."""

    def __init__(self, traced: TracedGraph) -> None:
        self._traced: TracedGraph | None = traced
        self._compiled = traced.compiled

    def __call__(self, *args: Any) -> Any:
        traced = self._traced
        if traced is None:
            return self._compiled(*args)
        result = traced.run_first(*args)
        self._compiled, self._traced = traced.compiled, None
        return result


def _keep_guards(entries: Any) -> list[bool]:
    return [not _compat.is_dropped_guard(entry) for entry in entries]


def compile_traced(
    graph_module: torch.fx.GraphModule, config: Config, kwargs: Any, behaviour: str | None, *, dynamic: bool | None = None
) -> TracedGraph | None:
    """The CA graph compiled through a recording or a replay, when it qualifies; None: compile it as before.

    ``kwargs``: the ``torch.compile`` keywords the graph would get; ``behaviour``: its behaviour key
    (None or this process's nonce: no record, Note [Keys by behaviour]); ``dynamic``: its ``dynamic=``.
    """
    if not config.persistent_caches or set(kwargs) - {"options"} or not _compat.precompile_supported():
        return None
    if behaviour is None or behaviour.startswith("process-local"):
        return None
    key = graph_key(graph_module, config, behaviour)
    if key is None:
        return None
    return TracedGraph(graph_module, kwargs.get("options"), dynamic, key)


def _serialize_pending() -> None:
    """Turn this process's finished recordings into records (those torch can replay)."""
    with _lock:
        pending = dict(_pending)
        _pending.clear()  # serialized once; the recordings (and the graphs they hold) are let go
    for key, package in pending.items():
        held = _records.get(key)
        if held is None or not held.own:  # this process's own recording replaces one a file brought
            recorded = _compat.recorded_frame(package)
            if recorded is not None:
                _records[key] = Record(data=recorded, own=True)


def holds_records() -> bool:
    """Whether this process holds any record (compiled here, or read from a cache file)."""
    _serialize_pending()
    return bool(_records)


def signable_records(signing_key: bytes) -> dict[str, bytes]:
    """The records a file or folder signed with ``signing_key`` may hold, by key (Record.may_sign).

    Those of graphs this process compiled, and those read from a cache file that verified under
    this same key; never one that ``load_cache(..., trust_unsigned_code=True)`` let in unverified.
    """
    _serialize_pending()
    return {key: record.data for key, record in _records.items() if record.may_sign(signing_key)}


def add_records(records: dict[str, bytes], *, verified_with: bytes | None) -> None:
    """Records read from a cache file (``load_cache``): found before the cache folder's.

    ``verified_with``: the key the file's signature verified under; None when only the opt-in let it in.
    """
    for key, data in records.items():
        held = _records.get(key)
        if held is None or not held.own:  # this process's own record of the graph stays
            _records[key] = Record(data=data, own=False, verified_with=verified_with)


def write_records(records: dict[str, bytes] | None = None) -> int:
    """Sign and write records into the cache folder (one file per key, atomically, owner-only); returns how many are new.

    ``records``: by default this process's :func:`signable_records` under the folder's key.
    Nothing is written into a folder that is not this user's alone (it would never be read); a
    record whose name is taken by something that is not a file is skipped with one warning.
    """
    cache, folder = _folders()
    if not (holds_records() if records is None else records):
        return 0
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
    except OSError as error:  # something that is not a folder at its name
        trust.warn_once("write", folder, f"subclass_ca: could not make the kept-trace folder {folder} ({error}); a "
                        "restart traces its CA graphs afresh. Remove what is at that name.")
        return 0
    if _unsafe_folder(cache, folder):
        return 0
    signing_key = _signing_key(folder)
    if signing_key is None:
        return 0
    if records is None:
        records = signable_records(signing_key)
    written = 0
    for key, data in records.items():
        path = os.path.join(folder, key)
        sealed = _sealed(signing_key, key, data)
        try:
            if trust.read_private_file(path, what="the kept-trace record") == sealed:
                continue
        except CacheFileError:
            pass  # not ours alone, or not a file: replaced below
        try:
            trust.write_private_file(path, sealed)
        except OSError as error:  # a directory at the record's name, a full disk: the job goes on without it
            trust.warn_once("write", folder, f"subclass_ca: could not write the kept trace {path} ({error}); this CA "
                            "graph is traced afresh by a restart. Remove what is at that name.")
            continue
        written += 1
    return written
