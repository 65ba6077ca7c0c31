"""Importing torchtitan's trainer on a CPU-only torch, where triton is not installed.

``torchtitan.trainer`` imports its expert-parallel module, which imports ``triton`` and defines Triton kernels
(``@triton.jit``, ``tl.*`` annotations) at import time; CPU wheels of torch ship no triton.  None of those
kernels runs on CPU, so for the import only, :func:`import_torchtitan_trainer` puts a permissive stand-in
for ``triton``/``triton.language`` into ``sys.modules`` and takes it out again afterwards, so that torch
itself never sees a triton (it probes for one).  With a real triton installed nothing is stubbed.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from collections.abc import Callable
from typing import Any


class _Anything:
    """Any attribute, call, subscript or arithmetic gives another ``_Anything`` (``tl.pointer_type(tl.int64)``,
    ``tl.constexpr``, ``triton.cdiv(...)``)."""

    def __getattr__(self, name: str) -> _Anything:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()

    def __call__(self, *args: Any, **kwargs: Any) -> _Anything:
        return _Anything()

    def __getitem__(self, key: Any) -> _Anything:
        return _Anything()


def _jit(*args: Any, **kwargs: Any) -> Any:
    """``@triton.jit`` and ``@triton.jit(...)``: the function itself (never launched on CPU)."""
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]

    def decorate(function: Callable[..., Any]) -> Callable[..., Any]:
        return function

    return decorate


def _stand_in(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__getattr__ = _Anything().__getattr__  # type: ignore[method-assign]
    return module


TORCHTITAN_MODULES = (
    "torchtitan.trainer",
    "torchtitan.train",
    "torchtitan.config.manager",
    "torchtitan.experiments",
    "torchtitan.models.llama3.config_registry",
    "subclass_ca.integrations.torchtitan",
)
"""What the tests use of torchtitan, imported while the stand-in is there (later imports would find no triton)."""


TORCH_MODULES_THAT_PROBE_TRITON = (
    "subclass_ca",
    "torch._dynamo",
    "torch._functorch.aot_autograd",
    "torch._dynamo.repro.after_dynamo",
    "torch._dynamo.backends.debugging",
    "torch._inductor.compile_fx",
    "torch.nn.attention.flex_attention",
)
"""The torch modules torchtitan's import reaches (it calls ``torch.compile`` at import), imported first: each
probes for triton once, at its import, and must find none."""


def import_torchtitan_trainer() -> types.ModuleType:
    """``import torchtitan.trainer`` and the rest of :data:`TORCHTITAN_MODULES`, with a triton stand-in if triton
    is absent; torch and subclass_ca are imported first, without it (torch's own probes must find no triton)."""
    for name in TORCH_MODULES_THAT_PROBE_TRITON:
        importlib.import_module(name)

    if importlib.util.find_spec("triton") is not None or "torchtitan.trainer" in sys.modules:
        return importlib.import_module("torchtitan.trainer")
    triton = _stand_in("triton")
    language = _stand_in("triton.language")
    triton.jit = _jit  # type: ignore[attr-defined]
    triton.language = language  # type: ignore[attr-defined]
    sys.modules.update({"triton": triton, "triton.language": language})
    try:
        for name in TORCHTITAN_MODULES:
            importlib.import_module(name)
        return importlib.import_module("torchtitan.trainer")
    finally:
        for name in ("triton", "triton.language"):
            sys.modules.pop(name, None)
