"""``save_cache`` / ``load_cache``: ship torch's compile artifacts with a checkpoint.

A restarted job skips compiling when torch's caches already hold its graphs; with subclass_ca
that includes every CA graph and split FSDP2 piece (Note [Warm start through torch's caches]
in ``cacheable.py``).  On one machine a persistent ``TORCHINDUCTOR_CACHE_DIR`` is all it takes;
to move the artifacts with a checkpoint (another machine, a fresh container, every rank of a
torchrun job) save them after the first steps and load them before the first step of the next
run.  The file is torch's mega-cache (``torch.compiler.save_cache_artifacts``) behind a header
naming the torch and subclass_ca builds that wrote it, signed with this user's (or this job's)
key (Note [Trusting a compile cache] in ``trust.py``): a file signed with another key, changed
after it was written, from another build, or damaged, is refused with :class:`CacheFileError`
before anything in it is parsed or unpickled (or, with ``strict=False``, skipped with a warning so
the job compiles afresh), never loaded into the caches.

The layout: the magic line; ``hmac-sha256 <key id> <signature>``; the JSON header; torch's
artifacts; our pickled records.  The signature covers every byte after its own line.  The file
is written privately and atomically and read only if it is a regular file (``trust.write_private_file``,
``trust.read_regular_file``); what ``trust_unsigned_code=True`` let in is never signed into a file
again (Note [Trusting a compile cache]).
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import hmac
import json
import os
import pickle
import warnings
from typing import Any

import torch

from .. import _compat
from .._compat import caches as _torch_caches
from ..errors import CacheFileError
from . import traced, trust
from .fingerprint import package_digest

__all__ = ["save_cache", "load_cache", "CacheFile"]

_MAGIC = b"subclass_ca compile cache\n"
_FORMAT = 3
_SIGNATURE = b"hmac-sha256 "
_PURPOSE = b"subclass_ca cache file"
_unverified_artifacts: set[tuple[str, str]] = set()
"""torch's artifacts (type, key) that only ``trust_unsigned_code=True`` let into this process: never signed into a file."""
_unverified_unknown = False
"""The opt-in let in torch artifacts this torch cannot name (its mega-cache format unreadable): no file is signed."""


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


def _signing_key_argument(function: str, signing_key: bytes | str | None, key: bytes | str | None) -> bytes | str | None:
    """``signing_key=``, or ``key=``, its spelling before 1.0 (deprecated: "key" alone also names lookup keys and
    handler metadata keys; the glossary in docs/design.md)."""
    if key is None:
        return signing_key
    if signing_key is not None:
        raise TypeError(f"{function}() got both signing_key= and key=, its deprecated spelling: pass signing_key= only")
    warnings.warn(f"{function}(key=...) is deprecated: pass the same key as signing_key=...", DeprecationWarning, stacklevel=3)
    return key


def save_cache(
    path: str | os.PathLike[str] | None = None, *, signing_key: bytes | str | None = None, key: bytes | str | None = None
) -> CacheFile:
    """Complete torch's compile caches and write every artifact of this process to ``path``.

    Call it after the first training steps (each graph compiled once).  It first writes the cache
    entries of forward graphs whose backward ran under compiled autograd (torch writes a forward's
    entry only once it compiles that backward itself, which compiled autograd never asks for:
    this compiles each such backward once).  With no ``path`` that is all: a persistent
    ``TORCHINDUCTOR_CACHE_DIR`` then warms the next run.  With a ``path`` it also writes the file
    :func:`load_cache` reads, signed with ``signing_key`` (default: ``SUBCLASS_CA_CACHE_KEY``, else this
    user's key file; Note [Trusting a compile cache] in ``trust.py``; ``key=`` is its deprecated
    spelling); raises :class:`CacheFileError`
    when nothing was compiled with a cacheable backend (``inductor``).  The records written into
    the cache folder are signed with the default key, which the folder's reader checks.  Only
    records this process compiled, or read from a file that verified under the signing key, are
    signed: never what ``load_cache(..., trust_unsigned_code=True)`` let in.  The file is written
    to a new private file (0600, random name) and renamed over ``path``.
    """
    from .cacheable import complete_forward_entries

    chosen_key = _signing_key_argument("save_cache", signing_key, key)
    _warn_if_ca_graphs_are_not_cached()
    completed = complete_forward_entries()
    traced.write_records()
    if path is None:
        return CacheFile(path=_compat.cache_dir(), torch_version=str(torch.__version__), subclass_ca=package_digest(),
                         artifact_bytes=0, forward_entries_written=completed, traced_graphs=_folder_records())
    artifacts = _compat.save_cache_artifacts()
    if not artifacts:
        raise CacheFileError(
            f"save_cache({os.fspath(path)!r}): torch recorded no compile artifact in this process. Call it after "
            "the first steps have compiled (backend='inductor'; torch.compile's other backends have no persistent cache)."
        )
    artifacts = _without_unverified(os.fspath(path), artifacts)
    resolved = trust.resolve_key(chosen_key)
    records = traced.signable_records(resolved)
    payload = artifacts + pickle.dumps(records)
    header = _header()
    header["artifact_bytes"] = len(artifacts)
    header["sha256"] = hashlib.sha256(payload).hexdigest()
    encoded = _encode(resolved, header, payload)
    try:
        trust.write_private_file(path, encoded)  # a reader never sees half a file; a planted link is never followed
    except OSError as error:
        raise CacheFileError(
            f"save_cache({os.fspath(path)!r}): cannot write the file ({error}). Pass a path to a file in a folder you "
            "can write (nothing else, such as a directory, at that name)."
        ) from error
    return CacheFile(path=os.fspath(path), torch_version=str(header["torch"]), subclass_ca=str(header["subclass_ca"]),
                     artifact_bytes=len(artifacts), forward_entries_written=completed,
                     traced_graphs=traced.trace_count(records))


def _without_unverified(name: str, artifacts: bytes) -> bytes:
    """torch's artifacts less those only the opt-in let in (torch records an entry again when it reads it)."""
    if _unverified_unknown:
        raise CacheFileError(
            f"save_cache({name!r}): this process loaded a file with trust_unsigned_code=True, and torch "
            f"{_compat.TORCH_VERSION}'s artifacts cannot be told apart from this process's own: the file would sign "
            "what that opt-in let in. Save from a run that did not use the opt-in."
        )
    if not _unverified_artifacts:
        return artifacts
    kept = _torch_caches.without_artifacts(artifacts, frozenset(_unverified_artifacts))
    if kept is None:
        raise CacheFileError(f"save_cache({name!r}): cannot leave out the artifacts trust_unsigned_code=True let in "
                             "(this torch's mega-cache format is unreadable). Save from a run that did not use the opt-in.")
    return kept


def _folder_records() -> int:
    """How many of this process's records the cache folder holds under the default key (0: no key)."""
    if not traced.holds_records():
        return 0  # and no key file made for nothing
    try:
        return traced.trace_count(traced.signable_records(trust.resolve_key()))
    except trust.KeyUnavailable:
        return 0  # write_records said why, once


def _encode(signing_key: bytes, header: dict[str, Any], payload: bytes) -> bytes:
    """The file's bytes: magic, signature line, header, payload (the module's docstring)."""
    signed = json.dumps(header).encode() + b"\n" + payload
    return _MAGIC + _signature_line(signing_key, signed) + signed


def _signature_line(signing_key: bytes, signed: bytes) -> bytes:
    signer = trust.key_id(signing_key).encode()
    return _SIGNATURE + signer + b" " + trust.sign(signing_key, _PURPOSE, signer, signed).hex().encode() + b"\n"


def load_cache(
    path: str | os.PathLike[str],
    *,
    signing_key: bytes | str | None = None,
    strict: bool = True,
    missing_ok: bool = False,
    trust_unsigned_code: bool = False,
    key: bytes | str | None = None,
) -> CacheFile | None:
    """Load a :func:`save_cache` file into this process's compile caches; call it before the first step.

    The file must be signed with ``signing_key`` (default: ``SUBCLASS_CA_CACHE_KEY``, else this user's key
    file; ``key=`` is its deprecated spelling): its records are code, checked before anything is unpickled (Note [Trusting a compile
    cache] in ``trust.py``).  ``missing_ok``: a missing file returns None (a job's very first run).
    ``strict=False``: a file that is refused (not signed with the key, written by another torch or
    subclass_ca build, damaged) is skipped with a warning and None is returned (the job compiles
    afresh); by default it raises :class:`CacheFileError`.  Only a regular file is read (opened
    without following a link or blocking); anything else is refused the same way.
    ``trust_unsigned_code=True`` loads a file whose signature is missing or does not match, as
    ``torch.load(weights_only=False)`` does: only for a file you trust, since loading it runs the
    code it holds.  The opt-in ends with the call: the records it let in are used by this process
    only, and :func:`save_cache` never signs them again.
    """
    name = os.fspath(path)
    given = _signing_key_argument("load_cache", signing_key, key)
    # resolved once: a bad signing_key= is the caller's error, raised even with strict=False; the default key
    # (environment, key file) is resolved only if the file's signature is checked
    resolved = trust.resolve_key(given) if given is not None else None
    try:
        data = trust.read_regular_file(name, what=f"load_cache({name!r}): the cache file")
        if data is None:
            if missing_ok:
                return None
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), name)
        header, payload, verified_with = _parse(name, data, resolved, trust_unsigned_code)
        artifacts, records = payload[:header["artifact_bytes"]], _unpickled_records(name, payload[header["artifact_bytes"]:])
        if verified_with is None:
            _remember_unverified(artifacts)
        _compat.load_cache_artifacts(artifacts)
        traced.add_records(records, verified_with=verified_with)
    except CacheFileError as error:
        if strict:
            raise
        warnings.warn(f"{error} Skipped: this run compiles afresh.", RuntimeWarning, stacklevel=2)
        return None
    return CacheFile(path=name, torch_version=str(header["torch"]), subclass_ca=str(header["subclass_ca"]),
                     artifact_bytes=len(artifacts), traced_graphs=traced.trace_count(records))


def _remember_unverified(artifacts: bytes) -> None:
    global _unverified_unknown
    if not artifacts:
        return
    ids = _torch_caches.artifact_ids(artifacts)
    if ids is None:
        _unverified_unknown = True
    else:
        _unverified_artifacts.update(ids)


def _unpickled_records(name: str, pickled: bytes) -> dict[str, bytes]:
    """The file's kept traces (signed, or let in by the opt-in): a damaged pickle is the file's error, not a crash."""
    try:
        records = pickle.loads(pickled)  # noqa: S301  -- signed and checked in _parse, or the caller's opt-in
    except Exception as error:  # EOFError, UnpicklingError, ...: whatever a damaged pickle raises
        raise CacheFileError(f"load_cache({name!r}): the file is damaged (its records cannot be read: "
                             f"{type(error).__name__}: {error}); delete it.") from error
    if not isinstance(records, dict) or not all(isinstance(k, str) for k in records):
        raise CacheFileError(f"load_cache({name!r}): the file is damaged (its records are not kept traces); delete it.")
    return records


def _check_signature(name: str, data: bytes, key: bytes | None, trust_unsigned_code: bool) -> tuple[bytes, bytes | None]:
    """What the signature covers, and the key it verified under (None: the check failed and was waived); raises otherwise.

    ``key``: the signing key the caller gave, resolved; None: the default one, resolved here when needed."""
    line, sep, signed = data[len(_MAGIC):].partition(b"\n")
    fields = line[len(_SIGNATURE):].split(b" ") if line.startswith(_SIGNATURE) else []
    if trust_unsigned_code:
        if len(fields) != 2 or not sep:
            return data[len(_MAGIC):], None
        try:
            signing_key = key if key is not None else trust.resolve_key()
        except trust.KeyUnavailable:
            return signed, None
        return signed, signing_key if hmac.compare_digest(line + b"\n", _signature_line(signing_key, signed)) else None
    opt_in = ("Only if you trust whoever wrote it (loading it runs the code it holds): "
              "load_cache(..., trust_unsigned_code=True).")
    if len(fields) != 2 or not sep:
        raise CacheFileError(
            f"load_cache({name!r}): the file is not signed (written by an older subclass_ca, or crafted). Its records "
            f"are code and this user did not write it: refused before anything in it was read. {opt_in}"
        )
    signing_key = key if key is not None else trust.resolve_key()
    if hmac.compare_digest(line + b"\n", _signature_line(signing_key, signed)):
        return signed, signing_key
    signer, mine = fields[0].decode("ascii", "replace"), trust.key_id(signing_key)
    if signer != mine:
        why = (f"it was signed with another key (key id {signer}; yours is {mine}): another user's, or a job's key "
               f"this process was not given. Pass the job's key (load_cache(..., signing_key=...) or {trust.KEY_ENV}).")
    else:
        why = "it was changed after it was written (damaged or tampered with); delete it."
    raise CacheFileError(f"load_cache({name!r}): the signature does not match, refused before anything in it was read: {why} {opt_in}")


def _parse(name: str, data: bytes, key: bytes | None, trust_unsigned_code: bool) -> tuple[dict[str, Any], bytes, bytes | None]:
    """The header, the payload (artifacts + records) and the key the file verified under (None: the opt-in's)."""
    if not data.startswith(_MAGIC):
        raise CacheFileError(f"load_cache({name!r}): not a subclass_ca cache file (written by subclass_ca.save_cache).")
    signed, verified_with = _check_signature(name, data, key, trust_unsigned_code)
    line, sep, artifacts = signed.partition(b"\n")
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
    size = header.get("artifact_bytes")
    if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= len(artifacts):
        raise CacheFileError(f"load_cache({name!r}): the file is damaged (its header's artifact size {size!r} is not "
                             f"one of 0..{len(artifacts)}); delete it.")
    return header, artifacts, verified_with
