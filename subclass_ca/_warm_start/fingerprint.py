"""Stable descriptions of what a piece of code does, for keys of torch's persistent caches.

A description is a string that is equal in two processes exactly when the described object
behaves the same in both, as far as this module can tell (Note [Warm start through torch's
caches] in ``cacheable.py``).  Whatever cannot be described that way (an object whose only
text is ``<... at 0x7f...>``, a tensor's values) raises :class:`Unstable`; the caller then keys
by this process's nonce (:func:`process_local`, the one place such keys are made and their reasons
recorded), so the entry can miss across processes but never hits stale.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import os
import re
import threading
import types
import uuid
from typing import Any

import torch

from .. import _compat

__all__ = ["NONCE", "Unstable", "describe", "digest", "package_digest", "process_local", "tensor_contents",
           "uncacheable_reasons"]

_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")
_MAX_DEPTH = 12


class Unstable(Exception):
    """The object has no description that is stable across processes; the message says why."""


def digest(*parts: str) -> str:
    """A short hex digest of the given descriptions."""
    return hashlib.blake2b("\x1f".join(parts).encode(), digest_size=12).hexdigest()


NONCE = uuid.uuid4().hex
"""This process's nonce: a key that holds it is never found by another process."""
_reasons: dict[str, str] = {}
_reasons_lock = threading.Lock()


def process_local(what: str, reason: str) -> str:
    """The key of ``what``, which has no stable description (``reason``): found by this process only.  The one place
    such keys are made; :func:`uncacheable_reasons` lists them."""
    with _reasons_lock:
        _reasons[what] = reason
    return f"process-local {NONCE} ({what}: {reason})"


def uncacheable_reasons() -> dict[str, str]:
    """What had no stable description in this process (its entries miss in every other process), and why."""
    with _reasons_lock:
        return dict(_reasons)


def tensor_contents(value: torch.Tensor) -> str:
    """A plain tensor described by its metadata and the digest of its values (a graph constant); a fake tensor has no
    values to describe (:class:`Unstable`)."""
    if _compat.is_fake(value):
        raise Unstable("a fake constant (its values are unknown at trace time)")
    data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return f"{value.dtype} {tuple(value.shape)} {value.stride()} {digest(data.hex())}"


@functools.cache
def package_digest() -> str:
    """subclass_ca's version and the digest of its own source: any change to our code is a new key."""
    from .._version import __version__

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package, not this subpackage
    hasher = hashlib.blake2b(digest_size=12)
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("__pycache__", "testing"))
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            hasher.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as f:
                hasher.update(f.read())
    return f"subclass_ca {__version__} {hasher.hexdigest()}"


def describe(obj: Any, *, depth: int = 0, seen: frozenset[int] = frozenset()) -> str:
    """A description of ``obj`` that two processes agree on when it behaves the same; else :class:`Unstable`.

    ``seen``: the classes and functions being described further out; meeting one again (a function
    that names its own class, say) describes it by name only, which breaks the cycle.
    """
    if depth > _MAX_DEPTH:
        raise Unstable("nested too deeply to describe")
    if isinstance(obj, (type, types.FunctionType)) and id(obj) in seen:
        return f"ref {getattr(obj, '__module__', None)}.{obj.__qualname__}"
    nested = functools.partial(describe, depth=depth + 1, seen=seen)
    if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
        return repr(obj)
    if isinstance(obj, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return repr(obj)
    if isinstance(obj, torch.Size):
        return f"Size({', '.join(map(nested, obj))})"
    if isinstance(obj, torch.SymInt | torch.SymFloat | torch.SymBool):
        raise Unstable(f"a symbolic value ({obj!r})")
    if isinstance(obj, torch.Tensor):
        raise Unstable(f"a tensor ({type(obj).__qualname__}) whose values a description cannot hold")
    if isinstance(obj, enum.Enum):
        return f"{type(obj).__module__}.{type(obj).__qualname__}.{obj.name}"
    if isinstance(obj, (tuple, list)):
        open_, close = ("(", ")") if isinstance(obj, tuple) else ("[", "]")
        return f"{type(obj).__qualname__}{open_}{', '.join(map(nested, obj))}{close}"
    if isinstance(obj, (set, frozenset)):
        return f"{type(obj).__qualname__}{{{', '.join(sorted(map(nested, obj)))}}}"
    if isinstance(obj, dict):
        items = sorted(f"{nested(k)}: {nested(v)}" for k, v in obj.items())
        return f"dict{{{', '.join(items)}}}"
    if isinstance(obj, types.ModuleType):
        return f"module {obj.__name__}"
    if isinstance(obj, type):
        return describe_class(obj, depth=depth, seen=seen)
    if isinstance(obj, functools.partial):
        return f"partial({nested(obj.func)}, {nested(obj.args)}, {nested(obj.keywords)})"
    if isinstance(obj, types.MethodType):
        return f"method {nested(obj.__func__)} of {nested(obj.__self__)}"
    if isinstance(obj, types.FunctionType):
        return describe_function(obj, depth=depth, seen=seen)
    if isinstance(obj, types.BuiltinFunctionType):
        return f"builtin {getattr(obj, '__module__', None)}.{obj.__qualname__}"
    if dataclasses.is_dataclass(obj):
        fields = ", ".join(f"{f.name}={nested(getattr(obj, f.name))}" for f in dataclasses.fields(obj))
        return f"{type(obj).__module__}.{type(obj).__qualname__}({fields})"
    text = repr(obj)
    class_repr: object = type(obj).__repr__  # the class's own function (mypy types type[Any].__repr__ as type's bound method)
    if class_repr is object.__repr__ or _ADDRESS.search(text):
        raise Unstable(f"a {type(obj).__qualname__} whose text names a memory address ({text[:80]})")
    return f"{type(obj).__module__}.{type(obj).__qualname__} {text}"


def describe_class(cls: type, *, depth: int = 0, seen: frozenset[int] = frozenset()) -> str:
    """A class by its name; a class outside torch also by the code of its flatten protocol."""
    name = f"class {cls.__module__}.{cls.__qualname__}"
    if cls.__module__.split(".")[0] in ("torch", "builtins"):
        return name  # torch's own classes change only with torch, which is part of every key
    seen = seen | {id(cls)}
    protocol = []
    for method in ("__tensor_flatten__", "__tensor_unflatten__", "__torch_dispatch__"):
        found = cls.__dict__.get(method)
        fn = getattr(found, "__func__", found)  # a staticmethod's or classmethod's function
        protocol.append(describe_function(fn, depth=depth + 1, seen=seen) if isinstance(fn, types.FunctionType) else "-")
    return f"{name} [{', '.join(protocol)}]"


def describe_function(fn: types.FunctionType, *, depth: int = 0, seen: frozenset[int] = frozenset()) -> str:
    """A function by its code, the globals that code names and its closure's contents."""
    seen = seen | {id(fn)}
    nested = functools.partial(describe, depth=depth + 1, seen=seen)
    parts = [f"function {fn.__module__}.{fn.__qualname__}", _describe_code(fn.__code__)]
    module = fn.__module__ or ""
    # a function of torch's or ours reads globals that change only with torch or with our code,
    # both part of every key; generated code (AOT's prologues) and user code are described whole
    ours = module.split(".")[0] in ("torch", "subclass_ca") and fn.__code__.co_filename.endswith(".py")
    names = set() if ours else _global_names(fn.__code__)
    if not fn.__code__.co_filename.endswith(".py"):  # generated code: its diagnostics are not its behaviour
        names -= _compat.GENERATED_DIAGNOSTIC_GLOBALS
    for name in sorted(names):
        if name in fn.__globals__:
            parts.append(f"{name}={nested(fn.__globals__[name])}")
    for cell in fn.__closure__ or ():
        try:
            contents = cell.cell_contents
        except ValueError:  # an empty cell
            contents = None
        parts.append(nested(contents))
    if fn.__defaults__:
        parts.append(nested(fn.__defaults__))
    if fn.__kwdefaults__:
        parts.append(nested(fn.__kwdefaults__))
    return " ".join(parts)


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _describe_code(code: types.CodeType) -> str:
    consts = [_describe_code(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts]
    return digest(code.co_code.hex(), repr(consts), repr(code.co_names), repr(code.co_varnames))
