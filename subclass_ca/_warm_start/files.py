"""``save_cache`` / ``load_cache``: ship torch's compile artifacts with a checkpoint.

A restarted job skips compiling when torch's caches already hold its graphs; with subclass_ca
that includes every CA graph and split FSDP2 piece (Note [Warm start through torch's caches]
in ``cacheable.py``).  On one machine a persistent ``TORCHINDUCTOR_CACHE_DIR`` is all it takes;
to move the artifacts with a checkpoint (another machine, a fresh container, every rank of a
torchrun job) save them after the first steps and load them before the first step of the next
run.  The file is torch's mega-cache (``torch.compiler.save_cache_artifacts``) behind a header
naming the torch and subclass_ca builds that wrote it: a file from another build, or a
damaged one, is refused with :class:`CacheFileError` (or, with ``strict=False``, skipped with
a warning so the job compiles afresh), never loaded into the caches.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import warnings
from typing import Any

import torch

from .. import _compat
from ..errors import CacheFileError
from .fingerprint import package_digest
from . import traced

__all__ = ["save_cache", "load_cache", "CacheFile"]

_MAGIC = b"subclass_ca compile cache\n"
_FORMAT = 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheFile:
    """What a cache file holds, as :func:`save_cache` wrote or :func:`load_cache` read it."""

    path: str
    """The file, or the cache folder when :func:`save_cache` was given no path."""
    torch_version: str
    subclass_ca: str
    """subclass_ca's version and source digest."""
    artifact_bytes: int
    forward_entries_written: int = 0
    """Forward graphs whose cache entry :func:`save_cache` wrote (compiling their backward, Note [Warm start through torch's caches])."""
    traced_graphs: int = 0
    """CA graphs whose Dynamo trace the file (or folder) holds (Note [Skipping Dynamo's trace of an unchanged CA graph])."""


def _header() -> dict[str, object]:
    return {"format": _FORMAT, "torch": str(torch.__version__), "subclass_ca": package_digest()}


def _warn_if_ca_graphs_are_not_cached() -> None:
    missing = [name for name in _compat.missing_optional_features() if name.startswith(("AOTAutogradCache key pickler", "AOT lazy backward compiler"))]
    if missing or not _compat.marked_cacheable_supported():
        warnings.warn(
            f"subclass_ca.save_cache(): torch {_compat.TORCH_VERSION} cannot cache compiled-autograd graphs "
            f"({'; '.join(missing) or 'no AOTAutogradCache allowlist for them'} missing): what it saves warms the "
            "forward graphs only, and a restarted job traces and compiles each CA graph again, as under stock "
            "compiled autograd. torch >= 2.13 caches them (docs/warm_start.md).",
            RuntimeWarning,
            stacklevel=3,
        )


def save_cache(path: str | os.PathLike[str] | None = None) -> CacheFile:
    """Complete torch's compile caches and write every artifact of this process to ``path``.

    Call it after the first training steps (each graph compiled once).  It first writes the cache
    entries of forward graphs whose backward ran under compiled autograd (torch writes a forward's
    entry only once it compiles that backward itself, which compiled autograd never asks for:
    this compiles each such backward once).  With no ``path`` that is all: a persistent
    ``TORCHINDUCTOR_CACHE_DIR`` then warms the next run.  With a ``path`` it also writes the file
    :func:`load_cache` reads; raises :class:`CacheFileError` when nothing was compiled with a
    cacheable backend (``inductor``).
    """
    from .cacheable import complete_forward_entries

    _warn_if_ca_graphs_are_not_cached()
    completed = complete_forward_entries()
    records = traced.pending_records()
    traced.write_records(records)
    if path is None:
        return CacheFile(path=_compat.cache_dir(), torch_version=str(torch.__version__), subclass_ca=package_digest(),
                         artifact_bytes=0, forward_entries_written=completed, traced_graphs=len(records))
    artifacts = _compat.save_cache_artifacts()
    if not artifacts:
        raise CacheFileError(
            f"save_cache({os.fspath(path)!r}): torch recorded no compile artifact in this process. Call it after "
            "the first steps have compiled (backend='inductor'; torch.compile's other backends have no persistent cache)."
        )
    payload = artifacts + pickle.dumps(records)
    header = _header()
    header["artifact_bytes"] = len(artifacts)
    header["sha256"] = hashlib.sha256(payload).hexdigest()
    tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(_MAGIC + json.dumps(header).encode() + b"\n" + payload)
    os.replace(tmp, path)  # a reader never sees half a file
    return CacheFile(path=os.fspath(path), torch_version=str(header["torch"]), subclass_ca=str(header["subclass_ca"]),
                     artifact_bytes=len(artifacts), forward_entries_written=completed, traced_graphs=len(records))


def load_cache(path: str | os.PathLike[str], *, strict: bool = True, missing_ok: bool = False) -> CacheFile | None:
    """Load a :func:`save_cache` file into this process's compile caches; call it before the first step.

    ``missing_ok``: a missing file returns None (a job's very first run).  ``strict=False``: a
    file written by another torch or subclass_ca build, or damaged, is skipped with a warning
    and None is returned (the job compiles afresh); by default it raises :class:`CacheFileError`.
    """
    name = os.fspath(path)
    if missing_ok and not os.path.exists(name):
        return None
    try:
        with open(name, "rb") as f:
            data = f.read()
        header, payload = _parse(name, data)
        artifacts, records = payload[:header["artifact_bytes"]], pickle.loads(payload[header["artifact_bytes"]:])  # noqa: S301
        _compat.load_cache_artifacts(artifacts)
        traced.add_records(records)
    except CacheFileError as error:
        if strict:
            raise
        warnings.warn(f"{error} Skipped: this run compiles afresh.", RuntimeWarning, stacklevel=2)
        return None
    return CacheFile(path=name, torch_version=str(header["torch"]), subclass_ca=str(header["subclass_ca"]),
                     artifact_bytes=len(artifacts), traced_graphs=len(records))


def _parse(name: str, data: bytes) -> tuple[dict[str, Any], bytes]:
    if not data.startswith(_MAGIC):
        raise CacheFileError(f"load_cache({name!r}): not a subclass_ca cache file (written by subclass_ca.save_cache).")
    line, sep, artifacts = data[len(_MAGIC):].partition(b"\n")
    try:
        header = json.loads(line) if sep else None
    except ValueError:
        header = None
    if not isinstance(header, dict) or header.get("sha256") != hashlib.sha256(artifacts).hexdigest():
        raise CacheFileError(f"load_cache({name!r}): the file is damaged (header or checksum does not match); delete it.")
    mine = _header()
    foreign = [f"{k} {header.get(k)!r} (this process: {mine[k]!r})" for k in ("format", "torch", "subclass_ca") if header.get(k) != mine[k]]
    if foreign:
        raise CacheFileError(
            f"load_cache({name!r}): written by another build: {'; '.join(foreign)}. Its artifacts cannot be reused; "
            "delete the file or pass strict=False to compile afresh."
        )
    return header, artifacts
